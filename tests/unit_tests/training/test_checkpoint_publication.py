"""No checkpoint is replaced or orphaned silently and no non-finite state is published (issue 28, items 1-3), for
real on CPU with 2 ranks: --finetune / a fresh run / --ckpt-step saving into a directory with later checkpoints is
refused before training (--ckpt-overwrite allows it), a --load without a tracker but with checkpoints is refused
(--ckpt-fresh-start allows it), and a save whose weights or optimizer state hold NaN is kept aside while the tracker
stays."""
import os
import re

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_checkpoint_safety import TINY, TRACKER, _run, _tracker


def _iter_dirs(d):
    return sorted(n for n in os.listdir(d) if n.startswith("iter_"))


def _listing_and_mtimes(d):
    return {n: os.stat(os.path.join(d, n, ".metadata")).st_mtime_ns for n in _iter_dirs(d)}


def _pretrain_4(ckpt):
    _run(TINY + ["--train-iters", 4, "--save", ckpt, "--save-interval", 2])
    assert _tracker(ckpt) == "4" and _iter_dirs(ckpt) == ["iter_0000002", "iter_0000004"]


# ---- item 1: saves never replace a checkpoint nor move the tracker back --------------------------------------
def _overwrite_body(rank, world_size, ckpt):
    from megatron.training.checkpointing import CheckpointError

    _pretrain_4(ckpt)
    before = _listing_and_mtimes(ckpt)
    steps = []
    record = lambda i, m, l: steps.append(i)  # noqa: E731
    expected = (r"--save {d}: this run starts at iteration 0 \({why}\) and its saves would replace or orphan "
                r"iter_0000002, iter_0000004 and move its tracker back from iteration 4; use another --save, resume "
                r"from its latest checkpoint \(--load {d} without --finetune/--ckpt-step\), or pass --ckpt-overwrite")
    with pytest.raises(CheckpointError, match=expected.format(d=re.escape(ckpt), why="--finetune")):
        _run(TINY + ["--train-iters", 4, "--save", ckpt, "--save-interval", 2, "--load", ckpt, "--finetune"],
             on_iteration_end=record)
    with pytest.raises(CheckpointError, match=expected.format(d=re.escape(ckpt), why="from scratch")):
        _run(TINY + ["--train-iters", 2, "--save", ckpt], on_iteration_end=record)
    with pytest.raises(CheckpointError, match=r"this run starts at iteration 2 \(--ckpt-step 2\) and its saves would "
                                              r"replace or orphan iter_0000004 and move its tracker back from "
                                              r"iteration 4;"):
        _run(TINY + ["--train-iters", 4, "--save", ckpt, "--save-interval", 2, "--load", ckpt, "--ckpt-step", 2],
             on_iteration_end=record)
    assert steps == []  # refused before any step, on every rank
    dist.barrier()
    assert _listing_and_mtimes(ckpt) == before and _tracker(ckpt) == "4"  # nothing touched

    # a plain resume continues after the latest: allowed
    res = _run(TINY + ["--train-iters", 6, "--save", ckpt, "--save-interval", 2, "--load", ckpt])
    assert sorted(res.losses) == [5, 6] and _tracker(ckpt) == "6"
    # the user says so: --ckpt-overwrite replaces and moves the tracker back
    res = _run(TINY + ["--train-iters", 2, "--save", ckpt, "--save-interval", 2, "--load", ckpt, "--finetune",
                       "--ckpt-overwrite"])
    assert sorted(res.losses) == [1, 2] and _tracker(ckpt) == "2"
    dist.barrier()
    after = _listing_and_mtimes(ckpt)
    assert after["iter_0000002"] > before["iter_0000002"] and after["iter_0000004"] == before["iter_0000004"]


def test_saves_never_replace_or_move_the_tracker_back(tmp_path):
    run_distributed(_overwrite_body, 2, str(tmp_path / "c"))


