"""--stream-ckpt-dequant benchmark: load torch_dist checkpoints into quantized destinations with the legacy upfront
path, today's per-tensor streaming (``chunk 0``: one scratch per destination) and the chunked streaming
(``--chunk-mb``), in one run; print a table per layout and recipe.

Layouts (``--layouts``):
- ``stacked``: upstream's models' layout: one key ``stack``, ``--num`` layers of ``--dim`` x ``--dim`` stacked along a
  prepended layer axis (each layer a ShardedTensor with ``prepend_axis_num=1``), loaded into one destination per layer.
- ``embedding``: one ``--vocab`` x ``--hidden`` tensor (default 262144 x 8192, 4 GiB of bf16).

GPU (Transformer Engine), one command: ``python benchmarks/stream_ckpt_dequant.py``
  Destinations are TE quantized tensors (``fp8_utils.te_quantize``) of each recipe this GPU supports (others are
  listed as skipped with TE's reason). Columns: chunk (MiB; ``-`` upfront, ``0`` per-tensor streaming); peak transient
  GPU memory (``max_memory_allocated`` above the baseline taken right before the load) in MiB and, for chunked
  rows, its excess over the chunk (goal: <= 1 MiB); memory still held after the load (``resid``); load seconds (best
  of ``--reps``) and speed relative to per-tensor streaming (``vs_stream``; goal >= 0.95); max abs difference against
  an independent whole-tensor quantize of the saved values with the same recipe (``err_vs_ref``, 0 = bit-identical)
  and against the saved bf16 values (``err_vs_saved``, FP8 rounding). NVFP4 has no chunked path (whole scratch).
CPU smoke run (no TE): ``python benchmarks/stream_ckpt_dequant.py --fake --num 4 --dim 256 --vocab 4096 --hidden 256
  --chunk-mb 0.125``
  Destinations are the tests' FakeQuantizedTensor (delayed, tensorwise, mxfp8, blockwise); memory is the planner's
  live-scratch counter (streaming) and the dequantized bytes (upfront), since CPU allocations are not tracked. CPU
  figures are only meaningful as ratios.

``--probe`` (default with TE) first prints what TE does: recipe availability, kind detection, view behaviour and
what a quantizing ``copy_`` into a delayed-scaling Float8Tensor changes (amax / scale / scale_inv).
"""
import argparse
import gc
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron.core import dist_checkpointing, fp8_utils  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy  # noqa: E402
from megatron.core.extensions import transformer_engine as te_ext  # noqa: E402

MiB = 2**20
SENTINEL = (7.25, 3.5, 9.75, 5.0)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


# ---- destinations ------------------------------------------------------------------------------------------------
def make_dest(ref: torch.Tensor, kind: str, fake: bool, i: int):
    """A quantized destination shaped like ``ref`` holding other values; delayed: scale fitting ``ref`` and an amax
    history seeded with a sentinel (quantizer.amax is a view of history row 0, like in a TE module)."""
    garbage = torch.randn_like(ref) * 0.01
    amax_ref = float(ref.abs().max())
    if fake:
        from tests.unit_tests.dist_checkpointing.fake_quantized import FakeQuantizedTensor

        d = FakeQuantizedTensor.quantize(garbage, kind)
        if kind == "delayed":
            d._quantizer.amax_history.copy_(torch.tensor(SENTINEL) * amax_ref / max(SENTINEL))
            d._quantizer.update_scale()
        return d
    if kind == "delayed":
        hist = torch.zeros(len(SENTINEL), 1, dtype=torch.float32, device=ref.device)
        scale = torch.full((1,), 448.0 / amax_ref, dtype=torch.float32, device=ref.device)
        d = fp8_utils.te_quantize(garbage, kind, scale=scale, amax=hist[0])
        hist.copy_(torch.tensor(SENTINEL, device=ref.device).reshape(-1, 1) * amax_ref / max(SENTINEL))
        d._mcore_bench_hist = hist
        return d
    return fp8_utils.te_quantize(garbage, kind)


