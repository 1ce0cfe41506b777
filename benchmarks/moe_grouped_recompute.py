"""Grouped-GEMM experts vs sequential experts, and activation recompute off / selective / full, on one device.

    python benchmarks/moe_grouped_recompute.py [--out results.json]      # H200, Transformer Engine, bf16 (~5 min)
    python benchmarks/moe_grouped_recompute.py --device cpu              # CPU, --transformer-impl local, tiny sizes

A GPT MoE model (8 experts, top-2, SwiGLU) runs forward + backward (no optimizer step: the figures are the
model's). Every configuration of a table is built first and warmed up (``--warmup`` steps each); then the rows are
timed interleaved: ``--repeats`` rounds, each timing ``--iters`` steps of every configuration in turn, and a row's
time is the median over the rounds, so no row is measured while the device warms up or the others' caches settle.
Beside it, the fastest round's time per step (host jitter only adds time: the fastest rounds compare the rows with
less of it); the goals are judged on the medians.

Table 1: step time with SequentialMLP and with --moe-grouped-gemm at the same micro-batch, each with the torch
ops' token permutation and (on CUDA with Transformer Engine) with ``--moe-permute-fusion`` (TE's fused kernels, what
upstream's MoE launch scripts pass). Table 2 (grouped
experts): per recompute setting, step time, tokens/s, the bytes autograd keeps for backward after the forward
(distinct storages; an output-discarding recompute's freed outputs count 0), on CUDA the peak activation memory (max
allocated during a step minus allocated before it) and the largest micro-batch that fits (doubling, then bisection,
each setting's model alone on the device); each with its ratio to recompute off. Goals: grouped >= 1.3x sequential;
selective costs <= 5 % tokens/s; full cuts the activation memory by >= 60 %.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_utils import use_fused_permutation
from megatron.core.transformer.utils import init_weights

SELECTIVE = dict(recompute_granularity="selective")
RECOMPUTE = {
    "off": {},
    "selective layernorm,moe_act": dict(SELECTIVE, recompute_modules=["layernorm", "moe_act"]),
    "selective core_attn": dict(SELECTIVE, recompute_modules=["core_attn"]),  # upstream's default
    "selective core_attn,layernorm,moe_act": dict(SELECTIVE, recompute_modules=["core_attn", "layernorm", "moe_act"]),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def _config(a, grouped, **kw):
    te = a.device == "cuda" and a.impl != "local"
    cuda = a.device == "cuda"
    base = dict(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, ffn_hidden_size=a.ffn,
                num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=a.ffn, gated_linear_unit=True,
                activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
                moe_token_dispatcher_type="alltoall", moe_grouped_gemm=grouped,
                bias_activation_fusion=not a.no_bias_swiglu_fusion, moe_router_fusion=a.moe_router_fusion,
                apply_rope_fusion=not a.no_rope_fusion,
                transformer_impl="transformer_engine" if te else "local",
                params_dtype=torch.bfloat16 if cuda else torch.float32, bf16=cuda)
    base.update(kw)
    return TransformerConfig(**base)


def _build(a, cfg):
    torch.manual_seed(0)
    with torch.device(a.device):
        model = GPTModel(cfg, vocab_size=a.vocab, max_sequence_length=a.seq, position_embedding_type="rope")
    init_weights(model)
    return model


def _batch(a, mb):
    g = torch.Generator().manual_seed(mb)
    ids = torch.randint(0, a.vocab, (mb, a.seq), generator=g).to(a.device)
    return ids, torch.arange(a.seq, device=a.device).unsqueeze(0).expand(mb, a.seq)


def _forward(model, batch):
    ids, pos = batch
    return model(ids, pos, labels=ids).mean()


def _step(model, batch):
    _forward(model, batch).backward()


def _sync(a):
    if a.device == "cuda":
        torch.cuda.synchronize()


def step_times(models, a, mb, best=None):
    """{name: median seconds per step}: warm-up, then ``a.repeats`` interleaved rounds of ``a.iters`` steps each.
    ``best`` (a dict, optional) gets {name: the fastest round's seconds per step}: host jitter only adds time, so
    the fastest rounds compare the rows with less of it (reported beside the medians, never instead of them)."""
    batch = _batch(a, mb)
    for model in models.values():
        for _ in range(a.warmup):
            _step(model, batch)
    times = {name: [] for name in models}
    for _ in range(a.repeats):
        for name, model in models.items():
            _sync(a)
            t0 = time.perf_counter()
            for _ in range(a.iters):
                _step(model, batch)
            _sync(a)
            times[name].append((time.perf_counter() - t0) / a.iters)
    if best is not None:
        best.update({name: min(t) for name, t in times.items()})
    return {name: statistics.median(t) for name, t in times.items()}


def profile_steps(model, a, mb, rows: int, steps: int = 2):
    """(top-``rows`` ops table, host/device summary) of ``steps`` steps under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    from megatron.training.profiling import device_time_attr, host_summary

    cuda = a.device == "cuda"
    batch = _batch(a, mb)
    _step(model, batch)
    _sync(a)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            _step(model, batch)
        _sync(a)
        wall = time.perf_counter() - t0
    ka = prof.key_averages()
    table = ka.table(sort_by=device_time_attr(ka) if cuda else "self_cpu_time_total", row_limit=rows)
    return table, host_summary(prof.events(), ka, wall, steps, cuda=cuda)


def kept_bytes(model, a, mb) -> int:
    """Bytes of the distinct storages autograd keeps for backward, counted after the forward."""
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = _forward(model, _batch(a, mb))
    storages = {}
    for t in kept:
        st = t.untyped_storage()
        storages[(st.data_ptr(), id(st) if st.size() == 0 else 0)] = st.nbytes()
    loss.backward()
    model.zero_grad(set_to_none=False)
    return sum(storages.values())


def peak_activation_mib(model, a, mb) -> float:
    if a.device != "cuda":
        return float("nan")
    batch = _batch(a, mb)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _step(model, batch)
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=False)
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def fits(model, a, mb) -> bool:
    try:
        _step(model, _batch(a, mb))
        _sync(a)
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        model.zero_grad(set_to_none=False)
        if a.device == "cuda":
            torch.cuda.empty_cache()


