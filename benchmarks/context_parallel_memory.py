"""Activation bytes per rank vs sequence length at context-parallel sizes 1, 2, 4 (CPU, gloo, fp32).

    python benchmarks/context_parallel_memory.py [--seqs 512 1024 2048 4096] [--cps 1 2 4] [--layers 2 --hidden 64]

For each CP size ``C`` and sequence length ``s``, ``C`` processes (gloo) build the same GPT (``--transformer-impl
local``, RoPE; ring attention for ``C`` > 1) and run one forward on one sequence, each rank on its ``s / C`` tokens
(2 x C load-balanced chunks). The figure: the bytes autograd keeps for backward on rank 0 after the forward
(distinct storages of the saved tensors, parameters left out), i.e. the activations a backward needs; the loss is
then back-propagated so the ring's backward runs too. Printed: a table of MiB per rank for every (C, s), its ratio
to C = 1 at the same s, and the "longer sequence" column: bytes at (C, C x s0) over bytes at (1, s0) (s0: the
shortest length), which is ~1 when a C times longer sequence fits in the same per-rank memory at CP C. CPU
figures: quote the ratios only (benchmarks/README.md).

CP = 1 runs ``F.scaled_dot_product_attention`` (with ``--attention-backend`` auto torch picks its CPU flash kernel,
which keeps no ``[s, s]`` matrix; ``--attention-backend unfused``: the math kernel, which keeps the probabilities).
"""
import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.autograd.graph import saved_tensors_hooks


def _measure(rank, cp, seqs, a, queue, store_path):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cp), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, cp), rank=rank, world_size=cp)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.context_parallel import split_for_cp_rank

    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(1)
    cfg = TransformerConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                            hidden_dropout=0.0, attention_dropout=0.0, context_parallel_size=cp,
                            attention_backend=a.attention_backend)
    model = GPTModel(cfg, vocab_size=a.vocab, max_sequence_length=max(seqs), position_embedding_type="rope")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out = {}
    for s in seqs:
        g = torch.Generator().manual_seed(s)
        tokens = torch.randint(0, a.vocab, (1, s), generator=g)
        labels = torch.randint(0, a.vocab, (1, s), generator=g)
        pos = torch.arange(s)[None]
        tokens, labels, pos = (split_for_cp_rank(t, 1, cp, rank) for t in (tokens, labels, pos))
        kept = []
        with saved_tensors_hooks(lambda t: (kept.append(t), t)[1], lambda t: t):
            loss = model(tokens, pos, None, labels=labels).sum()
        storages = {}
        for t in kept:
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                storages[(st.data_ptr(), id(st) if st.size() == 0 else 0)] = st.nbytes()
        del kept
        loss.backward()
        model.zero_grad(set_to_none=True)
        out[s] = sum(storages.values())
    if rank == 0:
        queue.put(out)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def run(cp, seqs, a):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    fd, store = tempfile.mkstemp(prefix="cp_mem_store_")
    os.close(fd)
    os.unlink(store)
    procs = [ctx.Process(target=_measure, args=(r, cp, seqs, a, queue, store)) for r in range(cp)]
    for p in procs:
        p.start()
    result = queue.get(timeout=1200)
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"CP {cp}: a rank exited with {p.exitcode}")
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "unfused", "flash"])
    a = ap.parse_args(argv)
    seqs = sorted(set(a.seqs) | {a.seqs[0] * c for c in a.cps if a.seqs[0] * c <= max(a.seqs) * max(a.cps)})
    for c in a.cps:
        bad = [s for s in seqs if s % (2 * c)]
        if bad:
            ap.error(f"--seqs {bad} must be multiples of 2 x CP ({2 * c})")
    bytes_ = {c: run(c, seqs, a) for c in a.cps}
    s0 = a.seqs[0]
    print(f"activation bytes per rank (saved for backward, rank 0), {a.layers} layers, hidden {a.hidden}, "
          f"attention backend at CP 1: {a.attention_backend}")
    print(f"{'seq':>7} | " + " | ".join(f"CP{c} MiB  x CP1" for c in a.cps))
    for s in seqs:
        if s not in a.seqs:
            continue
        print(f"{s:>7} | " + " | ".join(f"{bytes_[c][s] / 2**20:8.2f} {bytes_[c][s] / bytes_[1][s]:6.3f}"
                                        for c in a.cps))
    print(f"\na CP times longer sequence: bytes at (CP, CP x {s0}) / bytes at (CP1, {s0})")
    for c in a.cps:
        print(f"  CP{c}: seq {c * s0:>6}: {bytes_[c][c * s0] / bytes_[1][s0]:.3f}")


if __name__ == "__main__":
    main()
