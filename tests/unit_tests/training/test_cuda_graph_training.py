"""CUDA graphs in the training loop: upstream 0.19's flags (``--cuda-graph-impl``, ``--cuda-graph-modules`` and its
deprecated alias ``--cuda-graph-scope``, ``--cuda-graph-warmup-steps``, the deprecated ``--enable-cuda-graph`` /
``--external-cuda-graph``) reach the config; the refusals name the flags; on CPU ``pretrain_gpt.py --cuda-graph-impl
local`` stops with a clear error. GPU (``@pytest.mark.gpu``): ``pretrain_gpt.py --cuda-graph-impl local
--cuda-graph-scope attn mlp`` (torchrun, one GPU) trains with the graphs replayed and the ungraphed run's losses,
with DDP and with the distributed optimizer, two micro-batches per step.

This file is also the per-process entry point of the GPU test (``python -m torch.distributed.run ...
test_cuda_graph_training.py OUT ARGS...``): it runs ``pretrain`` and writes the losses and graphed regions to OUT."""
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _main(out_path, argv):
    sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron.training import training

    res = training.pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider, None,
                            pretrain_gpt.forward_step, args=argv)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"losses": dict(res.losses), "regions": list(res.cuda_graph_regions),
                    "replays": res.cuda_graph_replays}, out_path)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2:])


from tests.unit_tests.dist_utils import run_distributed  # noqa: E402
from tests.unit_tests.training.test_training import NO_DROPOUT, TINY, _run  # noqa: E402


def _args(extra):
    from megatron.training.arguments import parse_args, validate_args

    return validate_args(parse_args(args=[str(a) for a in TINY + NO_DROPOUT + ["--train-iters", 1] + extra]))


def test_flags_reach_the_config():
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.core.transformer.enums import CudaGraphModule as M

    args = _args([])
    assert (args.cuda_graph_impl, args.cuda_graph_modules, args.cuda_graph_warmup_steps) == ("none", [], 3)
    args = _args(["--cuda-graph-impl", "local", "--cuda-graph-scope", "attn", "mlp", "--cuda-graph-warmup-steps", 2])
    cfg = core_transformer_config_from_args(args)
    assert (cfg.cuda_graph_impl, cfg.cuda_graph_modules, cfg.cuda_graph_warmup_steps) == ("local", [M.attn, M.mlp], 2)
    assert not hasattr(args, "cuda_graph_scope_deprecated")
    cfg = core_transformer_config_from_args(_args(["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules",
                                                   "full"]))
    assert (cfg.cuda_graph_impl, cfg.cuda_graph_modules) == ("transformer_engine", [])  # the whole layer
    assert _args(["--enable-cuda-graph"]).cuda_graph_impl == "local"
    assert _args(["--external-cuda-graph"]).cuda_graph_impl == "transformer_engine"
    moe = ["--num-experts", 4, "--disable-bias-linear", "--cuda-graph-impl", "local", "--cuda-graph-modules", "attn",
           "moe_router"]
    assert core_transformer_config_from_args(_args(moe)).cuda_graph_modules == [M.attn, M.moe_router]
    pad = ["--num-experts", 4, "--disable-bias-linear", "--moe-expert-capacity-factor", 1.0,
           "--moe-pad-expert-input-to-capacity", "--cuda-graph-impl", "local"]
    cfg = core_transformer_config_from_args(_args(pad + ["--cuda-graph-modules", "attn", "moe"]))
    assert cfg.cuda_graph_modules == [M.attn, M.moe] and cfg.moe_pad_expert_input_to_capacity
    assert core_transformer_config_from_args(_args(pad)).cuda_graph_modules == []  # the whole (MoE) layer