def largest_micro_batch(model, a) -> int:
    lo, hi = 0, 1
    while hi <= a.max_mb and fits(model, a, hi):
        lo, hi = hi, hi * 2
    if hi > a.max_mb:
        return lo
    for _ in range(a.bisect):  # lo fits, hi does not
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(model, a, mid) else (lo, mid)
    return lo


# option: (default on cuda, default on cpu)
SIZES = {"layers": (8, 2), "hidden": (2048, 64), "heads": (16, 4), "ffn": (2048, 64), "seq": (2048, 32),
         "vocab": (32768, 128), "micro_batch": (4, 2), "warmup": (3, 1), "iters": (3, 2), "repeats": (5, 5),
         "max_mb": (128, 0), "bisect": (3, 3)}


def _parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu: --transformer-impl local, fp32, tiny sizes unless given")
    p.add_argument("--smoke", action="store_true", help="the same as --device cpu")
    for name, (gpu, cpu) in SIZES.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"default {gpu} (cuda), {cpu} (cpu)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--no-recompute", action="store_true", help="table 1 only")
    p.add_argument("--no-bias-swiglu-fusion", action="store_true",
                   help="SwiGLU by torch ops (default: fused, --bias-swiglu-fusion, upstream's default)")
    p.add_argument("--no-rope-fusion", action="store_true",
                   help="rotary embeddings by torch ops (default: TE's fused kernel, upstream's training default)")
    p.add_argument("--moe-router-fusion", action="store_true",
                   help="every row with TE's fused score function + top-k (torch ops where TE/CUDA are missing)")
    p.add_argument("--impl", choices=["transformer_engine", "local"], default="transformer_engine",
                   help="--transformer-impl on CUDA (local: torch layers, bf16; grouped experts on torch._grouped_mm)")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="after table 1: each of its models' top ROWS ops (device time on CUDA) over 2 steps, and "
                        "the host/device summary; after table 2 the same for recompute off and selective core_attn")
    a = p.parse_args()
    if a.smoke:
        a.device = "cpu"
    for name, (gpu, cpu) in SIZES.items():
        if getattr(a, name) is None:
            setattr(a, name, gpu if a.device == "cuda" else cpu)
    return a


def _ratio(x, ref):
    return x / ref if ref == ref and ref else float("nan")


