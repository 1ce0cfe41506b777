"""--stream-ckpt-dequant against the upfront path on a model-shaped state: many tensors, most of them small, quantized
weights next to plain ones, as a real resume loads them (``stream_ckpt_dequant.py`` loads a few large weights only).

The state (one rank): ``--layers`` stacked layers (prepended layer axis, upstream's layout), each with quantized
``linear_qkv`` (3h x h), ``linear_proj`` (h x h), ``linear_fc1`` (f x h), ``linear_fc2`` (h x f) and ``--experts``
quantized expert ``fc1`` / ``fc2`` (two prepended axes: layer, expert); plain bf16 layernorm weights and biases; fp32
router weight and expert bias; a plain bf16 embedding and output layer; fp32 optimizer-like ``exp_avg`` /
``exp_avg_sq`` for every weight (``--no-optim`` drops them); one small object per layer (extra state). Saved once,
then loaded ``--reps`` times per path, the paths alternating (upfront, stream, stream, upfront, ...).

Prints per path the load seconds, median [min-max], and the per-repeat ratio stream / upfront (goal <= 1.0);
``--profile``: the top functions (cProfile, own time) of one more load per path, to see where the time goes.

    GPU (TE):  python benchmarks/stream_model_load.py --recipe delayed [--layers 6 --hidden 2048 --ffn 4096]
    CPU:       python benchmarks/stream_model_load.py --fake --layers 4 --hidden 256 --ffn 512 --profile
"""
import argparse
import cProfile
import gc
import io
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.stream_ckpt_dequant import make_dest  # noqa: E402
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy  # noqa: E402
from megatron.core.extensions import transformer_engine as te_ext  # noqa: E402


