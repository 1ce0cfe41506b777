"""Per-layer CUDA graphs (``--cuda-graph-impl``, issue 44): wall ms/step against device-busy ms/step and tokens/s,
graphs off vs ``local`` vs ``transformer_engine``, on one GPU.

Models (bf16, Transformer Engine layers where TE is installed, else local), as the earlier benchmarks:

- ``dense``: the GPT of issue 16 / ``fsdp_step_profile.py``'s default: 8 layers, hidden 2048, ffn 8192, 16 heads, seq
  2048, micro-batch 4, vocab 32768, one micro-batch per step; graphs of the whole layer;
- ``moe``: the MoE benchmark model of RESULTS.md's "Session of 2026-12-04, eighth" (``fsdp_step_profile.py --experts
  4 --layers 6 --ffn 4096 --seq 1024 --mbs 2 --micro-batches 4``): hidden 2048, 4 experts top-2 (alltoall
  dispatcher, sequential experts), 4 micro-batches per step; graphs of ``attn moe_router`` (the dispatch and the
  experts stay eager); with TE also its FP8 (hybrid, delayed scaling) rows, where ``local`` is refused (FP8 graphs
  need ``transformer_engine``);
- ``moe_pad``: the ``moe`` model with drop-and-pad experts (``--moe-expert-capacity-factor 1.0
  --moe-pad-expert-input-to-capacity``: every expert gets exactly its capacity's rows, the dispatch reads nothing from
  the device); graphs of ``attn moe`` (the whole MoE layer: router, dispatch, experts, combine); FP8 rows as ``moe``.
  Its ``none`` row is the eager drop-and-pad baseline (the same FLOPs as the graphed rows; the dropless ``moe``
  rows compute other tokens).

Each row builds its model as ``pretrain_gpt.py`` does (``DistributedDataParallel`` + ``get_megatron_optimizer``, the
step of ``training.train_step``), runs ``--cuda-graph-warmup-steps`` eager steps, the capture (``CudaGraphHelper``,
as the training loop), two more steps, then ``--steps`` timed steps (wall, synchronized) and ``--profile-steps`` under
``torch.profiler`` (device busy: the sum of kernel and memcpy times, ``training.profiling.host_summary``). Rows run
one after the other, each model freed before the next. About 2-3 minutes on one H100.

Usage: ``python benchmarks/cuda_graphs_gpu.py`` (GPU); ``--models moe,moe_pad``; ``--small`` (CPU: the graphs-off rows of a
tiny model only, to check the script).
"""
import argparse
import contextlib
import gc
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = {
    "dense": dict(layers=8, hidden=2048, ffn=8192, heads=16, seq=2048, mbs=4, vocab=32768, experts=0,
                  micro_batches=1, modules=[]),
    "moe": dict(layers=6, hidden=2048, ffn=4096, heads=16, seq=1024, mbs=2, vocab=32768, experts=4,
                micro_batches=4, modules=["attn", "moe_router"]),
    "moe_pad": dict(layers=6, hidden=2048, ffn=4096, heads=16, seq=1024, mbs=2, vocab=32768, experts=4,
                    micro_batches=4, modules=["attn", "moe"], capacity_factor=1.0),
}
SMALL = dict(layers=2, hidden=128, ffn=256, heads=4, seq=64, mbs=2, vocab=512)


def _have_te() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE) and torch.cuda.is_available()


def _config(m, impl: str, fp8: bool, te: bool, warmup: int):
    from megatron.core.transformer import TransformerConfig

    cuda = torch.cuda.is_available()
    kw = dict(num_layers=m["layers"], hidden_size=m["hidden"], num_attention_heads=m["heads"],
              ffn_hidden_size=m["ffn"], hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
              bf16=cuda, params_dtype=torch.bfloat16 if cuda else torch.float32,
              transformer_impl="transformer_engine" if te else "local",
              cuda_graph_impl=impl, cuda_graph_modules=list(m["modules"]), cuda_graph_warmup_steps=warmup)
    if m["experts"]:
        kw.update(num_moe_experts=m["experts"], moe_router_topk=2, moe_token_dispatcher_type="alltoall")
    if m.get("capacity_factor") is not None:  # drop-and-pad
        kw.update(moe_expert_capacity_factor=m["capacity_factor"], moe_pad_expert_input_to_capacity=True)
    if fp8:
        kw.update(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=1024, fp8_amax_compute_algo="max")
    return TransformerConfig(**kw)


