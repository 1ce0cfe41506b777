"""Upstream megatron-core 0.19's training recipe on one GPU, on this fork and on the real upstream 0.19.2, side by side.

The recipe is ``tests/unit_tests/training/upstream_recipe.py`` (only upstream's public API: GPTModel from
``get_gpt_layer_with_transformer_engine_spec``, ``Float16Module`` under bf16, ``DistributedDataParallel`` /
the distributed optimizer / Megatron-FSDP (``mcore_fsdp_adapter.FullyShardedDataParallel``, ZeRO-3),
``get_megatron_optimizer``, ``get_forward_backward_func``), here with a GPU-sized model: TE layers, bf16, FP8 hybrid
delayed scaling with FP8 weights (``fp8_param=True``; ``fp8_param_gather`` for the engines). Each (package, engine)
runs in its own process (a 1-rank NCCL group initialised there, no torchrun): ``PYTHONPATH`` names this repository
for the fork and ``MCORE_UPSTREAM_SITE`` (a directory holding upstream's ``megatron/``) for upstream, so the two
packages never meet in one interpreter. The runs alternate fork / upstream per engine, so a time limit still leaves
whole pairs. ``--warmup`` steps, then ``--steps`` timed steps (wall clock between two device syncs); a run that fails or
times out puts its error in its row and the rest goes on.

CUDA graphs (``--cuda-graph-impl none,local,transformer_engine``, any of them, comma-separated;
``--cuda-graph-modules``, upstream's names, none given: the whole layer, upstream's default): every (engine, graphs)
pair runs on both packages through upstream's API as its ``training.py`` drives it (``TECudaGraphHelper`` /
``create_cudagraphs()`` / ``delete_cuda_graphs()``; ``local``: nothing, the schedules drive it; see
``upstream_recipe.py``): on upstream its own graph code, on the fork the drop-in adapters of
``megatron/core/transformer/cuda_graphs.py``. With graphs in the run, every row (graphs off too) uses the recipe
both packages graph: FP8 hybrid delayed *without* FP8 weights (the fork refuses ``fp8_param`` / fp8-param-gather with
graphs), DDP and the distributed optimizer (the fork refuses Megatron-FSDP with graphs; ``--engines fsdp`` shows its
error); ``local`` on the fork needs ``--no-fp8`` (its FP8 graphs are ``transformer_engine``'s). ``--warmup`` must
exceed ``--cuda-graph-warmup-steps`` (default 3): the capture is never timed.

Prints one table: engine, CUDA graphs, tokens/s (fork, upstream, ratio fork/upstream), each package's tokens/s with
graphs over its own graphs-off row, peak GiB (``max_memory_allocated``), the fork's graph replays, and the
loss at step 20 (1-based, counting the warm-up steps; the last step if fewer). Both packages draw their own initial
weights (different orders): the losses are a sanity check, not an equality (``tests/unit_tests/training/
test_upstream_recipe.py`` compares losses from the same weights).

    MCORE_UPSTREAM_SITE=/path/to/site python benchmarks/upstream_recipe_gpu.py            # ~2-3 minutes on an H100
    MCORE_UPSTREAM_SITE=/path/to/site python benchmarks/upstream_recipe_gpu.py --cuda-graph-impl none,transformer_engine
    python benchmarks/upstream_recipe_gpu.py --engines ddp --warmup 3 --steps 5          # quicker
    python benchmarks/upstream_recipe_gpu.py --cpu-smoke                                 # plumbing only (tiny, gloo)

``--cpu-smoke`` (no GPU): a tiny model with local layers, bf16 without FP8, on CPU; upstream there runs under the
CPU shims of the recipe test (its Megatron-FSDP needs CUDA: that row shows the error); graph rows are skipped (CUDA
graphs need a GPU), with the reason in their row.
"""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE_DIR = REPO / "tests" / "unit_tests" / "training"
INTEROP_DIR = REPO / "tests" / "unit_tests" / "interop"
ENGINES = ("ddp", "dist_opt", "fsdp")
ENGINE_NAMES = {"ddp": "DDP", "dist_opt": "DDP + distributed optimizer", "fsdp": "Megatron-FSDP (ZeRO-3)"}
GRAPH_IMPLS = ("none", "local", "transformer_engine")
LOSS_STEP = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- child: one (package, engine) run -----------------------------------------------------------------------------
def child(args) -> None:
    import torch

    import upstream_recipe as recipe  # from RECIPE_DIR (on PYTHONPATH)

    cuda = not args.cpu_smoke
    if cuda:
        torch.cuda.set_device(0)
    elif args.package == "upstream":
        recipe._shim_upstream_on_cpu()  # before megatron's first import (as the recipe test's upstream run)
    torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    import megatron.core

    where = str(Path(megatron.core.__file__).resolve().parents[1])
    if not where.startswith(str(Path(args.expect_root).resolve())):
        raise RuntimeError(f"imported megatron from {where}, expected it under {args.expect_root}")
    # the recipe's sizes are its module globals (tiny for the CPU tests): a GPU-sized model here
    recipe.SEQ, recipe.VOCAB, recipe.PADDED_VOCAB = args.seq, args.vocab, args.padded_vocab
    recipe.MBS, recipe.GBS = args.mbs, args.gbs
    recipe.MODEL = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    res = recipe.run_recipe(args.engine, steps=args.warmup + args.steps, bf16=True, fp8=cuda and args.fp8,
                            device="cuda" if cuda else "cpu", warmup=args.warmup, fp8_param=args.fp8_param,
                            cuda_graph_impl=args.impl, cuda_graph_modules=args.cuda_graph_modules,
                            cuda_graph_warmup_steps=args.cuda_graph_warmup_steps)
    res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    res["megatron"] = where
    try:
        import importlib

        res["version"] = importlib.import_module("megatron.core.package_info").__version__
    except Exception:
        res["version"] = "?"
    with open(args.out, "w") as f:
        json.dump(res, f)
    torch.distributed.destroy_process_group()


