"""The experts' GEMM alone, forward + backward, by kernel path: one F.linear per expert, torch's grouped matmul
(``torch._grouped_mm``, what ``--moe-grouped-gemm --transformer-impl local`` runs; with and without stacking the
per-expert weights first, as the layer does every call), and Transformer Engine's ``GroupedLinear`` (what
``--moe-grouped-gemm`` runs with TE; run the script again with ``NVTE_USE_CUTLASS_GROUPED_GEMM=1`` for TE's
CUTLASS kernels).

    python benchmarks/grouped_gemm_kernels.py                          # CUDA: the MoE benchmark's fc1 shape
    NVTE_USE_CUTLASS_GROUPED_GEMM=1 python benchmarks/grouped_gemm_kernels.py
    python benchmarks/grouped_gemm_kernels.py --device cpu --rows 512 --hidden 64 --out-features 128   # smoke

Rows are split over the experts by a seeded multinomial draw (an untrained router's spread). Each row of the table
is timed in interleaved rounds of ``--iters`` forward + backward passes (input and weight gradients); on CUDA with
CUDA events around each round. Median and fastest round, ms per forward + backward, and TFLOP/s (6 * rows * in *
out per pass).
"""
import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from megatron.core.fusions.grouped_mm import grouped_gemm


def _splits(rows: int, experts: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    draw = torch.multinomial(torch.ones(experts), rows, replacement=True, generator=g)
    return torch.bincount(draw, minlength=experts).tolist()


def _paths(a, x, weights, splits):
    """{name: fn() -> output} for each path that can run here; all share ``x`` and the weights' values."""
    paths = {"F.linear per expert": lambda: torch.cat([F.linear(xi, w) for xi, w in
                                                       zip(torch.split(x, splits), weights)])}
    if hasattr(torch, "_grouped_mm") and x.is_cuda:
        stacked = torch.stack([w.detach() for w in weights]).requires_grad_(True)  # [n, out, in], as the layer's
        offs = torch.tensor(splits, device=x.device).cumsum(0).to(torch.int32)
        paths["torch._grouped_mm, weights stacked per call"] = lambda: grouped_gemm(x, weights, splits)
        paths["torch._grouped_mm, weights kept stacked"] = lambda: torch._grouped_mm(
            x, stacked.transpose(-2, -1), offs=offs)
    from megatron.core.extensions.transformer_engine import TEGroupedLinear

    if TEGroupedLinear is not None and x.is_cuda:
        te = TEGroupedLinear(len(weights), a.hidden, a.out_features, bias=False, params_dtype=x.dtype,
                             device=x.device)
        with torch.no_grad():
            for i, w in enumerate(weights):
                getattr(te, f"weight{i}").copy_(w)
        cutlass = os.environ.get("NVTE_USE_CUTLASS_GROUPED_GEMM", "0")
        paths[f"TE GroupedLinear (NVTE_USE_CUTLASS_GROUPED_GEMM={cutlass})"] = lambda: te(x, splits)
    return paths


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--rows", type=int, default=16384, help="routed rows (tokens x top-k); default: the MoE "
                   "benchmark's 4 x 2048 tokens, top-2")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--out-features", type=int, default=4096, help="default: fc1 of expert ffn 2048 with SwiGLU")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    torch.manual_seed(0)
    splits = _splits(a.rows, a.experts)
    x = torch.randn(a.rows, a.hidden, device=a.device, dtype=dtype, requires_grad=True)
    weights = [(torch.randn(a.out_features, a.hidden, device=a.device, dtype=dtype) * 0.02).requires_grad_(True)
               for _ in range(a.experts)]
    grad = torch.randn(a.rows, a.out_features, device=a.device, dtype=dtype)
    paths = _paths(a, x, weights, splits)
    ref = paths["F.linear per expert"]().detach().float()
    for name, fn in paths.items():  # warm-up, and the same values on every path
        for _ in range(3):
            fn().backward(grad)
        err = ((fn().detach().float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"{name}: relative error {err:.2e} against F.linear"
    cuda = a.device == "cuda"
    times = {name: [] for name in paths}
    for _ in range(a.repeats):
        for name, fn in paths.items():
            if cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                t0 = time.perf_counter()
            for _ in range(a.iters):
                fn().backward(grad)
            if cuda:
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end) / a.iters)
            else:
                times[name].append((time.perf_counter() - t0) * 1e3 / a.iters)
    flops = 6 * a.rows * a.hidden * a.out_features
    device = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"# {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{a.experts} experts, rows {a.rows} split {splits}, [{a.hidden} -> {a.out_features}], {dtype}; "
          f"median / fastest of {a.repeats} interleaved rounds of {a.iters} forward + backward")
    print("| path | ms, median | ms, fastest | TFLOP/s (median) |\n| --- | ---: | ---: | ---: |")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"| {name} | {med:.3f} | {min(t):.3f} | {flops / med / 1e9:.0f} |")


if __name__ == "__main__":
    main()