def _save_guard_body(rank, world_size, ckpt):
    """save_checkpoint itself (an API caller, no start-up check) refuses to replace iter_N."""
    from megatron.training import checkpointing
    from megatron.training.checkpointing import CheckpointError, save_checkpoint

    res = _run(TINY + ["--train-iters", 2, "--save", ckpt, "--save-interval", 2])
    with pytest.raises(CheckpointError, match=r"--save \S+: saving iteration 2 would replace or orphan iter_0000002;"):
        save_checkpoint(2, res.model, res.optimizer, res.opt_param_scheduler)
    with pytest.raises(CheckpointError, match=r"saving iteration 1 would replace or orphan iter_0000002 and move its "
                                              r"tracker back from iteration 2;"):
        save_checkpoint(1, res.model, res.optimizer, res.opt_param_scheduler)
    assert _iter_dirs(ckpt) == ["iter_0000002"] and _tracker(ckpt) == "2"
    assert checkpointing.get_args().ckpt_overwrite is False


def test_save_checkpoint_refuses_to_replace(tmp_path):
    run_distributed(_save_guard_body, 2, str(tmp_path / "c"))


# ---- item 2: a lost tracker does not mean training from scratch ----------------------------------------------
def _lost_tracker_body(rank, world_size, ckpt):
    from megatron.training.checkpointing import CheckpointError

    _pretrain_4(ckpt)
    dist.barrier()
    if rank == 0:
        os.unlink(os.path.join(ckpt, TRACKER))
    dist.barrier()
    with pytest.raises(CheckpointError, match=r"--load {d} has no tracker {t} but holds iter_0000002, iter_0000004: "
                                              r"resume from the latest with --ckpt-step 4, or pass --ckpt-fresh-start "
                                              r"to train from random initialization".format(d=re.escape(ckpt),
                                                                                             t=TRACKER)):
        _run(TINY + ["--train-iters", 6, "--load", ckpt, "--save", ckpt, "--save-interval", 2])
    res = _run(TINY + ["--train-iters", 6, "--load", ckpt, "--ckpt-step", 4, "--save", ckpt, "--save-interval", 2])
    assert sorted(res.losses) == [5, 6] and _tracker(ckpt) == "6"
    dist.barrier()
    if rank == 0:
        os.unlink(os.path.join(ckpt, TRACKER))
    dist.barrier()
    res = _run(TINY + ["--train-iters", 1, "--load", ckpt, "--ckpt-fresh-start"])  # asked for: from scratch
    assert sorted(res.losses) == [1]
    # a fresh start saving into that directory still may not replace its checkpoints
    with pytest.raises(CheckpointError, match=r"this run starts at iteration 0 \(from scratch\) and its saves would "
                                              r"replace or orphan iter_0000002, iter_0000004, iter_0000006;"):
        _run(TINY + ["--train-iters", 1, "--load", ckpt, "--ckpt-fresh-start", "--save", ckpt])


def test_lost_tracker_refuses_to_start_from_scratch(tmp_path):
    run_distributed(_lost_tracker_body, 2, str(tmp_path / "c"))


# ---- item 3: a non-finite state is never published -------------------------------------------------------------
def _capture_optimizer(box):
    import megatron.core.optimizer as optimizer_module

    real = optimizer_module.get_megatron_optimizer

    def capture(*args, **kwargs):
        box.append(real(*args, **kwargs))
        return box[-1]

    optimizer_module.get_megatron_optimizer = capture
    return lambda: setattr(optimizer_module, "get_megatron_optimizer", real)


def _poison_exp_avg_sq(optimizer):
    torch_optimizer = optimizer.optimizer
    param = torch_optimizer.param_groups[0]["params"][0]
    with torch.no_grad():
        torch_optimizer.state[param]["exp_avg_sq"].view(-1)[0] = float("nan")


