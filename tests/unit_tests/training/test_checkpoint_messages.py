"""Every failure is one clear line (issue 28, item 5): under torchrun (2 ranks) a full disk and a non-finite loss end
in one "error:" line from rank 0 with no writer-thread or per-rank traceback; --save on a path that cannot exist is
named with its own errno (ENOENT/ENOTDIR), not as a full disk; a save on 2 ranks no longer warns that rank 1's common
state differs (the per-rank ``rank``/``local_rank`` arguments); a model mismatch is one short line with a count."""
import errno
import logging
import os
import re
import subprocess
import sys
import threading

import pytest

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_checkpoint_safety import REPO, TINY, _env, _run, _with_layers

_INJECT = """
import errno, os, sys
sys.path.insert(0, {repo!r})
import torch
import torch.distributed.checkpoint.filesystem as fs
import pretrain_gpt
from megatron.training.utils import exit_on_user_error

if {mode!r} == "full_disk":  # every data file of the second save hits a full disk, in DCP's writer threads too
    real = fs._write_item

    def no_space(transforms, stream, *args, **kwargs):
        if "iter_0000002" in stream.name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), stream.name)
        return real(transforms, stream, *args, **kwargs)

    fs._write_item = no_space
else:  # the loss of the second iteration is NaN
    real_loss, calls = pretrain_gpt.loss_func, []

    def nan_loss(loss_mask, output_tensor):
        calls.append(1)
        loss, logged = real_loss(loss_mask, output_tensor)
        if len(calls) == 2:
            loss = loss * float("nan")
            logged = {{"lm loss": loss.detach()}}
        return loss, logged

    pretrain_gpt.loss_func = nan_loss
with exit_on_user_error():
    pretrain_gpt.main(sys.argv[1:])
"""


def _torchrun(tmp_path, mode, argv):
    script = tmp_path / f"{mode}.py"
    script.write_text(_INJECT.format(repo=REPO, mode=mode))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                          str(script)] + [str(a) for a in argv], env=_env(), cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    errors = [l for l in text.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1, text[-3000:]
    ours = text.split("torch/distributed/elastic")[0]  # what the ranks printed before torchrun's own report
    assert "Traceback" not in ours and "Exception in thread" not in ours, ours[-3000:]
    return errors[0]


def test_full_disk_under_torchrun_is_one_line(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    line = _torchrun(tmp_path, "full_disk", TINY + ["--train-iters", 2, "--save", ckpt, "--save-interval", 1])
    assert re.fullmatch(r"error: checkpoint error: saving checkpoint {c}/iter_0000002 failed: no space left on device "
                        r"\(errno ENOSPC\) while writing {c}/iter_0000002\.partial/__\d_\d\.distcp; {c}/"
                        r"latest_checkpointed_iteration\.txt was not advanced \(it still names the previous "
                        r"checkpoint\)".format(c=re.escape(ckpt)), line), line


def test_nan_loss_under_torchrun_is_one_line(tmp_path):
    line = _torchrun(tmp_path, "nan_loss", TINY + ["--train-iters", 3])
    assert line == ("error: training stopped: lm loss is nan at iteration 2 (not finite); that iteration's update "
                    "was skipped (--no-check-for-nan-in-loss-and-grad to go on)")


def test_model_mismatch_is_one_short_line(tmp_path):
    from tests.unit_tests.training.test_checkpoint_safety import _save_four_layers

    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_four_layers, 1, ckpt)
    argv = [str(a) for a in _with_layers(2) + ["--train-iters", 2, "--load", ckpt, "--finetune"]]
    out = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py")] + argv, env=_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    lines = [l for l in (out.stdout + out.stderr).splitlines() if l.startswith("error: ")]
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
    assert re.search(r"does not fit the model: model key \S+: checkpoint shape \(4, \d+(, \d+)*\), model shape "
                     r"\(2, \d+(, \d+)*\); [^;]+; \.\.\. \(\d+ more\); arguments that differ: num_layers \(checkpoint 4 "
                     r"vs run 2\)$", lines[0]), lines[0]
    assert len(lines[0]) < 500, len(lines[0])


# ---- the errno of the error itself ----------------------------------------------------------------------------
def test_save_dir_that_cannot_exist_names_its_errno(tmp_path, monkeypatch):
    from megatron.training import checkpoint_safety as safety
    from megatron.training.checkpoint_safety import CheckpointError

    monkeypatch.setattr(os, "statvfs", lambda p: type("Full", (), {"f_bavail": 0, "f_frsize": 4096})())  # as /proc
    lost = OSError(errno.ENOENT, os.strerror(errno.ENOENT), "/proc/x")
    assert safety.describe_save_failure(lost, "/proc/x") == \
        "no such file or directory (errno ENOENT) while writing /proc/x"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(CheckpointError) as e:
        safety.check_save_dir(str(a_file / "ckpt"))
    assert str(e.value) == (f"--save {a_file / 'ckpt'} is not writable: not a directory (errno ENOTDIR) while "
                            f"writing {a_file / 'ckpt'}")


def test_writer_thread_error_is_kept_not_printed(tmp_path, monkeypatch):
    from megatron.training import checkpoint_safety as safety

    printed = []  # what the previous hook (Python's: a traceback on stderr) was given
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(args.exc_type))
    monkeypatch.setattr(safety, "_previous_excepthook", None)
    safety.quiet_writer_threads()
    path = str(tmp_path / "iter_0000001.partial" / "__0_0.distcp")

    def write():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    t = threading.Thread(target=write, name="Thread-3 (_write_files_from_queue)")
    t.start()
    t.join()
    other = threading.Thread(target=lambda: 1 / 0, name="someone-else")
    other.start()
    other.join()
    assert printed == [ZeroDivisionError]  # only the writer thread is kept quiet
    lost = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert safety.describe_save_failure(lost, str(tmp_path)) == \
        f"no space left on device (errno ENOSPC) while writing {path}"
    assert safety.pop_writer_thread_error() is None  # consumed