def reference_quantize(ref: torch.Tensor, kind: str, dest, fake: bool):
    """An independent whole-tensor quantize of ``ref`` with the recipe of ``dest`` (same scale for delayed)."""
    if fake:
        from tests.unit_tests.dist_checkpointing.fake_quantized import FakeQuantizedTensor

        r = FakeQuantizedTensor.quantize(ref, kind)
        if kind == "delayed":  # (block kinds: the fake's quantize is the whole-tensor reference)
            r._quantizer.scale.copy_(dest._quantizer.scale)
            r._quantize_from(ref)
        return r
    if kind == "delayed":
        return fp8_utils.te_quantize(ref, kind, scale=dest._quantizer.scale.clone())
    return fp8_utils.te_quantize(ref, kind)


def delayed_state(d, fake):
    if fp8_utils.quantization_kind(d) != "delayed":
        return None
    if fake:
        return torch.cat([d._quantizer.amax_history, d._quantizer.scale]).clone()
    return torch.cat([d._mcore_bench_hist.reshape(-1), d._quantizer.scale.reshape(-1)]).clone()


# ---- one load ----------------------------------------------------------------------------------------------------
def _sharded(layout, i, n, data):
    if layout == "stacked":
        return ShardedTensor.from_rank_offsets("stack", data, (0, i, n), prepend_axis_num=1)
    return ShardedTensor.from_rank_offsets("embedding", data)


def run_load(ckpt, layout, refs, kind, path, chunk_mb, dev, fake):
    """``path``: "upfront" (legacy) or "stream" (``chunk_mb`` 0: one scratch per destination; > 0: chunked)."""
    stream = path == "stream"
    dests = [make_dest(r, kind, fake, i) for i, r in enumerate(refs)]
    sd = {f"d{i}": _sharded(layout, i, len(dests), d) for i, d in enumerate(dests)}
    before = [delayed_state(d, fake) for d in dests]
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    strategy = (TorchDistLoadShardedStrategy(stream_ckpt_dequant=True, stream_ckpt_dequant_chunk_mb=chunk_mb)
                if stream else TorchDistLoadShardedStrategy())
    t0 = time.perf_counter()
    loaded = dist_checkpointing.load(sd, ckpt, sharded_strategy=strategy)
    _sync(dev)
    secs = time.perf_counter() - t0
    stats = strategy.last_load_stats
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
        residual = torch.cuda.memory_allocated() - base
    elif stream:
        peak, residual = stats.scratch_bytes_peak, 0
    else:
        peak = sum(r.numel() * 2 for r in refs)  # the upfront path dequantizes every destination at once
        residual = sum(v.numel() * v.element_size() for v in loaded.values() if not fp8_utils.is_quantized_tensor(v))
    del loaded
    notes = []
    if not stats.streaming_state_empty:
        notes.append("PLANNER STATE NOT EMPTY")
    chunked = stats.chunked_destinations
    if stream and chunk_mb:
        notes.append(f"{chunked}/{len(dests)} chunked")
    err_ref = err_saved = 0.0
    with torch.no_grad():
        for r, d in zip(refs, dests):
            deq = fp8_utils.dequantize(d).float()
            rq = fp8_utils.dequantize(reference_quantize(r, kind, d, fake)).float()
            err_ref = max(err_ref, float((deq - rq).abs().max()))
            err_saved = max(err_saved, float((deq - r.float()).abs().max()))
            del deq, rq
    after = [delayed_state(d, fake) for d in dests]
    if any(b is not None and not torch.equal(b, a) for b, a in zip(before, after)):
        notes.append("AMAX/SCALE CHANGED")
    elif before[0] is not None:
        notes.append("amax+scale restored")
    del dests, sd
    gc.collect()
    return dict(peak=peak, residual=residual, secs=secs, err_ref=err_ref, err_saved=err_saved, notes=notes)


