"""Megatron-FSDP step overhead on ONE device: DDP vs Megatron-FSDP vs bare FSDP2, tokens/s and (``--profile``)
where the time goes.

One process, one device (CUDA when present, else CPU; a world-size-1 process group: NCCL / gloo), the GPT of
issue 16 (dense, 8 layers, hidden 2048, ffn 8192, seq 2048, micro-batch 4; sizes are flags, ``--small`` is a CPU
size). Modes (each its own model, all alive at once, measured in alternating blocks so drift hits them alike):

- ``ddp``: ``DistributedDataParallel`` + ``get_megatron_optimizer`` (bf16 params, fp32 main copies), the step of
  ``megatron/training/training.py``'s ``train_step`` (zero_grad_buffer, zero_grad, forward, backward,
  ``finalize_model_grads``, ``optimizer.step()``);
- ``fsdp``: ``FullyShardedDataParallel`` (FSDP2, fp32 sharded main params, bf16 compute) + ``get_megatron_optimizer``,
  the same step;
- ``bare``: bare FSDP2: ``fully_shard`` per ``TransformerLayer`` + root, the same ``MixedPrecisionPolicy``,
  ``torch.optim.AdamW``, ``torch.nn.utils.clip_grad_norm_``;

and, when Transformer Engine is importable (``megatron/core/extensions/transformer_engine.py``) and CUDA is
present, the FP8 (delayed scaling, hybrid) rows: ``ddp_fp8`` (DDP + FP8 autocast, the issue's baseline),
``fsdp_fp8pg`` (meta-device init + FP8 primary weights built under ``quantized_model_init`` +
``fp8_param_gather``: what ``pretrain_gpt.py --use-megatron-fsdp --init-model-with-meta-device --fp8-format hybrid
--fp8-recipe delayed --fp8-param-gather`` builds), ``fsdp_fp8`` and ``bare_fp8`` (FP8 autocast, bf16 weights).
The ratio column is tokens/s over the DDP row of the same precision. ``--micro-batches N``: N forward/backward
passes per step, all but the last under the engine's ``no_sync`` (the trainer's gradient accumulation; the MoE run of
``train_tp_ep_gpu.sh`` has GBS 8 / MBS 2 = 4), so the engines are compared in-process, interleaved, at the trainer's
shape: its separate processes spread more between runs than the engines differ.

``--profile``: after timing, each mode runs ``--profile-steps`` steps under ``torch.profiler`` and prints its
top-20 ops by self device time (self CPU time on CPU or with ``--sort cpu``) and a summary: wall ms/step, device
busy ms/step (sum of kernel times), host-side ms/step outside aten ops (Python, DTensor/FSDP2 bookkeeping:
"py ms"), and host syncs per step (``aten::_local_scalar_dense``: ``.item()``, ``float()``/``bool()`` of a tensor).

Usage: ``python benchmarks/fsdp_step_profile.py [--profile]`` (GPU, about a minute); CPU: ``--small [--profile]``.
"""
import argparse
import contextlib
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _have_te() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE) and torch.cuda.is_available()


def _config(a, *, params_dtype, fp8: bool = False, fp8_param: bool = False, meta: bool = False):
    from megatron.core.transformer import TransformerConfig

    kw = dict(
        num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, ffn_hidden_size=a.ffn,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=a.bias, bf16=a.bf16, params_dtype=params_dtype,
        transformer_impl="transformer_engine" if a.te else "local", init_model_with_meta_device=meta,
    )
    if a.experts:
        kw.update(num_moe_experts=a.experts, moe_router_topk=2, moe_token_dispatcher_type="alltoall")
    if fp8:
        kw.update(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=1024, fp8_amax_compute_algo="max",
                  fp8_param=fp8_param)
    return TransformerConfig(**kw)


def _gpt(cfg, a, meta: bool = False):
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(0)
    with torch.device("meta" if meta else _device()):
        return GPTModel(cfg, vocab_size=a.vocab, max_sequence_length=a.seq, share_embeddings_and_output_weights=True)


