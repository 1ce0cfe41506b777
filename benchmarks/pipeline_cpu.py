"""Step time of pretrain_gpt with pipeline parallelism against data parallelism on CPU ranks (gloo): PP=2 x DP=1
against PP=1 x DP=2 on 2 processes for the same model and the same global batch of ``--m`` micro-batches per
iteration (PP=2: every stage runs all m through half the layers; DP=2: every rank m / 2 through all layers, the same
work per rank). Printed: the step-time ratio PP=2 / (PP=1 x DP=2) (medians after ``--warmup`` iterations; goal
<= 1.2), and the measured bubble ``1 - t(DP=2) / t(PP=2)`` (the PP step's time beyond the same work without a
pipeline), and the bubble measured from the slope (below), beside 1F1B's ``(p - 1) / (m + p - 1)``. CPU figures: read
the ratios only.

    PYTHONPATH=. python benchmarks/pipeline_cpu.py [--m 8] [--iters 8] [--layers 8] [--hidden 256]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _argv(a, pp: int, dp: int) -> list:
    mbs = 2
    return [str(x) for x in (
        "--num-layers", a.layers, "--hidden-size", a.hidden, "--num-attention-heads", 8, "--seq-length", a.seq,
        "--max-position-embeddings", a.seq, "--vocab-size", 1024, "--micro-batch-size", mbs,
        "--global-batch-size", mbs * a.m, "--train-iters", a.iters, "--lr", 1e-4, "--mock-data",
        "--log-interval", 1000, "--eval-iters", 0, "--distributed-backend", "gloo", "--transformer-impl", "local",
        "--hidden-dropout", 0, "--attention-dropout", 0, "--pipeline-model-parallel-size", pp, "--seed", 3)]


def _worker(rank, world, store_path, a, pp, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, a.threads))
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    import pretrain_gpt
    from megatron.training.training import pretrain

    stamps = []
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider, None,
             pretrain_gpt.forward_step, args=_argv(a, pp, world // pp),
             on_iteration_end=lambda it, model, loss: stamps.append(time.perf_counter()))
    if rank == 0:
        steps = [b - c for c, b in zip(stamps, stamps[1:])][a.warmup:]
        out.put(statistics.median(steps))
    dist.destroy_process_group()


def run(a, pp: int) -> float:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    fd, store = tempfile.mkstemp(prefix="pp_bench_")
    os.close(fd)
    os.unlink(store)
    procs = [ctx.Process(target=_worker, args=(r, 2, store, a, pp, out)) for r in range(2)]
    for p in procs:
        p.start()
    value = out.get(timeout=1800)
    for p in procs:
        p.join()
    return value


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", type=int, default=8, help="micro-batches per iteration on each rank")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    a = p.parse_args()
    if a.m % 2:
        p.error("--m must be even (DP=2 splits the micro-batches over 2 ranks)")
    dp2 = run(a, pp=1)
    pp2 = run(a, pp=2)
    pp2_twice = run(argparse.Namespace(**{**vars(a), "m": 2 * a.m}), pp=2)
    stages = 2
    t_mb = (pp2_twice - pp2) / a.m
    print(f"\n{a.layers} layers, hidden {a.hidden}, seq {a.seq}, a global batch of {a.m} micro-batches of 2, 2 CPU "
          f"ranks ({a.threads} thread(s) each)")
    print(f"| {'config':<12} | {'s/iter':>8} | {'ratio to DP=2':>13} | {'1 - t(DP)/t(PP)':>15} | "
          f"{'bubble, measured':>16} | {'(p-1)/(m+p-1)':>13} |")
    print(f"|{'-' * 14}|{'-' * 10}|{'-' * 15}|{'-' * 17}|{'-' * 18}|{'-' * 15}|")
    print(f"| {'PP=1 x DP=2':<12} | {dp2:>8.3f} | {1.0:>13.2f} | {'':>15} | {'':>16} | {'':>13} |")
    print(f"| {'PP=2 x DP=1':<12} | {pp2:>8.3f} | {pp2 / dp2:>13.2f} | {1 - dp2 / pp2:>15.3f} | "
          f"{(stages - 1) * t_mb / pp2:>16.3f} | {(stages - 1) / (a.m + stages - 1):>13.3f} |")
    print(f"PP=2 at {2 * a.m} micro-batches: {pp2_twice:.3f} s/iter; per micro-batch and stage {t_mb:.4f} s; fixed "
          f"costs {pp2 - (a.m + stages - 1) * t_mb:.3f} s/iter")


if __name__ == "__main__":
    main()
