"""How long training is blocked per checkpoint save: synchronous ``dist_checkpointing.save`` against the asynchronous
save (``save(..., async_sharded_save=True)`` scheduled on an ``AsyncCallsQueue``) with DCP's THREAD and PROCESS
checkpointers, on the same ~``--gb`` GB state (sharded over the ranks, a quarter replicated), and how much the
training steps slow down while the write runs in the background.

Per method, after one unmeasured warm-up save (``first``: it allocates the reusable host staging buffers and starts
DCP's checkpoint process / thread), ``--repeat`` saves, each reported as median [min-max] over the repeats:

- ``blocked``: seconds from the call of ``save`` until training may continue (sync: the whole write; async: the
  planning checks and the copy into the host staging buffers), barrier to barrier;
- ``done``: seconds until the save is finalized on every rank (``metadata.json`` written) while "training" runs;
- ``step x``: the training step's mean time while the write runs in the background over its mean time in the same
  number of steps right before that save (no write running). Two kinds of "training" step (``--load``):
  ``matmul``: one ``--matmul`` square matmul + tanh (device bound on a GPU: bf16 8192^2 by default there), and
  ``launch``: ``--ops`` tiny element-wise ops (host bound: every op releases and re-takes the GIL, so it shows the
  GIL contention of a writer thread in this process; a real training step launches hundreds to thousands of
  kernels). Every step ends with a device synchronize (as ``loss.item()`` does), timed alone: the finalize checks
  between steps are not in it. A rank with nothing to step on (sync saves) shows ``-``.

CPU figures: read the ratios only (a 2-core machine runs the writer on the cores the ranks train on).

    python benchmarks/async_save.py --gb 0.5 --nproc 2 [--repeat 3] [--dir /fast/disk/tmp]
    python benchmarks/async_save.py --device cuda --gb 4            # one GPU (spawned, one rank)
    torchrun --nproc-per-node 8 benchmarks/async_save.py --device cuda --gb 8 --dir /fast/disk/tmp   # GPUs
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing import ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: E402
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy  # noqa: E402

METHODS = ("sync", "async-thread", "async-process")


def build_state(gb, rank, world, device, n_tensors=8):
    per = int(gb * 1e9 / n_tensors)
    sd = {}
    for i in range(n_tensors):
        replicated = i % 4 == 3
        rows = max(world, (per // 4 // 1024) // world * world)
        local_rows = rows if replicated else rows // world
        t = torch.randn(local_rows, 1024, device=device)
        if replicated:
            sd[f"t{i}"] = ShardedTensor.from_rank_offsets(f"t{i}", t, replica_id=rank)
        else:
            sd[f"t{i}"] = ShardedTensor.from_rank_offsets(f"t{i}", t, (0, rank, world))
    return sd


class Training:
    """The "training" step: ``matmul`` (one square matmul + tanh) or ``launch`` (``ops`` tiny element-wise ops)."""

    def __init__(self, kind, device, matmul, ops):
        self.kind, self.ops, self.device = kind, ops, device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.x = torch.randn(matmul, matmul, device=device, dtype=dtype) / matmul ** 0.5
        self.y = torch.randn(256, device=device)

    def step(self) -> float:
        """Seconds of one step, synchronized at its end."""
        start = time.perf_counter()
        if self.kind == "matmul":
            self.x = torch.tanh(self.x @ self.x)
        else:
            y = self.y
            for _ in range(self.ops):
                y = y * 0.999 + 0.001
            self.y = y
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start


def one_save(method, sd, base, name, rank, queue, training, quiet_steps):
    """(blocked s, done s, step slowdown or None) of one save; the checkpoint is deleted once measured (4 GB x
    methods x repeats filled the H200 machine's 64 GiB disk: torch.save then fails with "unexpected pos")."""
    try:
        return _timed_save(method, sd, os.path.join(base, name), rank, queue, training, quiet_steps)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def _timed_save(method, sd, d, rank, queue, training, quiet_steps):
    if rank == 0:
        os.makedirs(d)
    quiet = [training.step() for _ in range(quiet_steps)] if training is not None else []
    dist.barrier()
    start = time.perf_counter()
    if method == "sync":
        dist_checkpointing.save(sd, d)
        dist.barrier()
        return time.perf_counter() - start, time.perf_counter() - start, None
    strategy = TorchDistSaveShardedStrategy()
    strategy.async_checkpointer_type = method.split("-")[1]
    queue.schedule_async_request(dist_checkpointing.save(sd, d, strategy, async_sharded_save=True))
    dist.barrier()
    blocked = time.perf_counter() - start
    for v in sd.values():  # training changes the weights right away
        v.data.add_(1.0)
    during = []
    while queue.get_num_unfinalized_calls():
        for _ in range(5):
            during.append(training.step())
        queue.maybe_finalize_async_calls()
    slowdown = (sum(during) / len(during)) / (sum(quiet) / len(quiet)) if during and quiet else None
    return blocked, time.perf_counter() - start, slowdown


def _spread(values, fmt="{:.3f}"):
    values = sorted(v for v in values if v is not None)
    if not values:
        return "-"
    mid = values[len(values) // 2] if len(values) % 2 else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2
    return f"{fmt.format(mid)} [{fmt.format(values[0])}-{fmt.format(values[-1])}]"


def worker(rank, world, args, base, out):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DCP's checkpoint process (PROCESS) needs an address
    if args.device == "cpu":
        torch.set_num_threads(1)  # one intra-op thread per rank: 2 ranks x 2 OpenMP threads oversubscribe 2 cores
    if not dist.is_initialized():  # spawned rank
        if args.device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group("cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo", rank=rank,
                                world_size=world, init_method=f"file://{base}/store")
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(rank)
    sd = build_state(args.gb, rank, world, device, n_tensors=args.tensors)
    queue = AsyncCallsQueue(persistent=True)
    rows = []
    for method in METHODS:
        if method not in args.which:
            continue
        for load in args.load:
            training = Training(load, device, args.matmul, args.ops)
            for _ in range(3):
                training.step()  # warm-up
            first = one_save(method, sd, base, f"{method}-{load}-warm", rank, queue, training, args.quiet_steps)[0]
            res = [one_save(method, sd, base, f"{method}-{load}-{r}", rank, queue, training, args.quiet_steps)
                   for r in range(args.repeat)]
            rows.append((method, load, first, [r[0] for r in res], [r[1] for r in res], [r[2] for r in res]))
            if method == "sync":
                break  # no background write: one load is enough
    queue.close()
    if rank == 0:
        nbytes = sum(v.data.numel() * v.data.element_size() for v in sd.values())
        sync = [r for r in rows if r[0] == "sync"]
        sync_med = sorted(sync[0][3])[len(sync[0][3]) // 2] if sync else None
        what = {"matmul": f"matmul {args.matmul}", "launch": f"{args.ops} tiny ops"}
        lines = [f"{world} rank(s), {len(sd)} tensors, device {args.device}"
                 f"{' (' + torch.cuda.get_device_name() + ')' if args.device == 'cuda' else ''}, "
                 f"{nbytes / 1e9:.2f} GB per rank held, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}; "
                 f"median [min-max] of {args.repeat} saves",
                 f"{'method':<14} {'step':<14} {'first s':>8} {'blocked s':>22} {'blocked/sync':>22} "
                 f"{'done s':>22} {'step x during write':>22}"]
        for method, load, first, blocked, done, slow in rows:
            ratio = _spread([b / sync_med for b in blocked]) if sync_med else "-"
            step = what[load] if method != "sync" else "-"
            lines.append(f"{method:<14} {step:<14} {first:8.3f} {_spread(blocked):>22} {ratio:>22} "
                         f"{_spread(done):>22} {_spread(slow, '{:.2f}'):>22}")
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "async_save.txt"), "w") as f:
                f.write("\n".join(lines) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=0.5, help="state size over all ranks (GB)")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to spawn (default: 2 on cpu, 1 on cuda); ignored under torchrun")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--matmul", type=int, default=None,
                   help="size of the 'training' matmul (default: 8192 bf16 on cuda, 256 fp32 on cpu)")
    p.add_argument("--tensors", type=int, default=8, help="tensors in the state (a real model: hundreds)")
    p.add_argument("--ops", type=int, default=200, help="tiny ops per 'launch' step")
    p.add_argument("--load", default="matmul,launch", help="'training' steps to measure: matmul, launch")
    p.add_argument("--quiet-steps", type=int, default=20, help="steps timed right before each save (no write)")
    p.add_argument("--which", default=",".join(METHODS))
    p.add_argument("--out", default=os.environ.get("OUT"), help="also write the table here (default: $OUT)")
    args = p.parse_args()
    args.which = args.which.split(",")
    args.load = args.load.split(",")
    if args.matmul is None:
        args.matmul = 8192 if args.device == "cuda" else 256
    base = tempfile.mkdtemp(prefix="async_save_", dir=args.dir)
    out = os.path.join(base, "table.txt")
    try:
        if "RANK" in os.environ:  # torchrun
            if args.device == "cuda":
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dist.init_process_group("cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo")
            worker(dist.get_rank(), dist.get_world_size(), args, base, out)
            dist.barrier()
        else:
            nproc = args.nproc or (1 if args.device == "cuda" else 2)
            torch.multiprocessing.spawn(worker, args=(nproc, args, base, out), nprocs=nproc)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(open(out).read(), end="")
    finally:
        if not dist.is_initialized() or dist.get_rank() == 0:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
