"""Cost of per-item checksums (``strategies/filesystem.py``): DCP save and load of the same ~1-2 GB state with
torch's ``FileSystemWriter``/``FileSystemReader`` and with ``ChecksummedFileSystemWriter``/``Reader`` (each available
algorithm), in one process, in one run. Seconds are the best of ``--repeat`` (method order rotated each repeat);
the table gives each method's time as a ratio of the plain one (goal: <= 1.05), and each load's time as a ratio of
a raw ``readinto`` of the same checkpoint's data files right before it (``load/raw``: the read side's overhead over
the storage, page cache warm; on a GPU, ``benchmarks/ckpt_storage_speed.py`` measures cold and CUDA destinations).
Every load is checked against the saved values.

    python benchmarks/checksum_cost.py --gb 1 [--repeat 3] [--tensors 16] [--dir /fast/disk/tmp] [--no-sync]
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.dist_checkpointing.strategies.filesystem import (  # noqa: E402
    ALGORITHMS,
    ChecksummedFileSystemReader,
    ChecksummedFileSystemWriter,
)

GB = 1e9


def raw_read_seconds(ckpt_dir: str) -> float:
    """Seconds to ``readinto`` every data file of ``ckpt_dir`` into one reused 64 MiB buffer."""
    buf = memoryview(bytearray(64 << 20))
    t0 = time.perf_counter()
    for name in sorted(os.listdir(ckpt_dir)):
        if name.endswith(".distcp"):
            with open(os.path.join(ckpt_dir, name), "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
    return time.perf_counter() - t0


def build_state(gb: float, n_tensors: int):
    """``n_tensors`` tensors (alternating fp32 / bf16) totalling ``gb`` GB, plus two small objects."""
    per = int(gb * GB / n_tensors)
    g = torch.Generator().manual_seed(0)
    state = {}
    for i in range(n_tensors):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        n = per // torch.tensor([], dtype=dtype).element_size()
        cols = 1024
        state[f"layer{i}.weight"] = torch.randn(n // cols, cols, generator=g).to(dtype)
    state["rng_state"] = (3, list(range(100)), None)
    state["iteration"] = 1234
    return state


def run(args):
    state = build_state(args.gb, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    sums = {k: v.double().sum().item() for k, v in state.items() if isinstance(v, torch.Tensor)}
    dests = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else None) for k, v in state.items()}
    methods = {"plain": (lambda d: FileSystemWriter(d, sync_files=args.sync, thread_count=args.threads),
                         lambda d: FileSystemReader(d))}
    for alg in sorted(ALGORITHMS):
        methods[alg] = (
            lambda d, alg=alg: ChecksummedFileSystemWriter(d, sync_files=args.sync, thread_count=args.threads,
                                                           algorithm=alg),
            lambda d: ChecksummedFileSystemReader(d),
        )
    root = tempfile.mkdtemp(prefix="checksum_cost_", dir=args.dir)
    best = {m: [float("inf"), float("inf"), float("inf")] for m in methods}
    names = list(methods)
    try:
        for m in names:  # warm-up, unmeasured
            d = os.path.join(root, "warm_" + m)
            dcp_save({"x": torch.ones(1000)}, storage_writer=methods[m][0](d))
            dcp_load({"x": torch.zeros(1000)}, storage_reader=methods[m][1](d))
        for rep in range(args.repeat):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for m in order:
                d = os.path.join(root, f"{m}_{rep}")
                t0 = time.perf_counter()
                dcp_save(state, storage_writer=methods[m][0](d))
                t1 = time.perf_counter()
                for v in dests.values():
                    if isinstance(v, torch.Tensor):
                        v.zero_()
                raw = raw_read_seconds(d)
                t2 = time.perf_counter()
                dcp_load(dests, storage_reader=methods[m][1](d))
                t3 = time.perf_counter()
                for k, s in sums.items():
                    if dests[k].double().sum().item() != s:
                        raise SystemExit(f"{m}: wrong values loaded for {k}")
                if dests["iteration"] != 1234:
                    raise SystemExit(f"{m}: wrong object loaded")
                best[m][0] = min(best[m][0], t1 - t0)
                best[m][1] = min(best[m][1], t3 - t2)
                best[m][2] = min(best[m][2], (t3 - t2) / raw)
                shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base_s, base_l, _ = best["plain"]
    print(f"checksum cost: {nbytes / GB:.2f} GB in {args.tensors} tensors, 1 process, threads {args.threads}, "
          f"sync_files {args.sync}, best of {args.repeat}")
    print(f"{'method':<8} {'save s':>8} {'load s':>8} {'save GB/s':>10} {'load GB/s':>10} {'save ratio':>11} "
          f"{'load ratio':>11} {'total ratio':>12} {'load/raw':>9}")
    for m in names:
        s, l, r = best[m]
        print(f"{m:<8} {s:8.3f} {l:8.3f} {nbytes / GB / s:10.2f} {nbytes / GB / l:10.2f} {s / base_s:11.3f} "
              f"{l / base_l:11.3f} {(s + l) / (base_s + base_l):12.3f} {r:9.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="FileSystemWriter thread_count")
    p.add_argument("--dir", default=None)
    p.add_argument("--no-sync", dest="sync", action="store_false", help="sync_files=False (no fsync)")
    run(p.parse_args())


if __name__ == "__main__":
    main()