def _non_finite_body(rank, world_size, root, async_save):
    from megatron.training.checkpointing import CheckpointError

    extra = ["--async-save"] if async_save else []
    box = []
    restore = _capture_optimizer(box)
    try:
        # NaN in one exp_avg_sq entry after iteration 3 (rank 1 only): iteration 4's update writes NaN into weights
        ckpt = os.path.join(root, "weights")
        poison = lambda i, m, l: _poison_exp_avg_sq(box[-1]) if i == 3 and rank == 1 else None  # noqa: E731
        with pytest.raises(CheckpointError) as e:
            _run(TINY + ["--train-iters", 6, "--save", ckpt, "--save-interval", 2] + extra, on_iteration_end=poison)
        assert re.fullmatch(r"checkpoint of iteration 4 not published: tensor embedding\.word_embeddings\.weight \(rank 1\) "
                            r"holds NaN or Inf; written aside to {d}/iter_0000004\.nonfinite; {d}/{t} still names "
                            r"iteration 2".format(d=re.escape(ckpt), t=TRACKER), str(e.value)), str(e.value)
        dist.barrier()
        assert _tracker(ckpt) == "2" and _iter_dirs(ckpt) == ["iter_0000002", "iter_0000004.nonfinite"]
        # NaN only in the optimizer state (weights still finite) at the save itself: named, not published
        ckpt = os.path.join(root, "optim")
        poison = lambda i, m, l: _poison_exp_avg_sq(box[-1]) if i == 2 and rank == 0 else None  # noqa: E731
        with pytest.raises(CheckpointError, match=r"checkpoint of iteration 2 not published: tensor "
                                                  r"optimizer\.\S*exp_avg_sq\S* \(rank 0\) holds NaN or Inf; .* still "
                                                  r"names no checkpoint"):
            _run(TINY + ["--train-iters", 4, "--save", ckpt, "--save-interval", 2] + extra, on_iteration_end=poison)
        dist.barrier()
        assert not os.path.exists(os.path.join(ckpt, TRACKER))
        assert _iter_dirs(ckpt) == ["iter_0000002.nonfinite"]
    finally:
        restore()


@pytest.mark.parametrize("async_save", [False, True])
def test_non_finite_state_is_set_aside(tmp_path, async_save):
    run_distributed(_non_finite_body, 2, str(tmp_path), async_save)


# ---- the flags ---------------------------------------------------------------------------------------------------
def test_flags_parse_and_bad_values_are_named(capsys, monkeypatch):
    from tests.unit_tests.training.test_arguments import BASE, _args

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    a = _args()
    assert (a.ckpt_verify, a.ckpt_overwrite, a.ckpt_fresh_start) == ("auto", False, False)  # upstream behaviour
    a = _args("--ckpt-verify", "require", "--ckpt-overwrite", "--save", "/tmp/x", "--load", "/tmp/x",
              "--ckpt-fresh-start")
    assert (a.ckpt_verify, a.ckpt_overwrite, a.ckpt_fresh_start) == ("require", True, True)
    with pytest.raises(SystemExit) as e:
        _args("--ckpt-fresh-start")
    assert str(e.value).startswith("megatron argument error: --ckpt-fresh-start needs --load <dir>")
    from megatron.training.arguments import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(args=BASE + ["--ckpt-verify", "always"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ckpt-verify" in err[0] and "always" in err[0], err


def _nan_check_off_body(rank, world_size, ckpt):
    """--no-check-for-nan-in-loss-and-grad goes on through non-finite values on purpose: published, with a warning."""
    box = []
    restore = _capture_optimizer(box)
    printed = []
    import builtins

    real_print = builtins.print
    builtins.print = lambda *a, **k: (printed.append(" ".join(map(str, a))), real_print(*a, **k))
    try:
        poison = lambda i, m, l: _poison_exp_avg_sq(box[-1]) if i == 1 else None  # noqa: E731
        _run(TINY + ["--train-iters", 2, "--save", ckpt, "--save-interval", 2, "--no-check-for-nan-in-loss-and-grad"],
             on_iteration_end=poison)
    finally:
        builtins.print = real_print
        restore()
    assert _tracker(ckpt) == "2"
    warned = [p for p in printed if "holds NaN or Inf; publishing it anyway" in p]
    assert len(warned) == (1 if rank == 0 else 0), printed[-5:]
    assert warned == [] or re.fullmatch(r"WARNING: checkpoint tensor \S+ \(rank 0\) holds NaN or Inf; publishing it "
                                        r"anyway \(--no-check-for-nan-in-loss-and-grad\)", warned[0]), warned


def test_non_finite_published_only_when_nan_checks_are_off(tmp_path):
    run_distributed(_nan_check_off_body, 2, str(tmp_path / "c"))
