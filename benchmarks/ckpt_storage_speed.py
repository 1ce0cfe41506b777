"""Loads and saves at the storage's speed (issue 16, item 3): one rank, stacked layers (one key, prepended layer
axis, like upstream's models), measured side by side in one run.

Load (GB/s, warm = from the page cache, cold = after dropping the checkpoint files from it):
  - ``raw``:  the checkpoint's own data files read with ``readinto`` into two pinned 64 MiB buffers, each copied to
              the device while the other is read (the figure the goal is relative to),
  - ``ours``: ``dist_checkpointing.load`` into the device destinations,
  - ``dcp``:  plain ``torch.distributed.checkpoint.load`` of the same files into the same destinations.
Save (GB/s of the tensor bytes, including fsync), measured the same way for each: a fresh directory under the same
root, ``os.sync()`` before the timer starts (nothing earlier still being written back), one rotation of the order
per repeat, the directory removed (and synced) after:
  - ``dd``:   ``dd if=/dev/zero bs=64M iflag=count_bytes conv=fsync`` of exactly as many bytes as our checkpoint
              directory holds (all its files, measured after an unmeasured warm-up save),
  - ``ours``: ``dist_checkpointing.save`` (data files fsynced, metadata, checksums),
  - ``ours from host`` (CUDA only): the same from host copies of the tensors (the device-to-host copy left out),
  - ``dcp``:  plain ``torch.distributed.checkpoint.save`` (``FileSystemWriter``, default settings).
Save figures are the median [min-max] over the repeats; ``vs dd`` is dd's time over the method's time in the same
repeat (the same bytes on disk for ours), median [min-max].

Goals: load >= 0.8 x raw (warm and cold), save >= 0.9 x dd. Load figures are the best of ``--repeat``; every load is
checked against the saved values. Cold reads drop the files with ``posix_fadvise(DONTNEED)`` after ``os.sync()``
(and ``/proc/sys/vm/drop_caches`` when writable).

    python benchmarks/ckpt_storage_speed.py [--layers 16 --dim 8192] [--repeat 2] [--dir /fast/disk/tmp]
    CPU smoke: python benchmarks/ckpt_storage_speed.py --layers 4 --dim 1024
"""
import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing import ShardedTensor  # noqa: E402

KEY = "decoder.layers.mlp.linear_fc1.weight"
PIECE = 64 << 20


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sharded(stacked: torch.Tensor):
    """Our model layout: one ShardedTensor per layer, the layer on a prepended axis of one key."""
    n = stacked.shape[0]
    return {f"l{i}": ShardedTensor.from_rank_offsets(KEY, stacked[i], (0, i, n), prepend_axis_num=1) for i in range(n)}