# ---- the modes ------------------------------------------------------------------------------------------------
def _build_ours(a, kind: str, fp8: bool, fp8_param: bool):
    """(model, step-closure) for ``ddp`` / ``fsdp`` built as ``pretrain_gpt.py`` does (training.get_model)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.data_parallel_wrapper import wrap_data_parallel
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dtype = torch.bfloat16 if a.bf16 else torch.float32
    meta = fp8_param  # the FP8 param-gather runs use meta-device init
    distopt = kind == "distopt"
    cfg = _config(a, params_dtype=dtype, fp8=fp8, fp8_param=fp8_param, meta=meta)
    ddp_cfg = DistributedDataParallelConfig(use_megatron_fsdp=(kind == "fsdp"), fp8_param_gather=fp8_param,
                                            use_distributed_optimizer=distopt,
                                            data_parallel_sharding_strategy="optim_grads_params" if kind == "fsdp"
                                            else "no_shard", suggested_communication_unit_size=a.unit_size)
    model = wrap_data_parallel(cfg, ddp_cfg, _gpt(cfg, a, meta=meta))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-4, clip_grad=1.0, weight_decay=0.01, bf16=a.bf16,
                                                 use_distributed_optimizer=distopt), [model])

    def step(inp, pos, lab):
        model.zero_grad_buffer()
        opt.zero_grad()
        for i in range(a.micro_batches):  # as the no-pipelining schedule: no_sync for all but the last
            with model.no_sync() if i < a.micro_batches - 1 else contextlib.nullcontext():
                model(inp, pos, labels=lab).float().mean().backward()
        finalize_model_grads([model])
        opt.step()

    return model, step


def _build_bare(a, fp8: bool):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from megatron.core.transformer.transformer_layer import TransformerLayer

    cfg = _config(a, params_dtype=torch.float32, fp8=fp8)
    model = _gpt(cfg, a)
    mesh = DeviceMesh.from_group(dist.group.WORLD, _device().type)
    mpp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if a.bf16
           else MixedPrecisionPolicy())
    for m in model.modules():
        if isinstance(m, TransformerLayer):
            fully_shard(m, mesh=mesh, mp_policy=mpp)
    fully_shard(model, mesh=mesh, mp_policy=mpp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def step(inp, pos, lab):
        opt.zero_grad(set_to_none=True)
        for i in range(a.micro_batches):
            model.set_requires_gradient_sync(i == a.micro_batches - 1)
            model(inp, pos, labels=lab).float().mean().backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()

    return model, step


MODES = {
    # name: (builder, precision group, label)
    "ddp": (lambda a: _build_ours(a, "ddp", False, False), "bf16", "DDP"),
    "distopt": (lambda a: _build_ours(a, "distopt", False, False), "bf16", "distributed optimizer"),
    "fsdp": (lambda a: _build_ours(a, "fsdp", False, False), "bf16", "Megatron-FSDP"),
    "bare": (lambda a: _build_bare(a, False), "bf16", "bare FSDP2"),
    "ddp_fp8": (lambda a: _build_ours(a, "ddp", True, False), "fp8", "DDP + FP8 delayed"),
    "distopt_fp8pg": (lambda a: _build_ours(a, "distopt", True, True), "fp8",
                      "distributed optimizer + meta init + FP8 delayed + fp8 param gather"),
    "fsdp_fp8pg": (lambda a: _build_ours(a, "fsdp", True, True), "fp8",
                   "Megatron-FSDP + meta init + FP8 delayed + fp8 param gather"),
    "fsdp_fp8": (lambda a: _build_ours(a, "fsdp", True, False), "fp8", "Megatron-FSDP + FP8 delayed (bf16 weights)"),
    "bare_fp8": (lambda a: _build_bare(a, True), "fp8", "bare FSDP2 + FP8 delayed (bf16 weights)"),
}


def _base(mode: str) -> str:
    """``fsdp:4194304`` -> ``fsdp``: a Megatron-FSDP row may name its own ``--suggested-communication-unit-size``."""
    return mode.partition(":")[0]


def _unit_size_ok(mode: str) -> bool:
    size = mode.partition(":")[2]
    return not size or (_base(mode).startswith("fsdp") and size.isdigit() and int(size) > 0)


def _with_unit_size(a, mode: str):
    size = mode.partition(":")[2]
    if not size:
        return a
    b = argparse.Namespace(**vars(a))
    b.unit_size = int(size)
    return b


# ---- measuring ------------------------------------------------------------------------------------------------
def _timed(step, batch, n: int, dev) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        step(*batch)
    _sync(dev)
    return time.perf_counter() - t0


def _profile(step, batch, n: int, dev, rows: int, sort_by: str = "device"):
    """(top-ops table, summary dict) of ``n`` steps under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    from megatron.training.profiling import device_time_attr, host_summary

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    step(*batch)
    _sync(dev)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step(*batch)
        _sync(dev)
        wall = time.perf_counter() - t0
    ka = prof.key_averages()
    sort = device_time_attr(ka) if dev.type == "cuda" and sort_by == "device" else "self_cpu_time_total"
    table = ka.table(sort_by=sort, row_limit=rows)
    return table, host_summary(prof.events(), ka, wall, n, cuda=dev.type == "cuda")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--bias", action="store_true",
                    help="biases on the linear layers (as upstream's and pretrain_gpt.py's default)")
    ap.add_argument("--experts", type=int, default=0, help="MoE layers with this many experts (top-2); 0: dense")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="micro-batches per step (gradient accumulation, no_sync for all but the last), as "
                         "pretrain_gpt.py's --global-batch-size / --micro-batch-size on one rank")
    ap.add_argument("--steps", type=int, default=5, help="steps per timed block")
    ap.add_argument("--blocks", type=int, default=3, help="alternating blocks per mode")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", type=str, default=None,
                    help=f"comma-separated subset of {','.join(MODES)} (default: bf16 rows, plus fp8 rows with TE); "
                         "an fsdp row may carry its own unit size: fsdp:1 (one unit per layer), fsdp_fp8pg:100000000")
    ap.add_argument("--no-fp8", action="store_true", help="skip the FP8 rows even with TE")
    ap.add_argument("--no-te", action="store_true", help="local (non-TE) layers even when TE is present")
    ap.add_argument("--profile", action="store_true", help="per mode: top ops and host-overhead summary")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=20, help="rows of each top-ops table")
    ap.add_argument("--sort", choices=("device", "cpu"), default="device",
                    help="order of the top-ops tables: self device time (CPU: always self CPU time) or self CPU time")
    ap.add_argument("--unit-size", type=int, default=None,
                    help="Megatron-FSDP rows: --suggested-communication-unit-size (elements per FSDP2 unit group; "
                         "1 = one unit per layer; default: the wrapper's own choice)")
    ap.add_argument("--small", action="store_true", help="CPU size: 2 layers, hidden 256, seq 128, vocab 1024")
    a = ap.parse_args(argv)
    if a.small:
        a.layers, a.hidden, a.ffn, a.heads, a.seq, a.mbs, a.vocab = 2, 256, 1024, 4, 128, 2, 1024
    if a.micro_batches < 1:
        ap.error(f"--micro-batches must be >= 1, got {a.micro_batches}")
    cuda = torch.cuda.is_available()
    a.bf16 = cuda  # bf16 compute on the GPU; fp32 on CPU (CPU bf16 matmuls are slow and unrepresentative)
    a.te = _have_te() and not a.no_te
    if a.modes:
        modes = [m.strip() for m in a.modes.split(",") if m.strip()]
        bad = [m for m in modes if _base(m) not in MODES or not _unit_size_ok(m)]
        if bad:
            ap.error(f"--modes: unknown {bad} (known: {', '.join(MODES)})")
    else:
        modes = ["ddp", "fsdp", "bare"] + (["ddp_fp8", "distopt_fp8pg", "fsdp_fp8pg", "fsdp_fp8", "bare_fp8"]
                                           if a.te and not a.no_fp8 else [])
    if any(MODES[_base(m)][1] == "fp8" for m in modes) and not a.te:
        ap.error("--modes: the fp8 rows need Transformer Engine and CUDA")

    if cuda:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    fd, store = tempfile.mkstemp(prefix="fsdp_step_profile_")
    os.close(fd)
    os.unlink(store)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    dev = _device()
    name = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    print(f"# fsdp_step_profile  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  device: {name}  "
          f"torch {torch.__version__}  TE layers: {a.te}")
    print(f"GPT L={a.layers} h={a.hidden} ffn={a.ffn} experts={a.experts} heads={a.heads} seq={a.seq} mbs={a.mbs} vocab={a.vocab} "
          f"bias={a.bias} unit_size={a.unit_size} micro-batches/step={a.micro_batches} "
          f"{'bf16' if a.bf16 else 'fp32'}; {a.blocks} blocks x {a.steps} steps per mode after {a.warmup} warm-up")

    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, a.vocab, (a.mbs, a.seq + 1), generator=g).to(dev)
    batch = (tok[:, :-1].contiguous(), torch.arange(a.seq, device=dev).unsqueeze(0).expand(a.mbs, a.seq),
             tok[:, 1:].contiguous())
    steps = {}
    for m in list(modes):
        t0 = time.perf_counter()
        try:
            steps[m] = MODES[_base(m)][0](_with_unit_size(a, m))[1]
            for _ in range(a.warmup):
                steps[m](*batch)
            _sync(dev)
        except Exception as e:  # one failing row (e.g. an FP8 build on another TE) must not cost the whole run
            import traceback

            traceback.print_exc()
            print(f"  SKIPPED {m}: {type(e).__name__}: {e}", flush=True)
            steps.pop(m, None)
            modes.remove(m)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            continue
        print(f"  built + warmed up {m} in {time.perf_counter() - t0:.1f} s", flush=True)
    spent = {m: 0.0 for m in modes}
    for _ in range(a.blocks):
        for m in modes:
            spent[m] += _timed(steps[m], batch, a.steps, dev)
    tokens = a.blocks * a.steps * a.micro_batches * a.mbs * a.seq
    tps = {m: tokens / spent[m] for m in modes}
    base = {MODES[_base(m)][1]: tps[m] for m in modes if m.startswith("ddp")}
    print("\n| mode | what | tokens/s | ms/step | vs DDP (same precision) |")
    print("| --- | --- | --- | --- | --- |")
    for m in modes:
        ref = base.get(MODES[_base(m)][1])
        ratio = f"{tps[m] / ref:.3f}" if ref else "-"
        print(f"| {m} | {MODES[_base(m)][2]} | {tps[m]:.0f} | {1000 * spent[m] / (a.blocks * a.steps):.1f} | {ratio} |")
    for ours, bare in (("fsdp", "bare"), ("fsdp_fp8", "bare_fp8")):
        if ours in tps and bare in tps:
            print(f"\n{ours}/{bare} tokens/s: {tps[ours] / tps[bare]:.3f}")
    if a.profile:
        summaries = {}
        for m in modes:
            table, summaries[m] = _profile(steps[m], batch, a.profile_steps, dev, a.rows, a.sort)
            by = "device" if cuda and a.sort == "device" else "CPU"
            print(f"\n## {m}: top {a.rows} ops by self {by} time ({a.profile_steps} steps)")
            print(table)
        print("\n| mode | wall ms/step | device busy ms/step | aten host ms/step | CUDA runtime ms/step | py ms/step "
              "| .item()s/step | CUDA syncs/step |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for m, s in summaries.items():
            print(f"| {m} | {s['wall_ms']:.1f} | {s['device_ms']:.1f} | {s['aten_ms']:.1f} | {s['runtime_ms']:.1f} | "
                  f"{s['py_ms']:.1f} | {s['items']:.1f} | {s['syncs']:.1f} |")
        print("(py ms: wall - aten - CUDA runtime: Python, hooks, DTensor/FSDP2/optimizer bookkeeping; .item()s "
              "include reads of CPU tensors such as torch Adam's step counters; the window ends with one "
              "synchronize)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