def _build(m, cfg):
    """(step closure, graphs helper or None): DDP + Megatron optimizer, the step of training.train_step."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.data_parallel_wrapper import wrap_data_parallel
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.cuda_graphs import build_cuda_graph_helper, use_capture_stream

    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    use_capture_stream(cfg.cuda_graph_impl)  # as pretrain: before the model and its DDP hooks exist
    with dev:
        gpt = GPTModel(cfg, vocab_size=m["vocab"], max_sequence_length=m["seq"],
                       share_embeddings_and_output_weights=True)
    model = wrap_data_parallel(cfg, DistributedDataParallelConfig(), gpt)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-4, clip_grad=1.0, weight_decay=0.01, bf16=cfg.bf16), [model])
    helper = build_cuda_graph_helper([model], cfg)
    n = m["micro_batches"]

    def step(inp, pos, lab):
        if helper is not None:
            helper.before_step()
        model.zero_grad_buffer()
        opt.zero_grad()
        for i in range(n):
            with model.no_sync() if i < n - 1 else contextlib.nullcontext():
                model(inp, pos, labels=lab).float().mean().backward()
        finalize_model_grads([model])
        opt.step()

    return step, helper


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _measure(step, batch, steps: int, profile_steps: int):
    from torch.profiler import ProfilerActivity, profile

    from megatron.training.profiling import host_summary

    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(*batch)
    _sync()
    wall = (time.perf_counter() - t0) / steps
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t1 = time.perf_counter()
        for _ in range(profile_steps):
            step(*batch)
        _sync()
        pwall = time.perf_counter() - t1
    s = host_summary(prof.events(), prof.key_averages(), pwall, profile_steps, cuda=cuda)
    return wall * 1000.0, s


def _rows(models, te: bool, fp8: bool, cuda: bool):
    out = []
    for name in models:
        impls = ["none"] + (["local"] + (["transformer_engine"] if te else []) if cuda else [])
        out += [(name, impl, False) for impl in impls]
        if fp8:
            out += [(name, impl, True) for impl in ["none"] + (["transformer_engine"] if cuda else [])]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per row")
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--warmup-steps", type=int, default=2, help="--cuda-graph-warmup-steps (eager steps)")
    ap.add_argument("--no-fp8", action="store_true", help="skip the FP8 rows")
    ap.add_argument("--no-te", action="store_true", help="local layers even with TE (no transformer_engine rows)")
    ap.add_argument("--small", action="store_true", help="tiny sizes (CPU check of the script)")
    a = ap.parse_args(argv)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    if any(m not in MODELS for m in models):
        ap.error(f"--models: known {', '.join(MODELS)}")
    cuda = torch.cuda.is_available()
    te = _have_te() and not a.no_te
    fp8 = te and not a.no_fp8
    if cuda:
        torch.cuda.set_device(0)
    fd, store = tempfile.mkstemp(prefix="cuda_graphs_gpu_")
    os.close(fd)
    os.unlink(store)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    name = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    print(f"# cuda_graphs_gpu  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  device: {name}  "
          f"torch {torch.__version__}  TE layers: {te}  warm-up steps {a.warmup_steps}, {a.steps} timed + "
          f"{a.profile_steps} profiled steps per row")
    if not cuda:
        print("(no CUDA: only the graphs-off rows)")
    results = []
    t_start = time.perf_counter()
    for model_name, impl, use_fp8 in _rows(models, te, fp8, cuda):
        m = dict(MODELS[model_name], **(SMALL if a.small else {}))
        g = torch.Generator().manual_seed(0)
        tok = torch.randint(0, m["vocab"], (m["mbs"], m["seq"] + 1), generator=g).to(dev)
        batch = (tok[:, :-1].contiguous(), torch.arange(m["seq"], device=dev).unsqueeze(0).expand(m["mbs"], -1),
                 tok[:, 1:].contiguous())
        label = f"{model_name}{' fp8' if use_fp8 else ''}"
        t0 = time.perf_counter()
        step = helper = None
        try:
            cfg = _config(m, impl, use_fp8, te, a.warmup_steps)
            step, helper = _build(m, cfg)
            for _ in range(a.warmup_steps + 2):  # eager warm-up, the capture, one replayed step
                step(*batch)
            wall, s = _measure(step, batch, a.steps, a.profile_steps)
        except Exception as e:  # one failing row must not cost the others
            import traceback

            traceback.print_exc()
            print(f"  FAILED {label} {impl}: {type(e).__name__}: {e}", flush=True)
            results.append((label, impl, None, None, m, ""))
        else:
            regions = len(helper.graphed_regions()) if helper is not None else 0
            print(f"  {label} {impl}: {time.perf_counter() - t0:.1f} s (graphed regions: {regions})", flush=True)
            results.append((label, impl, wall, s, m, f"{regions}"))
        if helper is not None:
            helper.remove()
        del step, helper
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    print("\n| model | --cuda-graph-impl | graphed regions | wall ms/step | device busy ms/step | host-bound "
          "(wall - busy) ms | tokens/s | vs off |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    base = {}
    for label, impl, wall, s, m, regions in results:
        if wall is None:
            print(f"| {label} | {impl} | - | failed | - | - | - | - |")
            continue
        tps = m["mbs"] * m["seq"] * m["micro_batches"] / (wall / 1000.0)
        if impl == "none":
            base[label] = tps
        ratio = f"{tps / base[label]:.3f}" if label in base else "-"
        print(f"| {label} | {impl} | {regions} | {wall:.1f} | {s['device_ms']:.1f} | "
              f"{max(wall - s['device_ms'], 0.0):.1f} | {tps:.0f} | {ratio} |")
    print(f"\n(total {time.perf_counter() - t_start:.0f} s; device busy: kernel + memcpy time under torch.profiler "
          f"over {a.profile_steps} steps; graph-launched kernels are counted where CUPTI reports them)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