# ---- no false warning --------------------------------------------------------------------------------------------
def _no_false_warning_body(rank, world_size, ckpt):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("megatron.core.dist_checkpointing")
    logger.addHandler(handler)
    try:
        _run(TINY + ["--train-iters", 1, "--save", ckpt])
    finally:
        logger.removeHandler(handler)
    differs = [r.getMessage() for r in records if "differs from rank 0" in r.getMessage()]
    assert differs == [], differs[0][:300]


def test_no_false_common_state_warning(tmp_path):
    run_distributed(_no_false_warning_body, 2, str(tmp_path / "ckpt"))


# ---- said once per job, not once per rank -----------------------------------------------------------------------
def _said_once_body(rank, world_size):
    import torch.distributed as dist

    from megatron.core import dist_utils
    from megatron.core.dist_checkpointing.strategies import async_utils

    dist_utils._said_once.clear()  # this forked rank's copy: what the test process said before does not count
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    async_utils.logger.addHandler(handler)
    try:
        for _ in range(2):
            assert async_utils.resolve_async_strategy("nvrx") == "mcore"
    finally:
        async_utils.logger.removeHandler(handler)
    said = [None] * world_size
    dist.all_gather_object(said, [r.getMessage() for r in records])
    assert [len(s) for s in said] == [1, 0], said
    assert said[0][0].startswith("async checkpoint save: nvidia-resiliency-ext is ") and "(mcore)" in said[0][0]


def test_same_warning_on_every_rank_said_once(tmp_path):
    run_distributed(_said_once_body, 2)


# ---- the learning-rate schedule on a resume (issue 41) -----------------------------------------------------------
def _save_at_lr_1e3(rank, world_size, ckpt):
    _run(TINY + ["--train-iters", 2, "--save", ckpt, "--save-interval", 2])


def _with_lr(extra):
    argv = list(TINY)
    argv[argv.index("--lr") + 1] = "2e-3"
    return argv + extra


def _pretrain(argv):
    return subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py")] + [str(a) for a in argv],
                          env=_env(), cwd=REPO, capture_output=True, text=True, timeout=300)


def test_scheduler_on_resume_override_and_mismatch(tmp_path):
    """--override-opt_param-scheduler --lr 2e-3 resumes a --lr 1e-3 checkpoint at 2e-3 (the loaded optimizer's
    param groups kept 1e-3 before); without it the mismatch is one "error:" line naming --lr and both flags."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_at_lr_1e3, 1, ckpt)
    done = _pretrain(_with_lr(["--train-iters", 4, "--load", ckpt, "--override-opt_param-scheduler"]))
    assert done.returncode == 0, done.stderr[-3000:]
    lrs = re.findall(r"iteration\s+(\d+)/\s*4 \|.* learning rate: (\S+) \|", done.stdout)
    # --lr-decay-style linear (the default) from 2e-3 to --min-lr 0 over 100 iterations: 2e-3 x (1 - n / 100)
    assert lrs == [("3", "1.940000E-03"), ("4", "1.920000E-03")], done.stdout[-3000:]
    done = _pretrain(_with_lr(["--train-iters", 4, "--load", ckpt]))
    lines = [l for l in (done.stdout + done.stderr).splitlines() if l.startswith("error: ")]
    assert done.returncode == 1 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert re.search(r"learning rate \(--lr\) is 0\.002 in the arguments but 0\.001 in the checkpoint; pass "
                     r"--use-checkpoint-opt_param-scheduler or --override-opt_param-scheduler$", lines[0]), lines[0]


def test_lr_out_of_float32_range_is_one_line():
    argv = _with_lr(["--train-iters", 1])
    argv[argv.index("--lr") + 1] = "1e39"
    done = _pretrain(argv)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith("error: megatron argument error: --lr 1e+39 is not a finite "
                                                           "float32 value"), done.stderr[-2000:]
