"""--stream-ckpt-dequant benchmark: load a torch_dist checkpoint of many weights into quantized destinations, with
the legacy upfront path and with the streaming path, in one run; print a table per recipe.

GPU (Transformer Engine): ``python benchmarks/stream_ckpt_dequant.py --num 24 --dim 8192``
  Destinations are TE quantized tensors (``fp8_utils.te_quantize``) of each recipe this GPU supports (others are
  listed as skipped with TE's reason). Columns: peak transient GPU memory (``max_memory_allocated`` above the
  baseline taken right before the load) in MiB beside 2 x sum(numel) and 2 x max(numel) (bf16 bytes); memory still
  held after the load returned (``residual``: what the returned state dict keeps alive); load seconds (best of
  ``--reps``); max abs difference against an independent whole-tensor quantize of the saved values with the same
  recipe (``err_vs_ref``, 0 = bit-identical) and against the saved bf16 values (``err_vs_saved``, FP8 rounding).
  Goals: streaming peak <= 1.05 x 2 x max(numel); streaming seconds <= 1.05 x upfront.
CPU smoke run (no TE): ``python benchmarks/stream_ckpt_dequant.py --fake --num 4 --dim 256``
  Destinations are the tests' FakeQuantizedTensor; memory is the planner's live-scratch counter (streaming) and the
  dequantized bytes (upfront), since CPU allocations are not tracked. CPU figures are only meaningful as ratios.

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
from megatron.core.dist_checkpointing.strategies import quantized_load  # noqa: E402
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy  # noqa: E402
from megatron.core.extensions import transformer_engine as te_ext  # noqa: E402

MiB = 2**20
SENTINEL = (7.25, 3.5, 9.75, 5.0)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


class PlannerSpy:
    """Records the load planners the strategy builds (to read their scratch counters and bookkeeping)."""

    def __init__(self):
        self.planners = []
        self._orig = quantized_load.QuantizedLoadPlannerMixin.__init__

    def __enter__(self):
        spy = self

        def init(p, *a, **kw):
            spy._orig(p, *a, **kw)
            spy.planners.append(p)

        quantized_load.QuantizedLoadPlannerMixin.__init__ = init
        return self

    def __exit__(self, *exc):
        quantized_load.QuantizedLoadPlannerMixin.__init__ = self._orig


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
        if kind == "delayed":
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
def run_load(ckpt, refs, kind, stream, dev, fake):
    dests = [make_dest(r, kind, fake, i) for i, r in enumerate(refs)]
    sd = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", d) for i, d in enumerate(dests)}
    before = [delayed_state(d, fake) for d in dests]
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    strategy = TorchDistLoadShardedStrategy(stream_ckpt_dequant=True) if stream else TorchDistLoadShardedStrategy()
    with PlannerSpy() as spy:
        t0 = time.perf_counter()
        loaded = dist_checkpointing.load(sd, ckpt, sharded_strategy=strategy)
        _sync(dev)
        secs = time.perf_counter() - t0
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
        residual = torch.cuda.memory_allocated() - base
    elif stream:
        peak, residual = max(p.scratch_bytes_peak for p in spy.planners), 0
    else:
        peak = sum(r.numel() * 2 for r in refs)  # the upfront path dequantizes every destination at once
        residual = sum(v.numel() * v.element_size() for v in loaded.values() if not fp8_utils.is_quantized_tensor(v))
    del loaded
    notes = []
    if not all(p.quantized_load_state_is_empty() for p in spy.planners):
        notes.append("PLANNER STATE NOT EMPTY")
    err_ref = err_saved = 0.0
    with torch.no_grad():
        for r, d in zip(refs, dests):
            deq = fp8_utils.dequantize(d).float()
            rq = fp8_utils.dequantize(reference_quantize(r, kind, d, fake)).float()
            err_ref = max(err_ref, float((deq - rq).abs().max()))
            err_saved = max(err_saved, float((deq - r.float()).abs().max()))
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
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num", type=int, default=24)
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--recipes", default="delayed,tensorwise,blockwise,mxfp8,nvfp4")
    ap.add_argument("--reps", type=int, default=2, help="loads per path (alternating); time is the best")
    ap.add_argument("--fake", action="store_true", help="CPU, tests' FakeQuantizedTensor instead of TE")
    ap.add_argument("--ckpt-dir", default=None)
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

    ckpt = args.ckpt_dir or tempfile.mkdtemp(prefix="stream_ckpt_dequant_")
    g = torch.Generator(device=dev).manual_seed(1234)
    refs = [
        (torch.randn(args.dim, args.dim, generator=g, device=dev) * (0.5 + i % 5)).to(torch.bfloat16)
        for i in range(args.num)
    ]
    t0 = time.perf_counter()
    dist_checkpointing.save({f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", r) for i, r in enumerate(refs)}, ckpt)
    save_s = time.perf_counter() - t0
    numel = [r.numel() for r in refs]
    two_sum, two_max = 2 * sum(numel) / MiB, 2 * max(numel) / MiB
    where = "CPU (FakeQuantizedTensor; memory = counted scratch bytes)" if fake else torch.cuda.get_device_name()
    print(f"device: {where}; torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"checkpoint: {args.num} x {args.dim}x{args.dim} bf16, saved in {save_s:.2f} s to {ckpt}")
    print(f"theory: 2*sum(numel) = {two_sum:.1f} MiB, 2*max(numel) = {two_max:.1f} MiB\n")

    header = (f"{'recipe':>10} {'path':>9} {'peak MiB':>9} {'2sum MiB':>9} {'2max MiB':>9} {'peak/2max':>9} "
              f"{'resid MiB':>9} {'load s':>7} {'err_vs_ref':>10} {'err_vs_saved':>12}  notes")
    print(header)
    summary = []
    for kind in [k.strip() for k in args.recipes.split(",") if k.strip()]:
        if fake and kind not in ("delayed", "tensorwise"):
            print(f"{kind:>10} {'-':>9}  skipped: the fake tensor implements delayed and tensorwise only")
            continue
        if not fake:
            ok, reason = fp8_utils.te_recipe_available(kind)
            if not ok:
                print(f"{kind:>10} {'-':>9}  skipped: {reason}")
                continue
        res = {False: [], True: []}
        try:
            for _ in range(args.reps):
                for stream in (False, True):
                    res[stream].append(run_load(ckpt, refs, kind, stream, dev, fake))
        except Exception as e:  # noqa: BLE001 - report and go on with the next recipe
            print(f"{kind:>10} {'-':>9}  FAILED: {type(e).__name__}: {str(e)[:300]}")
            continue
        best = {}
        for stream in (False, True):
            rs = res[stream]
            b = dict(peak=max(r["peak"] for r in rs), residual=max(r["residual"] for r in rs),
                     secs=min(r["secs"] for r in rs), err_ref=max(r["err_ref"] for r in rs),
                     err_saved=max(r["err_saved"] for r in rs), notes=sorted({n for r in rs for n in r["notes"]}))
            best[stream] = b
            times = ", ".join("%.2f" % r["secs"] for r in rs)
            print(f"{kind:>10} {'stream' if stream else 'upfront':>9} {b['peak'] / MiB:>9.1f} {two_sum:>9.1f} "
                  f"{two_max:>9.1f} {b['peak'] / MiB / two_max:>9.3f} {b['residual'] / MiB:>9.1f} {b['secs']:>7.2f} "
                  f"{b['err_ref']:>10.3g} {b['err_saved']:>12.3g}  {'; '.join(b['notes'])}"
                  f"  (times {times})")
        s, u = best[True], best[False]
        mem_ok = s["peak"] / MiB <= 1.05 * two_max
        time_ok = s["secs"] <= 1.05 * u["secs"]
        summary.append((kind, mem_ok, time_ok, s["secs"] / u["secs"], u["peak"] / max(s["peak"], 1)))
    print()
    for kind, mem_ok, time_ok, tr, mr in summary:
        print(f"goal {kind}: stream peak <= 1.05 x 2max: {'PASS' if mem_ok else 'FAIL'}; "
              f"stream time <= 1.05 x upfront: {'PASS' if time_ok else 'FAIL'} (ratio {tr:.3f}); "
              f"upfront/stream peak = {mr:.1f}x")
    if args.ckpt_dir is None:
        shutil.rmtree(ckpt, ignore_errors=True)
    dist.destroy_process_group()
    if os.path.exists(store_path):
        os.unlink(store_path)


if __name__ == "__main__":
    main()