# ---- parent: the runs and the table --------------------------------------------------------------------------------
def _last_error(text: str) -> str:
    """The most telling line of a failed run's output: the last exception line, else the last line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        ln = re.sub(r"^\[rank\d+\]:\s*", "", ln)  # torch's per-rank prefix
        head = ln.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Interrupt")) or head in ("AssertionError", "KeyError"):
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def run_one(args, package: str, engine: str, impl: str, root: Path, timeout: float, workdir: Path) -> dict:
    out = workdir / f"{package}_{engine}_{impl}.json"
    paths = [str(root), str(RECIPE_DIR)] + ([str(INTEROP_DIR)] if args.cpu_smoke else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    if args.cpu_smoke:
        env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--package", package, "--engine", engine,
           "--impl", impl, "--out", str(out), "--expect-root", str(root)] + _size_argv(args)
    t0 = time.time()
    try:
        done = subprocess.run(cmd, env=env, cwd=str(workdir), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        (workdir / f"{package}_{engine}_{impl}.log").write_text(tail)
        return {"error": f"timed out after {timeout:.0f} s"}
    log = done.stdout + done.stderr
    (workdir / f"{package}_{engine}_{impl}.log").write_text(log)
    if done.returncode != 0 or not out.is_file():
        return {"error": f"rc {done.returncode}: {_last_error(log)}"}
    with open(out) as f:
        res = json.load(f)
    res["wall_s"] = time.time() - t0
    return res


def _size_argv(args):
    return (["--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
             "--seq", str(args.seq), "--vocab", str(args.vocab), "--padded-vocab", str(args.padded_vocab),
             "--mbs", str(args.mbs), "--gbs", str(args.gbs), "--warmup", str(args.warmup), "--steps",
             str(args.steps), "--cuda-graph-warmup-steps", str(args.cuda_graph_warmup_steps)]
            + (["--cuda-graph-modules", *args.cuda_graph_modules] if args.cuda_graph_modules else [])
            + ([] if args.fp8 else ["--no-fp8"]) + (["--fp8-param"] if args.fp8_param else ["--no-fp8-param"])
            + (["--cpu-smoke"] if args.cpu_smoke else []))


def _fmt(x, spec):
    return "-" if x is None or x != x else format(x, spec)


def _loss_at(res, step):
    losses = res.get("losses") or []
    return losses[min(step, len(losses)) - 1] if losses else None


def _over_graphs_off(results, package, engine, impl):
    """A package's tokens/s with graphs over its own graphs-off row of the engine (None without both)."""
    if impl == "none":
        return None
    on, off = (results.get((package, engine, i), {}).get("tokens_per_s") for i in (impl, "none"))
    return on / off if on and off else None


def _replays(res):
    graphs = res.get("cuda_graphs") or {}
    if not graphs:
        return None
    return "not created" if not graphs.get("created") else graphs.get("replays")


