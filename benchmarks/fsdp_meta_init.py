"""Megatron-FSDP meta-device init vs eager init, and our FSDP vs bare FSDP2 training throughput.

Part 1 (init): build a GPT (default about 1B parameters) either
  - meta:  under ``torch.device('meta')``, then ``FullyShardedDataParallel`` materialises + resets + shards it
           layer by layer, or
  - eager: on the device (``init_weights`` in the constructor), then ``FullyShardedDataParallel`` shards it,
and report per rank the time (build + materialise/init + shard) and the peak memory above the start of the run
(CUDA: ``torch.cuda.max_memory_allocated``; CPU: peak RSS growth from ``/proc`` / ``getrusage``). Each mode runs
in its own fresh processes, so peaks do not mix.

Part 2 (train): tokens/s of ``FullyShardedDataParallel`` + ``get_megatron_optimizer`` vs bare FSDP2
(``fully_shard`` per TransformerLayer + root, same MixedPrecisionPolicy, ``torch.optim.AdamW``,
``clip_grad_norm_``) on the same model and data, in the same run, measured in alternating blocks.

Usage: ``python benchmarks/fsdp_meta_init.py [--ranks 2] [--hidden 2048 --layers 18 --vocab 32000]``
(gloo on CPU, NCCL on CUDA; one process per rank, spawned here). ``--small`` is a local CPU size.
"""
import argparse
import os
import resource
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _config(a, bf16=False):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, ffn_hidden_size=4 * a.hidden,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=bf16, add_bias_linear=False, transformer_impl="local",
    )


def _gpt(cfg, a, meta: bool):
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return GPTModel(cfg, vocab_size=a.vocab, max_sequence_length=a.seq)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if dev is not None:
        with torch.device(dev):
            return GPTModel(cfg, vocab_size=a.vocab, max_sequence_length=a.seq)
    return GPTModel(cfg, vocab_size=a.vocab, max_sequence_length=a.seq)


def _init_body(rank, ws, a, mode, q):
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: F401  (imports before the baseline)
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    cfg = _config(a)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    base_rss = _rss_bytes()
    dist.barrier()
    t0 = time.perf_counter()
    model = _gpt(cfg, a, meta=(mode == "meta"))
    n_params = sum(p.numel() for p in model.parameters())
    fsdp = FullyShardedDataParallel(cfg, DistributedDataParallelConfig(use_megatron_fsdp=True), model)
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else (_peak_rss_bytes() - base_rss)
    local = sum(p.to_local().numel() * p.element_size() for p in fsdp.module.parameters())
    q.put((rank, dict(mode=mode, time_s=dt, peak_bytes=peak, local_param_bytes=local, n_params=n_params)))


def _train_body(rank, ws, a, q):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    bf16 = torch.cuda.is_available()
    cfg = _config(a, bf16=bf16)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    # ours: meta init + FullyShardedDataParallel + MegatronOptimizer
    ours = FullyShardedDataParallel(cfg, DistributedDataParallelConfig(use_megatron_fsdp=True), _gpt(cfg, a, True))
    ours_opt = get_megatron_optimizer(OptimizerConfig(lr=1e-4, clip_grad=1.0), [ours])
    # bare FSDP2 on the same model
    bare = _gpt(cfg, a, False).to(dev)
    mesh = DeviceMesh.from_group(dist.group.WORLD, dev.type)
    mpp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for m in bare.modules():
        if isinstance(m, TransformerLayer):
            fully_shard(m, mesh=mesh, mp_policy=mpp)
    fully_shard(bare, mesh=mesh, mp_policy=mpp)
    bare_opt = torch.optim.AdamW(bare.parameters(), lr=1e-4, weight_decay=0.01)

    g = torch.Generator().manual_seed(rank)
    tok = torch.randint(0, a.vocab, (a.mbs, a.seq + 1), generator=g).to(dev)
    inp, lab = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
    pos = torch.arange(a.seq, device=dev).unsqueeze(0).expand(a.mbs, a.seq)

    def step_ours():
        ours_opt.zero_grad()
        ours(inp, pos, labels=lab).mean().backward()
        ours.finish_grad_sync()
        ours_opt.step()

    def step_bare():
        bare_opt.zero_grad(set_to_none=True)
        bare(inp, pos, labels=lab).mean().backward()
        torch.nn.utils.clip_grad_norm_(list(bare.parameters()), 1.0)
        bare_opt.step()

    def timed(fn, n):
        dist.barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - t0

    for _ in range(a.warmup):
        step_ours()
        step_bare()
    t_ours = t_bare = 0.0
    for _ in range(a.blocks):  # alternate blocks so drift on a shared machine hits both
        t_ours += timed(step_ours, a.steps)
        t_bare += timed(step_bare, a.steps)
    tokens = a.blocks * a.steps * a.mbs * a.seq * ws
    q.put((rank, dict(ours_tok_s=tokens / t_ours, bare_tok_s=tokens / t_bare)))