def drop_cache(path: str, system: bool = True) -> str:
    """Evict the files under ``path`` from the page cache (``system``: the whole page cache too, when
    ``/proc/sys/vm/drop_caches`` is writable); returns how."""
    os.sync()
    how = "fadvise"
    try:
        if system:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            how = "drop_caches"
    except OSError:
        pass
    for name in glob.glob(os.path.join(path, "**", "*"), recursive=True):
        if os.path.isfile(name):
            fd = os.open(name, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return how


def raw_read(path: str, dest: torch.Tensor) -> int:
    """Read every ``*.distcp`` file of ``path`` into pinned buffers and copy them into ``dest``'s bytes (the files
    hold a little more than the tensor: what does not fit wraps around); returns bytes read."""
    flat = dest.view(-1).view(torch.uint8)
    pin = dest.device.type == "cuda"
    bufs = [torch.empty(PIECE, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
    events = [None, None]
    total, pos, k = 0, 0, 0
    for name in sorted(glob.glob(os.path.join(path, "*.distcp"))):
        with open(name, "rb", buffering=0) as f:
            while True:
                if events[k] is not None:
                    events[k].synchronize()
                mv = memoryview(bufs[k].numpy())
                n = f.readinto(mv)
                if not n:
                    break
                if pos + n > flat.numel():
                    pos = 0
                flat[pos:pos + n].copy_(bufs[k][:n], non_blocking=pin)
                if pin:
                    events[k] = torch.cuda.Event()
                    events[k].record()
                pos += n
                total += n
                k ^= 1
    _sync(dest.device)
    return total


def dd_write(directory: str, nbytes: int) -> None:
    """``dd`` of exactly ``nbytes`` zeros into ``directory``/dd.bin, fsynced."""
    subprocess.run(["dd", "if=/dev/zero", f"of={os.path.join(directory, 'dd.bin')}", "bs=64M", f"count={nbytes}",
                    "iflag=count_bytes", "conv=fsync"], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
               if os.path.isfile(f))


def spread(values, fmt="{:.2f}") -> str:
    values = sorted(values)
    n = len(values)
    mid = values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
    return f"{fmt.format(mid)} [{fmt.format(values[0])}-{fmt.format(values[-1])}]"


def timed_saves(root: str, savers: dict, repeat: int, device) -> dict:
    """{name: [seconds per repeat]}: each saver called with a fresh directory under ``root``, order rotated."""
    names, times = list(savers), {name: [] for name in savers}
    for rep in range(repeat):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            d = os.path.join(root, f"save_{name.replace(' ', '_')}_{rep}")
            os.makedirs(d)
            _sync(device)
            os.sync()
            t0 = time.perf_counter()
            savers[name](d)
            _sync(device)
            times[name].append(time.perf_counter() - t0)
            shutil.rmtree(d)
            os.sync()
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dim", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-cold", action="store_true", help="skip the cold-cache loads")
    a = p.parse_args()

    import torch.distributed.checkpoint as dcp

    device = torch.device(a.device)
    g = torch.Generator(device=device).manual_seed(0)
    src = torch.randn(a.layers, a.dim, a.dim, device=device, dtype=torch.bfloat16, generator=g)
    nbytes = src.numel() * src.element_size()
    ref = src.float().sum(dim=(1, 2))
    dest = torch.empty_like(src)
    root = tempfile.mkdtemp(prefix="ckpt_storage_speed_", dir=a.dir)
    best = {}

    def note(name, gbps):
        best[name] = max(best.get(name, 0.0), gbps)

    def check(what):
        if not torch.equal(dest.float().sum(dim=(1, 2)), ref):
            raise SystemExit(f"{what}: loaded values differ from the saved ones")
        dest.zero_()

    how = "-"
    try:
        warm_dir = os.path.join(root, "warm")
        os.makedirs(warm_dir)
        dist_checkpointing.save(sharded(src), warm_dir)  # unmeasured; its size is what dd writes
        disk_bytes = dir_bytes(warm_dir)
        shutil.rmtree(warm_dir)
        savers = {
            "dd": lambda d: dd_write(d, disk_bytes),
            "ours": lambda d: dist_checkpointing.save(sharded(src), d),
            "dcp": lambda d: dcp.save({KEY: src}, checkpoint_id=d, no_dist=True),
        }
        if device.type == "cuda":
            host = src.cpu()
            savers["ours from host"] = lambda d: dist_checkpointing.save(sharded(host), d)
        save_times = timed_saves(root, savers, a.repeat, device)
        for rep in range(a.repeat):
            ours_dir = os.path.join(root, f"ours{rep}")
            os.makedirs(ours_dir)
            dist_checkpointing.save(sharded(src), ours_dir)
            temps = ["warm"] if a.no_cold else ["warm", "cold"]
            for temp in temps:
                for what in ("raw", "ours", "dcp"):
                    if temp == "cold":
                        how = drop_cache(ours_dir)
                    else:
                        raw_read(ours_dir, dest)  # bring the files into the page cache
                        dest.zero_()
                    _sync(device)
                    t0 = time.perf_counter()
                    if what == "raw":
                        raw_read(ours_dir, dest)
                    elif what == "ours":
                        dist_checkpointing.load(sharded(dest), ours_dir)
                    else:
                        dcp.load({KEY: dest}, checkpoint_id=ours_dir, no_dist=True)
                    _sync(device)
                    note(f"load {what} {temp}", nbytes / (time.perf_counter() - t0))
                    if what == "raw":
                        dest.zero_()
                    else:
                        check(f"{what} {temp}")
            shutil.rmtree(ours_dir)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{a.layers} x {a.dim}^2 bf16 = {nbytes / 1e9:.2f} GB, one rank, destinations on {dev}, "
          f"torch {torch.__version__}, best of {a.repeat}, cold via {how}, dir {a.dir or tempfile.gettempdir()}")
    print("| what | warm GB/s | vs raw | cold GB/s | vs raw |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for what in ("raw", "ours", "dcp"):
        w, c = best.get(f"load {what} warm"), best.get(f"load {what} cold")
        rw, rc = best.get("load raw warm"), best.get("load raw cold")
        fmt = lambda v, r: ("-", "-") if v is None else (f"{v / 1e9:.2f}", f"{v / r:.2f}")  # noqa: E731
        print(f"| load {what} | {' | '.join(fmt(w, rw))} | {' | '.join(fmt(c, rc) if c else ('-', '-'))} |")
    print(f"\nsave: {a.repeat} repeats, order rotated, median [min-max]; dd writes {disk_bytes / 1e9:.3f} GB (our "
          f"checkpoint directory's size), GB/s = {nbytes / 1e9:.3f} GB of tensors / time")
    print("| what | s | GB/s | vs dd (same repeat) |")
    print("| --- | ---: | ---: | ---: |")
    for what, ts in save_times.items():
        vs = spread([dd / t for dd, t in zip(save_times["dd"], ts)])
        print(f"| save {what} | {spread(ts)} | {spread([nbytes / t / 1e9 for t in ts])} | {vs} |")


if __name__ == "__main__":
    main()
