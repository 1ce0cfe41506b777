"""End to end on CPU (gloo): train, save, resume (bitwise in fp32), resume with another data-parallel size,
MoE expert bias with meta init + Megatron-FSDP, tracker safety on a failed save, checkpoint errors, the CLI."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.dist_utils import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# Tiny GPT; dropout on, so a resume is only bitwise equal if the RNG state is restored too.
TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--vocab-size 64 --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
        "--lr-warmup-iters 2 --lr-decay-iters 12 --weight-decay 0.01 --clip-grad 1.0 --seed 11 --mock-data --log-interval 3 "
        "--eval-iters 0 --distributed-backend gloo --transformer-impl local "
        "--hidden-dropout 0.1 --attention-dropout 0.1").split()
NO_DROPOUT = ["--hidden-dropout", 0, "--attention-dropout", 0]


def _run(argv, on_iteration_end=None):
    import pretrain_gpt
    from megatron.training.training import pretrain

    return pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider, None,
                    pretrain_gpt.forward_step, args=[str(a) for a in argv], on_iteration_end=on_iteration_end)


def _tracker(d):
    with open(os.path.join(d, "latest_checkpointed_iteration.txt")) as f:
        return f.read().strip()


def _same_on_all_ranks(values):
    t = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    assert all(torch.equal(o, t) for o in out), "ranks disagree"


# ---- resume: bitwise, and with a different data-parallel size ---------------------------------------------
def _resume_body(rank, world_size, ckpt, out_dir):
    n, total = 6, 12
    args = TINY + ["--train-iters", total]
    full = _run(args)
    assert sorted(full.losses) == list(range(1, total + 1))
    first = _run(args + ["--save", ckpt, "--save-interval", 3, "--exit-interval", n, "--ckpt-fully-parallel-save"])
    assert sorted(first.losses) == list(range(1, n + 1))
    assert _tracker(ckpt) == str(n)
    assert os.path.isdir(os.path.join(ckpt, "iter_0000003")) and os.path.isdir(os.path.join(ckpt, "iter_0000006"))
    second = _run(args + ["--save", ckpt, "--load", ckpt, "--save-interval", 100, "--ckpt-fully-parallel-load"])
    assert sorted(second.losses) == list(range(n + 1, total + 1))
    assert _tracker(ckpt) == str(total)
    curve = [full.losses[i] for i in range(1, total + 1)]
    resumed = [first.losses[i] for i in range(1, n + 1)] + [second.losses[i] for i in range(n + 1, total + 1)]
    assert resumed == curve, f"resumed {resumed}\nfull    {curve}"  # bitwise (python floats of fp32 values)
    lrs = [first.learning_rates[i] for i in range(1, n + 1)] + [second.learning_rates[i] for i in range(n + 1, total + 1)]
    assert lrs == [full.learning_rates[i] for i in range(1, total + 1)]
    assert max(lrs) == pytest.approx(3e-3) and lrs[-1] == pytest.approx(3e-4)  # warmup to --lr, cosine to --min-lr
    grad_norms = [first.grad_norms[i] for i in range(1, n + 1)] + [second.grad_norms[i] for i in range(n + 1, total + 1)]
    assert grad_norms == [full.grad_norms[i] for i in range(1, total + 1)]
    assert len(set(curve)) == total and curve[-1] < curve[0]  # it trains
    _same_on_all_ranks(curve)
    # Reference for the resumes with other DP sizes: without dropout (its masks depend on how samples are spread
    # over ranks), continue from iteration 6 with 2 ranks.
    ref = _run(args + NO_DROPOUT + ["--load", ckpt, "--ckpt-step", n])
    assert sorted(ref.losses) == list(range(n + 1, total + 1))
    if rank == 0:
        np.save(os.path.join(out_dir, "ref.npy"), np.asarray([ref.losses[i] for i in range(n + 1, total + 1)]))


def _resume_other_dp_body(rank, world_size, ckpt, out_dir):
    res = _run(TINY + NO_DROPOUT + ["--train-iters", 12, "--load", ckpt, "--ckpt-step", 6])
    assert sorted(res.losses) == list(range(7, 13))
    curve = [res.losses[i] for i in range(7, 13)]
    _same_on_all_ranks(curve)
    if rank == 0:
        np.save(os.path.join(out_dir, f"dp{world_size}.npy"), np.asarray(curve, dtype=np.float64))


def test_resume_bitwise_and_with_other_dp_sizes(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_resume_body, 2, ckpt, str(tmp_path))
    ref = np.load(tmp_path / "ref.npy")
    for world in (1, 4):
        run_distributed(_resume_other_dp_body, world, ckpt, str(tmp_path))
        got = np.load(tmp_path / f"dp{world}.npy")
        # Same global batches in the same order: equal up to reduction-order rounding only.
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=0)
    assert _tracker(ckpt) == "12"  # resuming without --save wrote nothing


# ---- MoE + expert bias + meta-device init + Megatron-FSDP ----------------------------------------------------
MOE = ["--num-experts", 4, "--moe-router-topk", 2, "--moe-router-enable-expert-bias",
       "--moe-router-bias-update-rate", 0.01, "--moe-ffn-hidden-size", 32, "--use-megatron-fsdp",
       "--init-model-with-meta-device", "--train-iters", 4, "--log-interval", 1]


def _moe_body(rank, world_size, ckpt):
    from megatron.core.transformer.moe.router import TopKRouter

    history = []

    def record(iteration, model, loss):
        routers = [m for m in model[0].modules() if isinstance(m, TopKRouter)]
        assert routers, "no MoE router in the model"
        history.append(torch.stack([r.expert_bias.detach().clone().cpu() for r in routers]))

    res = _run(TINY + MOE + ["--save", ckpt, "--save-interval", 2], on_iteration_end=record)
    losses = [res.losses[i] for i in range(1, 5)]
    assert all(np.isfinite(losses)), losses
    assert len(history) == 4
    for h in history:
        assert torch.isfinite(h).all(), h
        # sign updates: every entry is a multiple of the rate, bounded by iterations x rate
    assert history[0].abs().max() > 0, "expert_bias did not move after the first step"
    assert not torch.equal(history[0], history[-1]), "expert_bias did not change over steps"
    assert history[-1].abs().max() <= 4 * 0.01 + 1e-6
    final_bias = history[-1].clone()
    _same_on_all_ranks(history[-1].flatten().tolist())
    _same_on_all_ranks(losses)
    assert _tracker(ckpt) == "4"
    # Resume from iteration 2 (FSDP sharded checkpoint, meta init again): bitwise the same iterations 3 and 4,
    # expert_bias included (it is a persistent buffer in the checkpoint).
    history.clear()
    res2 = _run(TINY + MOE + ["--load", ckpt, "--ckpt-step", 2], on_iteration_end=record)
    assert sorted(res2.losses) == [3, 4]
    assert [res2.losses[3], res2.losses[4]] == losses[2:], (res2.losses, losses)
    assert torch.equal(history[-1], final_bias)


def test_moe_expert_bias_meta_init_fsdp(tmp_path):
    run_distributed(_moe_body, 2, str(tmp_path / "moe"))


# ---- a save that fails midway does not advance the tracker --------------------------------------------------
def _failed_save_body(rank, world_size, ckpt):
    from megatron.training import checkpointing
    from megatron.training.checkpointing import CheckpointError

    base = TINY + ["--save", ckpt, "--save-interval", 2]
    _run(base + ["--train-iters", 2])
    assert _tracker(ckpt) == "2"
    real_save = checkpointing.dist_checkpointing.save

    def failing_save(state_dict, checkpoint_dir, **kw):
        real_save(state_dict, checkpoint_dir, **kw)  # the data is written ...
        if rank == world_size - 1:
            raise OSError("simulated failure after writing (disk full)")  # ... but one rank fails to finish

    checkpointing.dist_checkpointing.save = failing_save
    try:
        with pytest.raises(CheckpointError, match="iter_0000004.*was not advanced"):
            _run(base + ["--train-iters", 4, "--load", ckpt])
    finally:
        checkpointing.dist_checkpointing.save = real_save
    assert _tracker(ckpt) == "2"
    assert not [f for f in os.listdir(ckpt) if f.startswith("latest_checkpointed_iteration.txt.tmp")]
    res = _run(base + ["--train-iters", 3, "--load", ckpt, "--save-interval", 100])
    assert sorted(res.losses) == [3]  # resumed from iteration 2
    assert _tracker(ckpt) == "3"


def test_tracker_not_advanced_on_failed_save(tmp_path):
    run_distributed(_failed_save_body, 2, str(tmp_path / "fail"))


# ---- checkpoint errors name the file / directory ------------------------------------------------------------
def _errors_body(rank, world_size, tmp):
    from megatron.training.checkpointing import CheckpointError

    empty = os.path.join(tmp, "empty")
    os.makedirs(empty, exist_ok=True)
    res = _run(TINY + ["--train-iters", 1, "--load", empty])  # no checkpoint: start from scratch
    assert sorted(res.losses) == [1]
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt"):
        _run(TINY + ["--train-iters", 1, "--load", empty, "--exit-on-missing-checkpoint"])
    broken = os.path.join(tmp, "broken")
    os.makedirs(broken, exist_ok=True)
    with open(os.path.join(broken, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("7")
    with pytest.raises(CheckpointError, match="iter_0000007.*does not exist"):
        _run(TINY + ["--train-iters", 1, "--load", broken])
    with open(os.path.join(broken, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("seven")
    with pytest.raises(CheckpointError, match="expected an iteration"):
        _run(TINY + ["--train-iters", 1, "--load", broken])


def test_checkpoint_errors(tmp_path):
    run_distributed(_errors_body, 1, str(tmp_path))


# ---- --finetune / --no-load-optim, and an indexed dataset from --data-path ---------------------------------------
def _finetune_body(rank, world_size, tmp):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = os.path.join(tmp, "corpus")
    if rank == 0:
        rng = np.random.default_rng(0)
        b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for _ in range(40):
            b.add_item(rng.integers(0, 64, size=int(rng.integers(5, 40))))
            b.end_document()
        b.finalize(prefix + ".idx")
    dist.barrier()
    data = [a for a in TINY if a != "--mock-data"] + ["--data-path", prefix, "--split", "8,2,0"]
    ckpt = os.path.join(tmp, "ft")
    base = _run(data + ["--train-iters", 3, "--save", ckpt, "--eval-iters", 1, "--eval-interval", 3])
    assert sorted(base.losses) == [1, 2, 3] and 3 in base.valid_losses and np.isfinite(base.valid_losses[3])
    ft = _run(data + ["--train-iters", 2, "--load", ckpt, "--finetune"])
    assert sorted(ft.losses) == [1, 2]  # iteration restarts at 0, model weights from the checkpoint
    fresh = _run(data + ["--train-iters", 2])
    assert ft.losses[1] != fresh.losses[1]
    assert ft.losses[1] < fresh.losses[1] + 0.5
    no_optim = _run(data + ["--train-iters", 4, "--load", ckpt, "--no-load-optim"])
    assert sorted(no_optim.losses) == [4]


def test_finetune_no_load_optim_indexed_data(tmp_path):
    run_distributed(_finetune_body, 2, str(tmp_path))


# ---- the command line: python (1 process) and torchrun (2 processes) -------------------------------------------
def _cli_env():
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_cli_single_process_and_torchrun(tmp_path):
    ckpt = str(tmp_path / "cli")
    argv = [str(a) for a in TINY + ["--train-iters", 2, "--log-interval", 1, "--save", ckpt]]
    out = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py")] + argv, env=_cli_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [l for l in out.stdout.splitlines() if "lm loss:" in l]
    assert len(lines) == 2 and "iteration        2/       2" in lines[1]
    for field in ("learning rate:", "tokens/s:", "mem RSS (MiB):", "consumed samples:"):
        assert field in lines[1], lines[1]

    def value(line, name):
        return float(line.split(name)[1].split("|")[0])

    assert value(lines[1], "consumed samples:") == 16
    assert 50 < value(lines[1], "mem RSS (MiB):") < 20000  # a real RSS figure of a torch process
    assert value(lines[1], "tokens/s:") > 0
    assert np.isfinite(value(lines[1], "lm loss:")) and 0 < value(lines[1], "lm loss:") < 10
    assert _tracker(ckpt) == "2"
    argv = [str(a) for a in TINY + ["--train-iters", 3, "--log-interval", 1, "--load", ckpt]]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--standalone", os.path.join(REPO, "pretrain_gpt.py")] + argv, env=_cli_env(),
                         cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [l for l in out.stdout.splitlines() if "lm loss:" in l]
    assert len(lines) == 1 and "iteration        3/       3" in lines[0], out.stdout[-2000:]


# ---- strategies chosen from the flags ------------------------------------------------------------------------
def _strategy_body(rank, world_size):
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from megatron.training.checkpointing import _load_strategy, _save_strategy
    from megatron.training.initialize import initialize_megatron

    args = initialize_megatron(args=[str(a) for a in TINY + ["--train-iters", 1, "--stream-ckpt-dequant",
                                                             "--ckpt-fully-parallel-load", "--ckpt-fully-parallel-save"]])
    load = _load_strategy(args)
    assert isinstance(load, FullyParallelLoadStrategyWrapper)
    inner = load.base_strategy
    assert isinstance(inner, TorchDistLoadShardedStrategy) and inner.stream_ckpt_dequant is True
    assert isinstance(_save_strategy(args), FullyParallelSaveStrategyWrapper)
    args.stream_ckpt_dequant = args.ckpt_fully_parallel_load = args.ckpt_fully_parallel_save = False
    load = _load_strategy(args)
    assert isinstance(load, TorchDistLoadShardedStrategy) and load.stream_ckpt_dequant is False
    assert not isinstance(_save_strategy(args), FullyParallelSaveStrategyWrapper)


def test_load_and_save_strategies_from_flags():
    run_distributed(_strategy_body, 2)
