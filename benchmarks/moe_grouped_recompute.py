"""Grouped-GEMM experts vs sequential experts, and activation recompute off / selective / full, on one GPU.

    python benchmarks/moe_grouped_recompute.py [--out results.json]      # H200, Transformer Engine, bf16 (~3 min)
    python benchmarks/moe_grouped_recompute.py --smoke                   # CPU, --transformer-impl local, tiny

A GPT MoE model (8 experts, top-2, SwiGLU) runs forward + backward (no optimizer step: the figures are the
model's). Table 1: tokens/s with SequentialMLP and with --moe-grouped-gemm (TEGroupedMLP) at the same micro-batch.
Table 2 (grouped experts): per recompute setting, tokens/s and peak activation memory (max allocated during the step
minus allocated before it: parameters and gradients excluded) at the same micro-batch, and the largest micro-batch
that fits (doubling, then bisection). Goals: grouped >= 1.3x sequential; selective costs <= 5 % tokens/s; full cuts
the activation memory by >= 60 %.
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.utils import init_weights

RECOMPUTE = {
    "off": {},
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "moe_act", "layernorm"]),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def _config(a, grouped, **kw):
    te = a.device == "cuda"
    base = dict(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, ffn_hidden_size=a.ffn,
                num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=a.ffn, gated_linear_unit=True,
                activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
                moe_token_dispatcher_type="alltoall", moe_grouped_gemm=grouped,
                transformer_impl="transformer_engine" if te else "local",
                params_dtype=torch.bfloat16 if te else torch.float32, bf16=te)
    base.update(kw)
    return TransformerConfig(**base)


def _build(a, cfg):
    torch.manual_seed(0)
    with torch.device(a.device):
        model = GPTModel(cfg, vocab_size=a.vocab, max_sequence_length=a.seq, position_embedding_type="rope")
    init_weights(model)
    return model


def _step(model, a, mb):
    ids = torch.randint(0, a.vocab, (mb, a.seq), device=a.device)
    pos = torch.arange(a.seq, device=a.device).unsqueeze(0).expand(mb, a.seq)
    model(ids, pos, labels=ids).mean().backward()


def _sync(a):
    if a.device == "cuda":
        torch.cuda.synchronize()


def measure(model, a, mb):
    """(tokens/s, activation MiB) of forward + backward at micro-batch ``mb``."""
    for _ in range(a.warmup):
        _step(model, a, mb)
    model.zero_grad(set_to_none=False)
    act = float("nan")
    if a.device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(model, a, mb)
        torch.cuda.synchronize()
        act = (torch.cuda.max_memory_allocated() - base) / 2**20
    _sync(a)
    t0 = time.perf_counter()
    for _ in range(a.iters):
        _step(model, a, mb)
    _sync(a)
    return a.iters * mb * a.seq / (time.perf_counter() - t0), act


def fits(model, a, mb) -> bool:
    try:
        _step(model, a, mb)
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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (--transformer-impl local)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=2048, help="expert (and dense) FFN hidden size")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--max-mb", type=int, default=128)
    p.add_argument("--bisect", type=int, default=3)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    a = p.parse_args()
    a.device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    if a.smoke:
        a.layers, a.hidden, a.heads, a.ffn, a.seq, a.vocab = 2, 64, 4, 64, 32, 128
        a.micro_batch, a.warmup, a.iters, a.max_mb = 2, 1, 2, 4
    results = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "args": vars(a),
               "experts": {}, "recompute": {}}
    print(f"# device {results['device']}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# GPT MoE: {a.layers} layers, hidden {a.hidden}, 8 experts top-2, expert ffn {a.ffn}, seq {a.seq}, "
          f"micro-batch {a.micro_batch}")
    print("| experts | tokens/s | activation MiB |\n| --- | ---: | ---: |")
    for name, grouped in (("sequential", False), ("grouped", True)):
        model = _build(a, _config(a, grouped))
        tps, act = measure(model, a, a.micro_batch)
        results["experts"][name] = dict(tokens_per_s=tps, activation_mib=act)
        print(f"| {name} | {tps:.0f} | {act:.0f} |")
        del model
    ratio = results["experts"]["grouped"]["tokens_per_s"] / results["experts"]["sequential"]["tokens_per_s"]
    print(f"grouped / sequential tokens/s: {ratio:.2f} (goal >= 1.3)\n")
    print("| recompute | tokens/s | activation MiB | largest micro-batch |\n| --- | ---: | ---: | ---: |")
    for name, kw in RECOMPUTE.items():
        model = _build(a, _config(a, True, **kw))
        tps, act = measure(model, a, a.micro_batch)
        mb = largest_micro_batch(model, a)
        results["recompute"][name] = dict(tokens_per_s=tps, activation_mib=act, largest_micro_batch=mb)
        print(f"| {name} | {tps:.0f} | {act:.0f} | {mb} |")
        del model
    r = results["recompute"]
    print(f"selective tokens/s cost: {1 - r['selective']['tokens_per_s'] / r['off']['tokens_per_s']:.1%} (goal <= 5 %); "
          f"full activation memory cut: {1 - r['full']['activation_mib'] / r['off']['activation_mib']:.1%} "
          "(goal >= 60 %)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
