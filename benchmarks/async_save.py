"""How long training is blocked per checkpoint save: synchronous ``dist_checkpointing.save`` against the asynchronous
save (``save(..., async_sharded_save=True)`` scheduled on an ``AsyncCallsQueue``) with DCP's THREAD and PROCESS
checkpointers, on the same ~``--gb`` GB state (sharded over the ranks, a quarter replicated).

For each method: ``blocked`` = seconds from the call of ``save`` until training may continue (sync: the whole write;
async: planning checks + the CPU copy), barrier to barrier, best of ``--repeat`` saves after one unmeasured warm-up
save (the first async save also starts DCP's checkpoint process / thread: reported as ``first``); ``done`` = seconds
until the save is finalized (metadata.json written on every rank) while the ranks run a matmul loop meanwhile
("training"); ``step slowdown`` = the matmul loop's time per step during the background write relative to without.
CPU figures: read the ratios only.

    python benchmarks/async_save.py --gb 0.5 --nproc 2 [--repeat 3] [--dir /fast/disk/tmp]
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


def train_steps(x, n):
    """``n`` steps of a matmul loop standing for training; seconds per step."""
    start = time.perf_counter()
    for _ in range(n):
        x = torch.tanh(x @ x)
    if x.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / n


def one_save(method, sd, base, name, rank, queue, x, steps):
    d = os.path.join(base, name)
    if rank == 0:
        os.makedirs(d)
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
    step = None
    while queue.get_num_unfinalized_calls():
        step = train_steps(x, steps)
        queue.maybe_finalize_async_calls()
    return blocked, time.perf_counter() - start, step


def worker(rank, world, args, base, out):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DCP's checkpoint process (PROCESS) needs an address
    if not dist.is_initialized():  # spawned rank
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{base}/store")
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(rank)
    sd = build_state(args.gb, rank, world, device)
    x = torch.randn(args.matmul, args.matmul, device=device) / args.matmul ** 0.5
    quiet_step = min(train_steps(x, args.steps) for _ in range(3))
    queue = AsyncCallsQueue()
    rows = []
    for method in METHODS:
        if method not in args.which:
            continue
        first = one_save(method, sd, base, f"{method}-warm", rank, queue, x, args.steps)[0]
        best = None
        for r in range(args.repeat):
            res = one_save(method, sd, base, f"{method}-{r}", rank, queue, x, args.steps)
            best = res if best is None or res[0] < best[0] else best
        rows.append((method, first) + best)
    queue.close()
    if rank == 0:
        nbytes = sum(v.data.numel() * v.data.element_size() for v in sd.values())
        sync_blocked = next((r[2] for r in rows if r[0] == "sync"), None)
        lines = [f"{world} rank(s), device {args.device}, {nbytes / 1e9:.2f} GB per rank held, "
                 f"{time.strftime('%Y-%m-%d')}",
                 f"{'method':<14} {'first s':>8} {'blocked s':>10} {'done s':>8} {'blocked/sync':>13} "
                 f"{'step slowdown':>14}"]
        for method, first, blocked, done, step in rows:
            ratio = f"{blocked / sync_blocked:.3f}" if sync_blocked else "-"
            slow = f"{step / quiet_step:.2f}x" if step else "-"
            lines.append(f"{method:<14} {first:8.3f} {blocked:10.3f} {done:8.3f} {ratio:>13} {slow:>14}")
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=0.5, help="state size over all ranks (GB)")
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks to spawn (CPU); ignored under torchrun")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--matmul", type=int, default=256, help="size of the 'training' matmul")
    p.add_argument("--steps", type=int, default=5, help="'training' steps between finalize checks")
    p.add_argument("--which", default=",".join(METHODS))
    args = p.parse_args()
    args.which = args.which.split(",")
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
            torch.multiprocessing.spawn(worker, args=(args.nproc, args, base, out), nprocs=args.nproc)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(open(out).read(), end="")
    finally:
        if not dist.is_initialized() or dist.get_rank() == 0:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