def _worker(rank, ws, store_path, fn, args, q):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ws), LOCAL_RANK=str(rank))
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
        backend = "nccl"
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ws))
        backend = "gloo"
    dist.init_process_group(backend, store=dist.FileStore(store_path, ws), rank=rank, world_size=ws)
    try:
        fn(rank, ws, *args, q)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _run(fn, ws, *args):
    ctx = mp.get_context("spawn" if torch.cuda.is_available() else "fork")
    q = ctx.Queue()
    fd, store = tempfile.mkstemp(prefix="fsdp_bench_")
    os.close(fd)
    os.unlink(store)
    procs = [ctx.Process(target=_worker, args=(r, ws, store, fn, args, q)) for r in range(ws)]
    for p in procs:
        p.start()
    out = dict(q.get(timeout=3600) for _ in range(ws))
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"benchmark rank exited with {p.exitcode}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--small", action="store_true", help="local CPU size for part 1 (~0.2B params)")
    ap.add_argument("--train-hidden", type=int, default=256)
    ap.add_argument("--train-layers", type=int, default=4)
    ap.add_argument("--train-vocab", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--skip-init", action="store_true")
    ap.add_argument("--skip-train", action="store_true")
    a = ap.parse_args()
    if a.small:
        a.hidden, a.layers, a.heads = 1024, 12, 8
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"# fsdp_meta_init  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  device: {device}  ranks: {a.ranks}")
    if not a.skip_init:
        res = {mode: _run(_init_body, a.ranks, a, mode) for mode in ("meta", "eager")}
        n = res["meta"][0]["n_params"]
        print(f"\n## init: GPT h={a.hidden} L={a.layers} vocab={a.vocab}: {n / 1e9:.3f} B parameters (fp32)")
        print("| mode | rank | time s | peak MiB | local shard MiB |")
        print("| --- | --- | --- | --- | --- |")
        for mode in ("meta", "eager"):
            for r in sorted(res[mode]):
                x = res[mode][r]
                print(f"| {mode} | {r} | {x['time_s']:.2f} | {x['peak_bytes'] / 2**20:.0f} | "
                      f"{x['local_param_bytes'] / 2**20:.0f} |")
        pm = max(x["peak_bytes"] for x in res["meta"].values())
        pe = max(x["peak_bytes"] for x in res["eager"].values())
        tm = max(x["time_s"] for x in res["meta"].values())
        te = max(x["time_s"] for x in res["eager"].values())
        print(f"\nmeta/eager peak memory ratio: {pm / pe:.3f}   meta/eager time ratio: {tm / te:.3f}")
    if not a.skip_train:
        ta = argparse.Namespace(**vars(a))
        ta.hidden, ta.layers, ta.vocab, ta.heads = a.train_hidden, a.train_layers, a.train_vocab, max(1, a.train_hidden // 64)
        res = _run(_train_body, a.ranks, ta)
        ours = min(x["ours_tok_s"] for x in res.values())
        bare = min(x["bare_tok_s"] for x in res.values())
        print(f"\n## train: GPT h={ta.hidden} L={ta.layers} vocab={ta.vocab} seq={ta.seq} mbs={ta.mbs} x {a.ranks} ranks")
        print("| impl | tokens/s |")
        print("| --- | --- |")
        print(f"| ours (FullyShardedDataParallel) | {ours:.0f} |")
        print(f"| bare FSDP2 (fully_shard) | {bare:.0f} |")
        print(f"\nours/bare tokens/s ratio: {ours / bare:.3f} (goal >= 0.95)")


if __name__ == "__main__":
    main()