# ---- TE probe ----------------------------------------------------------------------------------------------------
def probe_te(dev):
    print("== Transformer Engine facts ==")
    print("TE", getattr(te_ext.te, "__version__", "?"), "torch", torch.__version__, torch.cuda.get_device_name())
    x = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
    for kind in fp8_utils.KINDS:
        ok, reason = fp8_utils.te_recipe_available(kind)
        line = f"{kind:>10}: available={ok}" + (f" ({reason})" if reason else "")
        if ok:
            try:
                q = fp8_utils.te_quantize(x, kind)
                err = float((fp8_utils.dequantize(q).float() - x.float()).abs().max())
                line += f" class={type(q).__name__} detected={fp8_utils.quantization_kind(q)} dtype={q.dtype} err={err:.3g}"
                try:
                    v = q.view(1, 256, 512)
                    line += f" view(1,..)={type(v).__name__}{tuple(v.shape)}"
                    if hasattr(v, "_transpose"):
                        line += f" view_transpose={'none' if v._transpose is None else tuple(v._transpose.shape)}"
                except Exception as e:  # noqa: BLE001
                    line += f" view(1,..) fails: {type(e).__name__}: {str(e)[:80]}"
            except Exception as e:  # noqa: BLE001
                line += f" FAILED: {type(e).__name__}: {str(e)[:120]}"
        print(line)
    if fp8_utils.te_recipe_available("delayed")[0]:
        hist = torch.full((4, 1), 3.0, device=dev)
        scale = torch.full((1,), 2.0, device=dev)
        q = fp8_utils.te_quantize(x, "delayed", scale=scale, amax=hist[0])
        hist.fill_(3.0)
        tracked = {
            "quantizer.amax": q._quantizer.amax, "quantizer.scale": q._quantizer.scale,
            "amax_history(all rows)": hist, "_scale_inv": q._scale_inv,
        }
        before = {k: v.clone() for k, v in tracked.items()}
        src = x * 0.25
        q.copy_(src)
        for k, v in tracked.items():
            print(f"  delayed copy_: {k}: {before[k].flatten()[:4].tolist()} -> {v.flatten()[:4].tolist()}"
                  f" {'CHANGED' if not torch.equal(before[k], v) else 'same'}")
        print(f"  (src amax {float(src.abs().max()):.4g})")
        has_t = getattr(q, "_transpose", None) is not None and not getattr(q, "_transpose_invalid", True)
        print(f"  delayed tensor has a valid _transpose: {has_t}")
    print()