@pytest.mark.parametrize("extra, message", [
    (["--cuda-graph-impl", "full_iteration"], "--cuda-graph-impl full_iteration (one graph for the whole"),
    (["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "--cuda-graph-scope", "mlp"],
     "--cuda-graph-scope and --cuda-graph-modules cannot be used together"),
    (["--enable-cuda-graph", "--cuda-graph-impl", "local"], "do not use --enable-cuda-graph or --external-cuda-graph"),
    (["--enable-cuda-graph", "--external-cuda-graph"], "cannot be enabled at the same time"),
    (["--cuda-graph-impl", "local", "--use-megatron-fsdp"], "--use-megatron-fsdp with --cuda-graph-impl local"),
    (["--cuda-graph-impl", "local", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
     "--overlap-param-gather with --cuda-graph-impl local"),
    (["--cuda-graph-impl", "local", "--cuda-graph-modules", "moe"], "moe is only supported for MoE models"),
    (["--num-experts", 4, "--disable-bias-linear", "--cuda-graph-impl", "local", "--cuda-graph-modules", "attn",
      "moe"], "--cuda-graph-modules moe is only supported with drop-padding MoE (upstream's rule): give "
              "--moe-expert-capacity-factor and --moe-pad-expert-input-to-capacity"),
    (["--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", 0], "--cuda-graph-warmup-steps=0) must be >= 1"),
    (["--cuda-graph-impl", "local", "--cuda-graph-modules", "moe_router"], "moe_router is only supported for MoE"),
    (["--cuda-graph-impl", "local", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", 1], "--recompute-granularity full with --cuda-graph-impl local"),
], ids=lambda c: str(c)[:50])
def test_refusals_name_the_flags(extra, message):
    with pytest.raises(SystemExit) as exc:
        _args(extra)
    assert message in str(exc.value), str(exc.value)


def test_unknown_module_is_an_argparse_error(capsys):
    from megatron.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(args=["--cuda-graph-modules", "attention"])
    assert "--cuda-graph-modules: unknown module 'attention'" in capsys.readouterr().err


def _cpu_body(rank, world_size):
    with pytest.raises(RuntimeError, match=r"--cuda-graph-impl local needs a CUDA device"):
        _run(TINY + NO_DROPOUT + ["--train-iters", 2, "--cuda-graph-impl", "local", "--cuda-graph-scope", "attn", "mlp"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cpu_run_stops_with_a_clear_error():
    run_distributed(_cpu_body, 1)


# ---- the training loop's schedule on CPU, with a stand-in capture ---------------------------------------------
def _stand_in_capture():
    """Run the helper without CUDA: ``make_graphed_callables`` replaced by a stand-in doing what torch's does around
    the capture (a warm-up forward and ``autograd.grad`` on the sample inputs) and handing back the region modules,
    which then run eagerly where the graphs would replay; returns the regions the stand-in was given."""
    from megatron.core.transformer import cuda_graphs

    given = []

    def make_graphed_callables(callables, sample_args, num_warmup_iters=3, allow_unused_input=False, pool=None):
        for c, args in zip(callables, sample_args):
            outs = [o for o in torch.utils._pytree.tree_flatten(c(*args))[0] if o.requires_grad]
            ins = [a for a in args if a.requires_grad] + [p for p in c.parameters() if p.requires_grad]
            torch.autograd.grad(outs, ins, [torch.ones_like(o) for o in outs], allow_unused=allow_unused_input)
            given.append((c, [tuple(a.shape) for a in args], num_warmup_iters))
        return callables

    torch.cuda.make_graphed_callables = make_graphed_callables
    torch.cuda.synchronize = lambda *a, **k: None
    cuda_graphs.require_cuda = lambda config: None
    return given


def _schedule_body(rank, world_size):
    base = TINY + NO_DROPOUT + ["--train-iters", 5, "--position-embedding-type", "rope"]
    for engine in ([], ["--use-distributed-optimizer"]):
        eager = _run(base + engine)
        given = _stand_in_capture()
        graphed = _run(base + engine + ["--cuda-graph-impl", "local", "--cuda-graph-scope", "attn", "mlp",
                                        "--cuda-graph-warmup-steps", 2])
        assert graphed.cuda_graph_regions == ["layer 1 attn", "layer 1 mlp", "layer 2 attn", "layer 2 mlp"]
        assert len(given) == 4 and all(shapes[0] == (16, 2, 32) for _, shapes, _ in given)  # [s, b, h]
        # the regions ran in place of the graphs from iteration 3 on (4 micro-batches a step): the same losses
        assert graphed.losses == eager.losses, (graphed.losses, eager.losses)
        assert graphed.cuda_graph_replays == 4 * 4 * 3  # regions x micro-batches x iterations 3-5
        # the graphs are dropped at the end of training (evaluation after it runs eagerly)
        assert not any(getattr(m, "cuda_graphs", None) for m in graphed.model[0].modules())


def _moe_schedule_body(rank, world_size):
    base = TINY + NO_DROPOUT + ["--train-iters", 4, "--position-embedding-type", "rope", "--num-experts", 4,
                                "--disable-bias-linear", "--moe-expert-capacity-factor", 1.0,
                                "--moe-pad-expert-input-to-capacity"]
    eager = _run(base)
    given = _stand_in_capture()
    graphed = _run(base + ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe",
                           "--cuda-graph-warmup-steps", 2])
    assert graphed.cuda_graph_regions == ["layer 1 attn", "layer 1 moe", "layer 2 attn", "layer 2 moe"]
    assert len(given) == 4
    assert graphed.losses == eager.losses, (graphed.losses, eager.losses)
    assert graphed.cuda_graph_replays == 4 * 4 * 2  # regions x micro-batches x iterations 3-4


def test_training_loop_graphs_drop_and_pad_moe_layers():
    """``--cuda-graph-modules attn moe`` with drop-and-pad experts through the training loop: the whole MoE layers
    are regions, and the run (the stand-in's regions in place of the graphs) has the eager run's losses."""
    run_distributed(_moe_schedule_body, 1)


def test_training_loop_records_then_captures_then_replays():
    """Two eager warm-up iterations record every region's inputs (4 micro-batches each), the capture runs before the
    third, and iterations 3-5 replay (here: the stand-in's region modules); DDP and the distributed optimizer; the
    losses equal the run without graphs."""
    run_distributed(_schedule_body, 1)


# ---- GPU: pretrain_gpt.py with graphs --------------------------------------------------------------------------
ITERS = 8
GPU_BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --seq-length 64 "
            "--max-position-embeddings 64 --vocab-size 256 --micro-batch-size 2 --global-batch-size 4 "
            "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 "
            "--seed 1234 --mock-data --tokenizer-type NullTokenizer --log-interval 1 --eval-iters 0 "
            "--hidden-dropout 0 --attention-dropout 0 --transformer-impl local --attention-backend unfused "
            "--position-embedding-type rope").split()
GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "attn", "mlp", "--cuda-graph-warmup-steps", 2]


def _torchrun(out, argv, log):
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           os.path.abspath(__file__), str(out)] + [str(a) for a in argv]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    with open(log, "w") as f:
        f.write(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n--- output tail ---\n{(proc.stdout + proc.stderr)[-6000:]}"
    return torch.load(out, weights_only=False)  # our own record, written just now


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("engine", [[], ["--use-distributed-optimizer"]], ids=["ddp", "distopt"])
def test_pretrain_gpt_with_local_graphs_matches_eager(engine, tmp_path):
    args = GPU_BASE + engine + ["--train-iters", ITERS]
    eager = _torchrun(tmp_path / "eager.pt", args, tmp_path / "eager.log")
    graphed = _torchrun(tmp_path / "graphed.pt", args + GRAPHS, tmp_path / "graphed.log")
    assert eager["regions"] == []
    assert graphed["regions"] == ["layer 1 attn", "layer 1 mlp", "layer 2 attn", "layer 2 mlp"]
    assert graphed["replays"] == 4 * 2 * (ITERS - 2)  # regions x micro-batches x replayed iterations
    assert sorted(graphed["losses"]) == list(range(1, ITERS + 1))
    for i in range(1, ITERS + 1):  # iterations 3.. replay the graphs (two micro-batches each)
        a, b = graphed["losses"][i], eager["losses"][i]
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (i, graphed["losses"], eager["losses"])
    curve = [graphed["losses"][i] for i in range(1, ITERS + 1)]
    assert len(set(curve)) > 1 and all(x == x for x in curve)  # it trains, no NaN
