"""The loss curve with reduced-precision Adam moments next to the fp32-moment curve (issue 44: "100 steps of the
dense model with bf16 moments within 1 % of the fp32-moment loss curve").

Each run is one ``pretrain_gpt.py`` job (``pretrain``, one process, mock data, the same seed and samples), in its own
interpreter: ``--bf16 --use-distributed-optimizer`` with fp32 moments, then the same with
``--use-precision-aware-optimizer`` and bf16 moments (and bf16 main grads). Printed: the loss every ``--every``
iterations for each run, the relative difference to the fp32 curve, its largest value over all iterations and over
the last tenth (where the curve has settled), and whether the largest is within ``--tolerance``.

    python benchmarks/precision_aware_loss_curve.py            # CPU (gloo), a small dense GPT, 100 iterations
    python benchmarks/precision_aware_loss_curve.py --layers 8 --hidden 1024 --seq 1024   # a CUDA device if present
"""
import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {  # name: extra flags
    "fp32 moments": [],
    "bf16 moments": ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"],
    "bf16 moments + bf16 main grads": ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
                                       "--exp-avg-sq-dtype", "bf16", "--main-grads-dtype", "bf16"],
}


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--gbs", type=int, default=8)
    p.add_argument("--every", type=int, default=10, help="print every N-th iteration")
    p.add_argument("--tolerance", type=float, default=0.01)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _flags(a) -> list:
    import torch

    cuda = torch.cuda.is_available()
    return [str(x) for x in (
        "--num-layers", a.layers, "--hidden-size", a.hidden, "--num-attention-heads", a.heads,
        "--ffn-hidden-size", 4 * a.hidden, "--seq-length", a.seq, "--max-position-embeddings", a.seq,
        "--vocab-size", a.vocab, "--micro-batch-size", a.gbs, "--global-batch-size", a.gbs,
        "--train-iters", a.iters, "--lr", 1e-3, "--min-lr", 1e-4, "--lr-decay-style", "cosine",
        "--lr-warmup-iters", max(1, a.iters // 10), "--weight-decay", 0.01, "--clip-grad", 1.0, "--seed", 1234,
        "--mock-data", "--log-interval", a.iters, "--eval-iters", 0, "--hidden-dropout", 0, "--attention-dropout", 0,
        "--bf16", "--use-distributed-optimizer", "--distributed-backend", "nccl" if cuda else "gloo",
        "--transformer-impl", "local")]


def _worker(a) -> None:
    sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron.training.training import pretrain

    result = pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider, None,
                      pretrain_gpt.forward_step, args=_flags(a) + RUNS[a.worker])
    print("LOSSES " + json.dumps({int(k): float(v) for k, v in result.losses.items()}), flush=True)


def _run(name: str, argv) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", name] + argv, env=env,
                          capture_output=True, text=True)
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("LOSSES ")]
    if done.returncode or not line:
        sys.exit(f"{name}: exited {done.returncode}\n" + "\n".join((done.stdout + done.stderr).splitlines()[-30:]))
    return {int(k): v for k, v in json.loads(line[-1][len("LOSSES "):]).items()}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = _args(argv)
    if a.worker:
        _worker(a)
        return 0
    curves = {name: _run(name, argv) for name in RUNS}
    base = curves["fp32 moments"]
    names = list(RUNS)
    print(f"# {a.iters} iterations, {a.layers} layers, hidden {a.hidden}, seq {a.seq}, global batch {a.gbs}, --bf16 "
          "--use-distributed-optimizer")
    print("| iteration | " + " | ".join(names) + " | " + " | ".join(f"rel. diff ({n})" for n in names[1:]) + " |")
    print("| --- " * (2 * len(names)) + "|")
    for it in sorted(base):
        if it % a.every and it != 1:
            continue
        rel = [abs(curves[n][it] - base[it]) / abs(base[it]) for n in names[1:]]
        print(f"| {it} | " + " | ".join(f"{curves[n][it]:.5f}" for n in names) + " | "
              + " | ".join(f"{r:.2e}" for r in rel) + " |")
    tail = [it for it in base if it > a.iters * 0.9]
    ok = True
    for n in names[1:]:
        worst = max(abs(curves[n][it] - base[it]) / abs(base[it]) for it in base)
        worst_tail = max(abs(curves[n][it] - base[it]) / abs(base[it]) for it in tail)
        ok &= worst <= a.tolerance
        print(f"{n}: largest relative difference {worst:.2e} (last tenth {worst_tail:.2e}); "
              f"{'within' if worst <= a.tolerance else 'NOT within'} {a.tolerance:.0%}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
