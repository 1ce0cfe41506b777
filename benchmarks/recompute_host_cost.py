"""Host cost of one checkpointed call (forward + backward) of a tiny core attention, by checkpoint kind.

    python benchmarks/recompute_host_cost.py [--calls 3000] [--repeats 3]

The tensors are tiny, so the time is the host's: what a checkpoint adds to each layer's step where the step is
host-bound (the H200's MoE model of moe_grouped_recompute.py with ``--recompute-modules core_attn``). Rows: no
checkpoint; ``tensor_parallel.checkpoint`` (torch.utils.checkpoint, non-reentrant, RNG states preserved);
``checkpoint_parameter_free`` (what core_attn uses) without and with RNG states. Interleaved repeats; median us per
call and the added us over no checkpoint, with its ratio to ``checkpoint``'s (CPU figures: ratios only).
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.random import checkpoint, checkpoint_parameter_free


def _attention(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


ROWS = {
    "no checkpoint": _attention,
    "checkpoint (torch.utils.checkpoint)": lambda *a: checkpoint(_attention, False, *a),
    "checkpoint_parameter_free": lambda *a: checkpoint_parameter_free(_attention, *a, preserve_rng_state=False),
    "checkpoint_parameter_free, RNG states": lambda *a: checkpoint_parameter_free(_attention, *a),
}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    times = {name: [] for name in ROWS}
    for name, call in ROWS.items():  # warm-up
        for _ in range(100):
            call(q, k, v, None).sum().backward()
    for _ in range(a.repeats):
        for name, call in ROWS.items():
            t0 = time.perf_counter()
            for _ in range(a.calls):
                call(q, k, v, None).sum().backward()
            times[name].append((time.perf_counter() - t0) / a.calls * 1e6)
    med = {name: statistics.median(t) for name, t in times.items()}
    base = med["no checkpoint"]
    ref = med["checkpoint (torch.utils.checkpoint)"] - base
    print(f"# torch {torch.__version__}; median of {a.repeats} interleaved repeats of {a.calls} calls")
    print("| checkpoint | us per call | added us | added x checkpoint's |\n| --- | ---: | ---: | ---: |")
    for name, t in med.items():
        print(f"| {name} | {t:.0f} | {t - base:.0f} | {(t - base) / ref:.2f} |")


if __name__ == "__main__":
    main()