def model_entries(args):
    """[(key, shape, dtype, quantized, prepend)]: ``prepend`` is () or the (index, count) pairs of prepended axes."""
    h, f, e, L = args.hidden, args.ffn, args.experts, args.layers
    out = [("embedding.word_embeddings.weight", (args.vocab, h), torch.bfloat16, False, ()),
           ("output_layer.weight", (args.vocab, h), torch.bfloat16, False, ())]
    for i in range(L):
        lay = ((i, L),)
        for name, shape in (("self_attention.linear_qkv.weight", (3 * h, h)),
                            ("self_attention.linear_proj.weight", (h, h)),
                            ("mlp.linear_fc1.weight", (f, h)), ("mlp.linear_fc2.weight", (h, f))):
            out.append((f"decoder.layers.{name}", shape, torch.bfloat16, True, lay))
        for name, shape in (("input_layernorm.weight", (h,)), ("pre_mlp_layernorm.weight", (h,)),
                            ("self_attention.linear_qkv.bias", (3 * h,)), ("self_attention.linear_proj.bias", (h,))):
            out.append((f"decoder.layers.{name}", shape, torch.bfloat16, False, lay))
        if e:
            out.append(("decoder.layers.mlp.router.weight", (e, h), torch.float32, False, lay))
            out.append(("decoder.layers.mlp.router.expert_bias", (e,), torch.float32, False, lay))
            for j in range(e):
                for name, shape in (("fc1", (f // e, h)), ("fc2", (h, f // e))):
                    out.append((f"decoder.layers.mlp.experts.{name}.weight", shape, torch.bfloat16, True,
                                lay + ((j, e),)))
    if not args.no_optim:
        out += [(f"optimizer.{kind}.{k}", s, torch.float32, False, p)
                for k, s, _, _, p in list(out) for kind in ("exp_avg", "exp_avg_sq")]
    return out


def _sharded(key, data, prepend):
    offsets = [(ax, idx, n) for ax, (idx, n) in enumerate(prepend)]
    return ShardedTensor.from_rank_offsets(key, data, *offsets, prepend_axis_num=len(prepend))


def build_state(entries, refs, dests=None):
    sd = {}
    for n, ((key, _, _, _, prepend), ref) in enumerate(zip(entries, refs)):
        sd[f"t{n}"] = _sharded(key, ref if dests is None else dests[n], prepend)
    for i in range(max((p[0][1] for *_, p in entries if p), default=0)):
        sd[f"extra{i}"] = ShardedObject("decoder.layers.self_attention._extra_state", {"layer": i, "b": b"x" * 64},
                                        (max(p[0][1] for *_, p in entries if p),), (i,))
    return sd


def one_load(ckpt, entries, refs, path, args, dev, profile=None):
    dests = [make_dest(r, args.recipe, args.fake, n) if q else torch.empty_like(r)
             for n, (r, (_, _, _, q, _)) in enumerate(zip(refs, entries))]
    sd = build_state(entries, refs, dests)
    gc.collect()
    strategy = TorchDistLoadShardedStrategy(stream_ckpt_dequant=path == "stream")
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if profile is not None:
        profile.enable()
    loaded = dist_checkpointing.load(sd, ckpt, sharded_strategy=strategy)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    if profile is not None:
        profile.disable()
    secs = time.perf_counter() - t0
    plain = [n for n, e in enumerate(entries) if not e[3]]
    for n in plain[:: max(1, len(plain) // 8)]:  # spot-check plain destinations
        if not torch.equal(dests[n], refs[n]):
            raise SystemExit(f"{path}: wrong values loaded for {entries[n][0]}")
    del loaded, dests, sd
    return secs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--no-optim", action="store_true")
    ap.add_argument("--recipe", default="delayed")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--fake", action="store_true", help="CPU, tests' FakeQuantizedTensor instead of TE")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT"), help="also write the table here (default: $OUT)")
    args = ap.parse_args()
    args.fake = args.fake or not (te_ext.HAVE_TE and torch.cuda.is_available())
    dev = torch.device("cpu") if args.fake else torch.device("cuda", 0)
    store = tempfile.mktemp(prefix="bench_store_")
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    g = torch.Generator(device=dev).manual_seed(0)
    entries = model_entries(args)
    refs = [torch.randn(s, generator=g, device=dev).to(dt) for _, s, dt, _, _ in entries]
    nbytes = sum(r.numel() * r.element_size() for r in refs)
    quantized = sum(1 for e in entries if e[3])
    ckpt = tempfile.mkdtemp(prefix="stream_model_load_", dir=args.ckpt_dir)
    lines = []
    try:
        dist_checkpointing.save(build_state(entries, refs), ckpt)
        where = "CPU, FakeQuantizedTensor" if args.fake else torch.cuda.get_device_name()
        lines.append(f"{where}; torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
                     f"recipe {args.recipe}; {len(entries)} tensors ({quantized} quantized destinations), "
                     f"{nbytes / 1e9:.2f} GB, {args.layers} layers")
        times = {"upfront": [], "stream": []}
        one_load(ckpt, entries, refs, "stream", args, dev)  # warm-up, unmeasured
        for rep in range(args.reps):
            for path in (("upfront", "stream") if rep % 2 == 0 else ("stream", "upfront")):
                times[path].append(one_load(ckpt, entries, refs, path, args, dev))
        ratios = sorted(s / u for s, u in zip(times["stream"], times["upfront"]))
        for path, ts in times.items():
            lines.append(f"{path:>8}: load s {statistics.median(ts):.3f} [{min(ts):.3f}-{max(ts):.3f}]")
        lines.append(f"stream / upfront (same repeat): {statistics.median(ratios):.3f} "
                     f"[{ratios[0]:.3f}-{ratios[-1]:.3f}] (goal <= 1.0)")
        if args.profile:
            for path in ("upfront", "stream"):
                prof = cProfile.Profile()
                one_load(ckpt, entries, refs, path, args, dev, profile=prof)
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
                lines.append(f"--- profile {path} (own time) ---")
                lines += [ln for ln in text.getvalue().splitlines() if ln.strip()][3:]
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
        dist.destroy_process_group()
        if os.path.exists(store):
            os.unlink(store)
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "stream_model_load.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
