"""Cost of the finite check a save runs before it publishes a checkpoint (``checkpoint_safety.first_non_finite``:
one ``aminmax`` per tensor, one host sync for all of them) against a naive ``torch.isfinite(t).all()`` per tensor
and against the save itself (a DCP save of the same tensors with ``ChecksummedFileSystemWriter``), in one process.
Seconds are the best of ``--repeat``; the table gives each as a ratio of the save (CPU figures: ratios only).

    python benchmarks/finite_check_cost.py --gb 0.5 [--repeat 3] [--tensors 16] [--dir /fast/disk/tmp]
"""
import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch
from torch.distributed.checkpoint import save as dcp_save

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.checksum_cost import build_state  # noqa: E402
from megatron.core.dist_checkpointing.strategies.filesystem import ChecksummedFileSystemWriter  # noqa: E402
from megatron.training.checkpoint_safety import first_non_finite  # noqa: E402


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=0.5)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None)
    a = p.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = build_state(a.gb, a.tensors)
    named = [(k, v) for k, v in state.items() if isinstance(v, torch.Tensor)]
    nbytes = sum(v.numel() * v.element_size() for _, v in named)
    assert first_non_finite(named) is None
    root = tempfile.mkdtemp(dir=a.dir)
    try:
        def save():
            path = os.path.join(root, "ckpt")
            shutil.rmtree(path, ignore_errors=True)
            dcp_save(state, storage_writer=ChecksummedFileSystemWriter(path), no_dist=True)

        t_save = best(save, a.repeat)
        t_ours = best(lambda: first_non_finite(named), a.repeat)
        t_naive = best(lambda: [bool(torch.isfinite(v).all()) for _, v in named], a.repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    named[-1][1].view(-1)[-1] = float("nan")
    assert first_non_finite(named) == named[-1][0]  # the check finds a NaN in the last element of the last tensor
    print(f"{nbytes / 1e9:.2f} GB in {len(named)} tensors (fp32/bf16), {torch.get_num_threads()} threads, "
          f"best of {a.repeat}")
    print(f"| {'method':<34} | {'ratio to the save':>17} |")
    print(f"| {'-' * 34} | {'-' * 17}:|")
    for name, t in (("DCP save (checksummed writer)", t_save), ("finite check (aminmax, one sync)", t_ours),
                    ("naive isfinite(t).all() per tensor", t_naive)):
        print(f"| {name:<34} | {t / t_save:>17.3f} |")


if __name__ == "__main__":
    main()
