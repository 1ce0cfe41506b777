"""Cost of per-item checksums (``strategies/filesystem.py``): DCP save and load of the same ~1-2 GB state with
torch's ``FileSystemWriter``/``FileSystemReader`` and with ``ChecksummedFileSystemWriter``/``Reader`` (each available
algorithm), in one process, in one run. Per repeat (method order rotated) each method's save and load time is divided
by the plain method's of the same repeat; the table gives the median [min-max] of these ratios (goal: <= 1.05).
``load, no verify``: our reader with ``verify="off"`` over plain; ``verify cost``: our load over that same reader
without verification, run right next to it (what the checksums themselves cost on load); ``load/raw``: the load over
a raw ``readinto`` of the same checkpoint's data files right before it (the read side's overhead over the storage,
page cache warm; on a GPU, ``benchmarks/ckpt_storage_speed.py`` measures cold and CUDA destinations). Seconds: the
best of the repeats.
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
    names = list(methods)
    times = {m: {"save": [], "load": [], "noverify": [], "raw": []} for m in names}
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
                times[m]["save"].append(time.perf_counter() - t0)
                loads = [("load", methods[m][1])]
                if m != "plain":  # the same reader with verification off: what the checksums cost on load
                    loads.append(("noverify", lambda d: ChecksummedFileSystemReader(d, verify="off")))
                for what, make_reader in (loads if rep % 2 == 0 else loads[::-1]):
                    for v in dests.values():
                        if isinstance(v, torch.Tensor):
                            v.zero_()
                    raw = raw_read_seconds(d)
                    t2 = time.perf_counter()
                    dcp_load(dests, storage_reader=make_reader(d))
                    times[m][what].append(time.perf_counter() - t2)
                    if what == "load":
                        times[m]["raw"].append(raw)
                    for k, s in sums.items():
                        if dests[k].double().sum().item() != s:
                            raise SystemExit(f"{m}: wrong values loaded for {k}")
                    if dests["iteration"] != 1234:
                        raise SystemExit(f"{m}: wrong object loaded")
                shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    plain = times["plain"]
    print(f"checksum cost: {nbytes / GB:.2f} GB in {args.tensors} tensors, 1 process, threads {args.threads}, "
          f"sync_files {args.sync}, {args.repeat} repeats (order rotated); median [min-max] over the repeats of the "
          f"ratio to the plain method of the same repeat")
    print(f"{'method':<8} {'save s':>7} {'load s':>7} {'save ratio':>20} {'load ratio':>20} {'load, no verify':>20} "
          f"{'verify cost':>20} {'load/raw':>20}")
    for m in names:
        t = times[m]
        ratio = lambda a, b: _spread([x / y for x, y in zip(a, b)])  # noqa: E731
        noverify = ratio(t["noverify"], plain["load"]) if t["noverify"] else "-"
        verify_cost = ratio(t["load"], t["noverify"]) if t["noverify"] else "-"
        print(f"{m:<8} {min(t['save']):7.3f} {min(t['load']):7.3f} {ratio(t['save'], plain['save']):>20} "
              f"{ratio(t['load'], plain['load']):>20} {noverify:>20} {verify_cost:>20} {ratio(t['load'], t['raw']):>20}")


def _spread(values):
    values = sorted(values)
    n = len(values)
    mid = values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
    return f"{mid:.3f} [{values[0]:.3f}-{values[-1]:.3f}]"


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