def table(args, results) -> str:
    n = args.warmup + args.steps
    step = min(LOSS_STEP, n)
    rows = ["| engine | CUDA graphs | tokens/s fork | tokens/s upstream | fork / upstream | fork / its graphs-off | "
            "upstream / its graphs-off | peak GiB fork | peak GiB upstream | replays fork | "
            f"loss@{step} fork | loss@{step} upstream | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for engine in args.engines:
        for impl in args.impls:
            fork, up = results.get(("fork", engine, impl), {}), results.get(("upstream", engine, impl), {})
            tf, tu = fork.get("tokens_per_s"), up.get("tokens_per_s")
            ratio = tf / tu if tf and tu else None
            notes = [f"{p}: {r['error']}" for p, r in (("fork", fork), ("upstream", up)) if r.get("error")]
            replays = _replays(fork)
            rows.append(
                f"| {ENGINE_NAMES[engine]} | {impl} | {_fmt(tf, ',.0f')} | {_fmt(tu, ',.0f')} | {_fmt(ratio, '.3f')} | "
                f"{_fmt(_over_graphs_off(results, 'fork', engine, impl), '.3f')} | "
                f"{_fmt(_over_graphs_off(results, 'upstream', engine, impl), '.3f')} | "
                f"{_fmt(fork.get('peak_gib'), '.2f')} | {_fmt(up.get('peak_gib'), '.2f')} | "
                f"{'-' if replays is None else replays} | "
                f"{_fmt(_loss_at(fork, step), '.4f')} | {_fmt(_loss_at(up, step), '.4f')} | "
                f"{'; '.join(notes).replace('|', '/')} |")
    return "\n".join(rows)


def _precision(args) -> str:
    if args.cpu_smoke:
        return "bf16 (smoke: no FP8)"
    if not args.fp8:
        return "TE spec, bf16"
    return f"TE spec, bf16, FP8 hybrid delayed{', fp8_param' if args.fp8_param else ' (no fp8_param)'}"


def parent(args) -> int:
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("upstream_recipe_gpu.py: needs a CUDA GPU (and Transformer Engine); --cpu-smoke runs the plumbing on "
              "CPU", file=sys.stderr)
        return 2
    site = args.upstream_site or os.environ.get("MCORE_UPSTREAM_SITE")
    if not site:
        try:
            sys.path.insert(0, str(REPO))
            from tests.unit_tests.interop.upstream_env import ensure_upstream

            site = str(ensure_upstream())
        except Exception as e:  # no package index (the GPU machine): the upstream column says so
            site = None
            print(f"upstream megatron-core not found (set MCORE_UPSTREAM_SITE): {e}", file=sys.stderr)
    if site and not (Path(site) / "megatron" / "core").is_dir():
        print(f"MCORE_UPSTREAM_SITE={site} holds no megatron/core", file=sys.stderr)
        site = None
    device = "CPU (smoke)" if args.cpu_smoke else torch.cuda.get_device_name(0)
    tokens = args.gbs * args.seq
    print(f"# upstream recipe, {device}, torch {torch.__version__}; model: {args.layers} layers, hidden "
          f"{args.hidden}, {args.heads} heads, seq {args.seq}, vocab {args.padded_vocab}, micro-batch {args.mbs}, "
          f"global batch {args.gbs} ({tokens} tokens/step); "
          f"{_precision(args)}; CUDA graphs: {', '.join(args.impls)}"
          f"{' (modules ' + ' '.join(args.cuda_graph_modules) + ')' if args.cuda_graph_modules else ''}"
          f"{f', {args.cuda_graph_warmup_steps} eager warm-up steps' if args.impls != ['none'] else ''}; "
          f"{args.warmup} warm-up + {args.steps} timed steps")
    print(f"# fork: {REPO}; upstream: {site or 'not available'}", flush=True)
    deadline = time.time() + args.time_limit
    runs = [(p, e, i) for e in args.engines for i in args.impls for p in ("fork", "upstream")]
    results = {}
    workdir = Path(tempfile.mkdtemp(prefix="upstream_recipe_gpu_", dir=args.workdir))
    runnable = [r for r in runs if (r[0] == "fork" or site) and not (args.cpu_smoke and r[2] != "none")]
    for package, engine, impl in runs:
        key = (package, engine, impl)
        if package == "upstream" and not site:
            results[key] = {"error": "upstream not available (MCORE_UPSTREAM_SITE)"}
            continue
        if args.cpu_smoke and impl != "none":
            results[key] = {"error": "skipped: CUDA graphs need a GPU (--cpu-smoke)"}
            continue
        left = deadline - time.time()
        if left < 15:
            results[key] = {"error": "skipped: --time-limit reached"}
            continue
        # no run may take the whole rest unless it is the last one: keep a share for the others
        remaining = len(runnable) - runnable.index(key)
        timeout = left if remaining == 1 else max(left / remaining * 1.6, min(left, 60))
        root = REPO if package == "fork" else Path(site)
        res = run_one(args, package, engine, impl, root, min(timeout, left), workdir)
        results[key] = res
        state = res.get("error") or (f"{res['tokens_per_s']:,.0f} tokens/s, peak {res['peak_gib']:.2f} GiB, "
                                     f"{res['wall_s']:.0f} s (megatron {res.get('version')})"
                                     + (f", graphs {res['cuda_graphs']}" if res.get("cuda_graphs") else ""))
        print(f"# {package} {engine} graphs={impl}: {state}", flush=True)
    print()
    print(table(args, results))
    print(f"\n(logs: {workdir})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{p}/{e}/{i}": r for (p, e, i), r in results.items()}, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default=None,
                    help=f"comma-separated, of {', '.join(ENGINES)} (default all, in that order; with CUDA graphs: "
                         "ddp,dist_opt, the engines the fork graphs)")
    ap.add_argument("--cuda-graph-impl", default="none",
                    help=f"comma-separated, of {', '.join(GRAPH_IMPLS)}: a row per engine and value (default none)")
    ap.add_argument("--cuda-graph-modules", nargs="*", default=None,
                    help="upstream's --cuda-graph-modules (attn mlp ...); none given: the whole layer")
    ap.add_argument("--cuda-graph-warmup-steps", type=int, default=3, help="eager steps before the capture")
    ap.add_argument("--no-fp8", dest="fp8", action="store_false", help="bf16 without FP8 (local graphs on the fork)")
    ap.add_argument("--no-fp8-param", dest="fp8_param", action="store_false", default=None,
                    help="FP8 without FP8 weights (the default when --cuda-graph-impl has a graph row)")
    ap.add_argument("--fp8-param", dest="fp8_param", action="store_true", default=None,
                    help="FP8 weights (fp8_param, fp8-param-gather; the default without graph rows)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000, help="token ids drawn from [0, vocab)")
    ap.add_argument("--padded-vocab", type=int, default=32768, help="the model's vocabulary (embedding rows)")
    ap.add_argument("--mbs", type=int, default=2, help="micro-batch size")
    ap.add_argument("--gbs", type=int, default=8, help="global batch size (micro-batches per step: gbs / mbs)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds for all runs together (default 75 per (engine, graphs) pair, at least 220, at most "
                         "560); runs that do not fit are skipped")
    ap.add_argument("--upstream-site", help="directory holding upstream's megatron/ (default: $MCORE_UPSTREAM_SITE)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--workdir", help="where the per-run logs go (a new directory inside; default: the temp dir)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny model, local layers, bf16 without FP8, on CPU (gloo): checks the plumbing only")
    # the child's own arguments
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--package", choices=("fork", "upstream"), help=argparse.SUPPRESS)
    ap.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=GRAPH_IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--expect-root", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.impls = [i.strip() for i in args.cuda_graph_impl.split(",") if i.strip()]
    graphs = any(i != "none" for i in args.impls)
    if args.fp8_param is None:
        args.fp8_param = not graphs  # the fork refuses fp8_param with graphs: every row then runs without
    args.fp8_param = args.fp8_param and args.fp8
    if args.child:
        child(args)
        return 0
    bad = [i for i in args.impls if i not in GRAPH_IMPLS]
    if bad or not args.impls:
        ap.error(f"--cuda-graph-impl: unknown {bad}; choose from {list(GRAPH_IMPLS)}")
    if args.engines is None:
        args.engines = "ddp,dist_opt" if graphs else ",".join(ENGINES)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in args.engines if e not in ENGINES]
    if bad:
        ap.error(f"--engines: unknown {bad}; choose from {list(ENGINES)}")
    if args.gbs % args.mbs:
        ap.error(f"--gbs {args.gbs} is not a multiple of --mbs {args.mbs}")
    if args.cpu_smoke and "--layers" not in (argv or sys.argv):
        args.layers, args.hidden, args.heads, args.seq = 2, 64, 4, 32
        args.vocab, args.padded_vocab, args.mbs, args.gbs = 64, 128, 2, 4
        args.warmup, args.steps = min(args.warmup, 2), min(args.steps, 3)
    if args.time_limit is None:
        args.time_limit = min(560.0, max(220.0, 75.0 * len(args.engines) * len(args.impls)))
    if graphs and not args.cpu_smoke and args.warmup <= args.cuda_graph_warmup_steps:
        ap.error(f"--warmup {args.warmup} must exceed --cuda-graph-warmup-steps {args.cuda_graph_warmup_steps} (the "
                 "capture would be timed)")
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