def main():
    a = _parse()
    results = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "args": vars(a),
               "experts": {}, "recompute": {}}
    tokens = a.micro_batch * a.seq
    print(f"# device {results['device']}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# GPT MoE: {a.layers} layers, hidden {a.hidden}, 8 experts top-2, expert ffn {a.ffn}, seq {a.seq}, "
          f"micro-batch {a.micro_batch}; median of {a.repeats} interleaved rounds of {a.iters} steps after "
          f"{a.warmup} warm-up steps each; --transformer-impl {a.impl if a.device == 'cuda' else 'local'}"
          f"; SwiGLU {'torch ops' if a.no_bias_swiglu_fusion else 'fused'}, RoPE {'torch ops' if a.no_rope_fusion else 'fused'}{', --moe-router-fusion' if a.moe_router_fusion else ''}"
          f"{', NVTE_USE_CUTLASS_GROUPED_GEMM=' + os.environ['NVTE_USE_CUTLASS_GROUPED_GEMM'] if 'NVTE_USE_CUTLASS_GROUPED_GEMM' in os.environ else ''}")
    rows = {"sequential": (False, False), "grouped": (True, False)}
    fusion = a.device == "cuda" and use_fused_permutation(_config(a, False, moe_permute_fusion=True),
                                                          torch.ones(1, device=a.device))
    if fusion:
        rows.update({"sequential, permute fusion": (False, True), "grouped, permute fusion": (True, True)})
    models = {name: _build(a, _config(a, grouped, moe_permute_fusion=fused)) for name, (grouped, fused) in rows.items()}
    best = {}
    times = step_times(models, a, a.micro_batch, best)
    print("| experts | step ms | tokens/s | fastest round ms |\n| --- | ---: | ---: | ---: |")
    for name, t in times.items():
        results["experts"][name] = dict(step_s=t, tokens_per_s=tokens / t, fastest_round_step_s=best[name])
        print(f"| {name} | {t * 1e3:.1f} | {tokens / t:.0f} | {best[name] * 1e3:.1f} |")
    for suffix in ("", ", permute fusion") if fusion else ("",):
        print(f"grouped / sequential tokens/s{suffix}: "
              f"{times['sequential' + suffix] / times['grouped' + suffix]:.2f} (goal >= 1.3; fastest rounds "
              f"{best['sequential' + suffix] / best['grouped' + suffix]:.2f})")
    print()
    if a.profile:
        for name, model in models.items():
            table, summary = profile_steps(model, a, a.micro_batch, a.profile)
            print(f"## profile: {name}\n{summary}\n{table}")
    del models
    if a.no_recompute:
        return _write(a, results)

    models = {name: _build(a, _config(a, True, **kw)) for name, kw in RECOMPUTE.items()}
    best = {}
    times = step_times(models, a, a.micro_batch, best)
    for name, model in models.items():
        results["recompute"][name] = dict(step_s=times[name], tokens_per_s=tokens / times[name],
                                          fastest_round_step_s=best[name],
                                          kept_mib=kept_bytes(model, a, a.micro_batch) / 2**20,
                                          peak_activation_mib=peak_activation_mib(model, a, a.micro_batch))
    if a.profile:
        for name in ("off", "selective core_attn"):
            table, summary = profile_steps(models[name], a, a.micro_batch, a.profile)
            print(f"## profile: recompute {name}\n{summary}\n{table}")
    models.clear()
    if a.max_mb > 0:
        for name, kw in RECOMPUTE.items():  # each model alone on the device
            model = _build(a, _config(a, True, **kw))
            results["recompute"][name]["largest_micro_batch"] = largest_micro_batch(model, a)
            del model
            if a.device == "cuda":
                torch.cuda.empty_cache()
    off = results["recompute"]["off"]
    print("| recompute | step ms | x off | tokens/s | kept for backward MiB | x off | peak activation MiB | x off "
          "| largest micro-batch |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results["recompute"].items():
        print(f"| {name} | {r['step_s'] * 1e3:.1f} | {_ratio(r['step_s'], off['step_s']):.3f} | "
              f"{r['tokens_per_s']:.0f} | {r['kept_mib']:.1f} | {_ratio(r['kept_mib'], off['kept_mib']):.3f} | "
              f"{r['peak_activation_mib']:.0f} | {_ratio(r['peak_activation_mib'], off['peak_activation_mib']):.3f} | "
              f"{r.get('largest_micro_batch', '-')} |")
    for name in RECOMPUTE:
        if name.startswith("selective"):
            r = results["recompute"][name]
            print(f"{name}: tokens/s cost {1 - off['step_s'] / r['step_s']:.1%} (goal <= 5 %; fastest rounds "
                  f"{1 - off['fastest_round_step_s'] / r['fastest_round_step_s']:.1%})")
    full = results["recompute"]["full"]
    mem = "peak_activation_mib" if a.device == "cuda" else "kept_mib"
    print(f"full: activation memory cut {1 - _ratio(full[mem], off[mem]):.1%} ({mem}; goal >= 60 %)")
    _write(a, results)


def _write(a, results) -> None:
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