# ---- main --------------------------------------------------------------------------------------------------------
def bench_layout(layout, refs, kinds, args, dev, fake):
    ckpt = tempfile.mkdtemp(prefix=f"stream_ckpt_dequant_{layout}_", dir=args.ckpt_dir)
    n = len(refs)
    t0 = time.perf_counter()
    dist_checkpointing.save({f"s{i}": _sharded(layout, i, n, r) for i, r in enumerate(refs)}, ckpt)
    save_s = time.perf_counter() - t0
    numel = [r.numel() for r in refs]
    two_sum, two_max = 2 * sum(numel) / MiB, 2 * max(numel) / MiB
    shape = "x".join(str(d) for d in refs[0].shape)
    print(f"== layout {layout}: {n} x {shape} bf16 ({two_sum:.0f} MiB), saved in {save_s:.2f} s; "
          f"2*sum(numel) = {two_sum:.1f} MiB, 2*max(numel) = {two_max:.1f} MiB")
    print(f"{'recipe':>10} {'path':>8} {'chunk':>7} {'peak MiB':>9} {'-chunk':>8} {'resid MiB':>9} {'load s':>7} "
          f"{'vs_stream':>9} {'err_vs_ref':>10} {'err_vs_saved':>12}  notes")
    chunks = [float(c) for c in args.chunk_mb.split(",") if c.strip()]
    plan = [("upfront", None)] * ("upfront" in args.paths) + [("stream", 0.0)] + [("stream", c) for c in chunks if c]
    summary = []
    for kind in kinds:
        res = {p: [] for p in plan}
        try:
            for _ in range(args.reps):
                for p in plan:
                    res[p].append(run_load(ckpt, layout, refs, kind, p[0], p[1] or 0.0, dev, fake))
        except Exception as e:  # noqa: BLE001 - report and go on with the next recipe
            print(f"{kind:>10} {'-':>8}  FAILED: {type(e).__name__}: {str(e)[:300]}")
            continue
        best = {}
        for p in plan:
            rs = res[p]
            best[p] = dict(peak=max(r["peak"] for r in rs), residual=max(r["residual"] for r in rs),
                           secs=min(r["secs"] for r in rs), err_ref=max(r["err_ref"] for r in rs),
                           err_saved=max(r["err_saved"] for r in rs), notes=sorted({x for r in rs for x in r["notes"]}))
        base_s = best[("stream", 0.0)]["secs"]
        for p in plan:
            b = best[p]
            path, chunk = p
            over = f"{b['peak'] / MiB - chunk:>8.2f}" if chunk else f"{'':>8}"
            ctext = "-" if chunk is None else f"{chunk:g}"
            print(f"{kind:>10} {path:>8} {ctext:>7} {b['peak'] / MiB:>9.1f} {over} {b['residual'] / MiB:>9.1f} "
                  f"{b['secs']:>7.2f} {base_s / b['secs']:>9.3f} {b['err_ref']:>10.3g} {b['err_saved']:>12.3g}  "
                  f"{'; '.join(b['notes'])}  (times {', '.join('%.2f' % r['secs'] for r in res[p])})")
            if path == "stream" and chunk:
                summary.append((layout, kind, chunk, b["peak"] / MiB - chunk <= 1.0, base_s / b["secs"] >= 0.95,
                                base_s / b["secs"], b["err_ref"] == 0))
    print()
    shutil.rmtree(ckpt, ignore_errors=True)
    return summary


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="stacked,embedding")
    ap.add_argument("--num", type=int, default=16, help="stacked: layers")
    ap.add_argument("--dim", type=int, default=8192, help="stacked: each layer is dim x dim")
    ap.add_argument("--vocab", type=int, default=262144, help="embedding rows")
    ap.add_argument("--hidden", type=int, default=8192, help="embedding columns")
    ap.add_argument("--chunk-mb", default="64", help="comma-separated chunk sizes (MiB) for the chunked rows")
    ap.add_argument("--paths", default="upfront,stream", help="'upfront' adds the legacy path's rows")
    ap.add_argument("--recipes", default="delayed,tensorwise,blockwise,mxfp8,nvfp4")
    ap.add_argument("--reps", type=int, default=2, help="loads per path (alternating); time is the best")
    ap.add_argument("--fake", action="store_true", help="CPU, tests' FakeQuantizedTensor instead of TE")
    ap.add_argument("--ckpt-dir", default=None, help="parent folder of the temporary checkpoints")
    ap.add_argument("--probe", action="store_true", default=None)
    args = ap.parse_args()

    fake = args.fake or not (te_ext.HAVE_TE and torch.cuda.is_available())
    dev = torch.device("cpu") if fake else torch.device("cuda", 0)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store_path = tempfile.mktemp(prefix="bench_store_")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    if not fake and args.probe is not False:
        probe_te(dev)
    where = "CPU (FakeQuantizedTensor; memory = counted scratch bytes)" if fake else torch.cuda.get_device_name()
    print(f"device: {where}; torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")

    kinds = []
    for kind in [k.strip() for k in args.recipes.split(",") if k.strip()]:
        if fake and kind not in ("delayed", "tensorwise", "mxfp8", "blockwise"):
            print(f"{kind:>10}: skipped: the fake tensor has no {kind}")
            continue
        if not fake:
            ok, reason = fp8_utils.te_recipe_available(kind)
            if not ok:
                print(f"{kind:>10}: skipped: {reason}")
                continue
        kinds.append(kind)

    g = torch.Generator(device=dev).manual_seed(1234)
    summary = []
    for layout in [x.strip() for x in args.layouts.split(",") if x.strip()]:
        if layout == "stacked":
            refs = [(torch.randn(args.dim, args.dim, generator=g, device=dev) * (0.5 + i % 5)).to(torch.bfloat16)
                    for i in range(args.num)]
        elif layout == "embedding":
            refs = [torch.randn(args.vocab, args.hidden, generator=g, device=dev, dtype=torch.bfloat16)]
        else:
            raise SystemExit(f"--layouts: unknown layout {layout!r} (stacked, embedding)")
        summary += bench_layout(layout, refs, kinds, args, dev, fake)
        del refs
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    for layout, kind, chunk, mem_ok, time_ok, ratio, exact in summary:
        print(f"goal {layout} {kind} chunk {chunk:g} MiB: peak <= chunk + 1 MiB: {'PASS' if mem_ok else 'FAIL'}; "
              f"speed >= 0.95 x per-tensor streaming: {'PASS' if time_ok else 'FAIL'} ({ratio:.3f}); "
              f"bit-identical to a whole-tensor quantize: {'yes' if exact else 'NO'}")
    dist.destroy_process_group()
    if os.path.exists(store_path):
        os.unlink(store_path)


if __name__ == "__main__":
    main()
