"""Run control on clusters (CPU, gloo, real runs): --exit-signal-handler (SIGTERM -> checkpoint, exit code 0),
--exit-duration-in-mins, --save-retain-interval, --non-persistent-save-interval, --pretrained-checkpoint,
--use-checkpoint-args, the checkpoint format check, --ckpt-assume-constant-structure; --log-params-norm,
--log-num-zeros-in-grad; --manual-gc, --empty-unused-memory-level; the argument errors."""
import gc
import logging
import math
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import NO_DROPOUT, REPO, TINY, _run, _tracker


def _iters(d):
    return sorted(n for n in os.listdir(d) if n.startswith("iter_"))


# ---- SIGTERM, duration, retain, non-persistent -----------------------------------------------------------
def _sigterm_body(rank, world_size, tmp):
    ckpt = os.path.join(tmp, "sig")

    def on_end(iteration, model, loss):
        if iteration == 2 and rank == 1:  # only one rank gets the signal: both save and stop
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    res = _run(TINY + ["--train-iters", 10, "--eval-iters", 1, "--save", ckpt, "--save-interval", 5,
                       "--exit-signal-handler"], on_iteration_end=on_end)
    assert res.iteration == 2 and sorted(res.losses) == [1, 2]
    assert res.interrupted and "SIGTERM" in res.exit_reason
    assert res.final_valid_loss is None  # no final evaluation after a SIGTERM
    assert _tracker(ckpt) == "2" and _iters(ckpt) == ["iter_0000002"]
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is restored

    # --exit-duration-in-mins: the clock runs 2 minutes ahead of the run's start (pretrain's time.time())
    from megatron.training import run_control

    dur = os.path.join(tmp, "dur")
    real = run_control._clock
    run_control._clock = lambda: real() + 120.0
    try:
        res = _run(TINY + ["--train-iters", 10, "--save", dur, "--exit-duration-in-mins", 1])
    finally:
        run_control._clock = real
    assert res.iteration == 1 and res.interrupted and "--exit-duration-in-mins 1" in res.exit_reason
    assert _tracker(dur) == "1"


def test_sigterm_and_exit_duration_save_and_stop(tmp_path):
    run_distributed(_sigterm_body, 2, str(tmp_path))


def _retain_and_non_persistent_body(rank, world_size, tmp):
    ckpt = os.path.join(tmp, "retain")
    _run(TINY + ["--train-iters", 8, "--save", ckpt, "--save-interval", 2, "--save-retain-interval", 4])
    assert _iters(ckpt) == ["iter_0000004", "iter_0000008"] and _tracker(ckpt) == "8"

    np_ckpt = os.path.join(tmp, "np")

    def crash(iteration, model, loss):
        if iteration == 7:
            raise RuntimeError("node lost")

    argv = TINY + NO_DROPOUT + ["--train-iters", 10, "--save", np_ckpt, "--save-interval", 4,
                                "--non-persistent-save-interval", 1, "--non-persistent-ckpt-type", "global"]
    with pytest.raises(RuntimeError, match="node lost"):
        _run(argv, on_iteration_end=crash)
    np_dir = os.path.join(np_ckpt, "non_persistent")
    assert _tracker(np_ckpt) == "4" and _iters(np_dir) == ["iter_0000006"] and _tracker(np_dir) == "6"
    resumed = _run(argv + ["--load", np_ckpt])  # the non-persistent iteration 6 is newer than 4
    assert sorted(resumed.losses) == list(range(7, 11))
    full = _run(TINY + NO_DROPOUT + ["--train-iters", 10])
    assert [resumed.losses[i] for i in range(7, 11)] == [full.losses[i] for i in range(7, 11)]


def test_save_retain_interval_and_non_persistent_saves(tmp_path):
    run_distributed(_retain_and_non_persistent_body, 2, str(tmp_path))


def test_sigterm_exits_pretrain_gpt_with_code_0(tmp_path):
    """The real entry point: SIGTERM during training -> a checkpoint of the iteration and exit code 0."""
    ckpt = str(tmp_path / "ckpt")
    cmd = [sys.executable, os.path.join(REPO, "pretrain_gpt.py")] + TINY + [
        "--train-iters", "100000", "--log-interval", "1", "--save", ckpt, "--save-interval", "100000",
        "--exit-signal-handler"]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if " iteration        2/" in line:
                proc.send_signal(signal.SIGTERM)
                break
        out = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    text = "".join(lines) + out
    assert proc.returncode == 0, text[-3000:]
    assert "exiting program after receiving SIGTERM" in text
    saved = int(_tracker(ckpt))
    assert saved >= 2 and _iters(ckpt) == [f"iter_{saved:07d}"]


# ---- pretrained checkpoint, checkpoint args, format ------------------------------------------------------
def _pretrained_body(rank, world_size, tmp):
    from megatron.training.checkpointing import CheckpointError, checkpoint_format, load_args_from_checkpoint
    from megatron.training.initialize import initialize_megatron

    base = os.path.join(tmp, "base")
    a = _run(TINY + NO_DROPOUT + ["--train-iters", 3, "--eval-iters", 1, "--save", base])
    assert checkpoint_format(os.path.join(base, "iter_0000003")) == "torch_dist"
    fresh = os.path.join(tmp, "fresh")
    eval_only = TINY + NO_DROPOUT + ["--train-iters", 3, "--eval-iters", 1, "--skip-train"]
    b = _run(eval_only + ["--load", fresh, "--pretrained-checkpoint", base, "--ckpt-fresh-start"])
    assert b.final_valid_loss == a.final_valid_loss  # the pretrained weights, evaluated on the same batches
    assert _run(eval_only).final_valid_loss != a.final_valid_loss
    ft = _run(TINY + ["--train-iters", 2, "--pretrained-checkpoint", base, "--save", fresh])
    assert sorted(ft.losses) == [1, 2] and _tracker(fresh) == "2"  # as --finetune: from iteration 0
    with pytest.raises(CheckpointError, match="--pretrained-checkpoint .*no checkpoint tracker"):
        _run(TINY + ["--train-iters", 2, "--pretrained-checkpoint", os.path.join(tmp, "none")])

    # --use-checkpoint-args: sizes filled where not given, the rest forced (upstream's rule)
    argv = list(TINY)
    for flag in ("--num-layers", "--hidden-size"):  # not given: taken from the checkpoint
        i = argv.index(flag)
        del argv[i:i + 2]
    args = initialize_megatron(args=[str(x) for x in argv + ["--train-iters", 1, "--load", base,
                                                              "--use-checkpoint-args", "--normalization",
                                                              "RMSNorm", "--num-attention-heads", "2"]])
    assert (args.num_layers, args.hidden_size, args.normalization) == (2, 32, "LayerNorm")
    assert args.num_attention_heads == 2  # given on the command line: kept
    legacy = os.path.join(tmp, "legacy")
    os.makedirs(os.path.join(legacy, "iter_0000001", "mp_rank_00"))
    with open(os.path.join(legacy, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")
    assert checkpoint_format(os.path.join(legacy, "iter_0000001")) == "torch"
    with pytest.raises(CheckpointError, match="format 'torch' \\(detected: --auto-detect-ckpt-format\\); this fork "
                                              "loads torch_dist only"):
        _run(TINY + ["--train-iters", 1, "--load", legacy, "--auto-detect-ckpt-format"])
    with pytest.raises(CheckpointError, match="--use-checkpoint-args: no checkpoint tracker"):
        load_args_from_checkpoint(SimpleNamespace(load=fresh + "x", pretrained_checkpoint=None, ckpt_step=None))


def test_pretrained_checkpoint_checkpoint_args_and_format(tmp_path):
    run_distributed(_pretrained_body, 1, str(tmp_path))


def _constant_structure_body(rank, world_size, tmp):
    from megatron.core import dist_checkpointing
    from megatron.training import checkpointing

    seen, real = [], dist_checkpointing.save

    def spy(*a, **kw):
        seen.append(kw.get("validate_access_integrity"))
        return real(*a, **kw)

    dist_checkpointing.save = spy
    try:
        _run(TINY + ["--train-iters", 4, "--save", os.path.join(tmp, "c"), "--save-interval", 2,
                     "--ckpt-assume-constant-structure", "--use-dist-ckpt"])
        checkpointing._saved_once = False
        _run(TINY + ["--train-iters", 4, "--save", os.path.join(tmp, "d"), "--save-interval", 2])
    finally:
        dist_checkpointing.save = real
    assert seen == [True, False, True, True]  # the first save of a run validates; later ones only without the flag


def test_ckpt_assume_constant_structure(tmp_path):
    run_distributed(_constant_structure_body, 2, str(tmp_path))


# ---- logging ------------------------------------------------------------------------------------------------
def _norms_body(rank, world_size, tmp):
    argv = TINY + NO_DROPOUT + ["--train-iters", 3, "--log-interval", 3, "--log-params-norm",
                                "--log-num-zeros-in-grad", "--untie-embeddings-and-output-weights"]
    res = _run(argv)
    params = list(res.model[0].parameters())
    want = math.sqrt(sum(float(p.detach().double().square().sum()) for p in params))
    assert res.params_norms[3] == pytest.approx(want, rel=1e-6)
    grads = [getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad for p in params]
    zeros = sum(int((g == 0).sum()) for g in grads if g is not None)
    # the 64 padded vocabulary rows of the (untied) embedding never get a gradient: 64 x 32 zeros at least
    assert res.num_zeros[3] == zeros and zeros >= 64 * 32
    assert 1 not in res.params_norms and 2 not in res.num_zeros  # computed at log iterations only
    # the distributed optimizer: its owned slices, summed over the data-parallel ranks, give the same figures
    sharded = _run(argv + ["--use-distributed-optimizer"])
    assert sharded.params_norms[3] == pytest.approx(want, rel=1e-6)
    assert sharded.num_zeros[3] == zeros


def test_log_params_norm_and_num_zeros(tmp_path):
    run_distributed(_norms_body, 2, str(tmp_path))


def test_training_log_line_names_params_norm_and_zeros(monkeypatch, capsys):
    from megatron.training import training

    args = SimpleNamespace(global_batch_size=8, seq_length=16, log_throughput=False, train_iters=10,
                           consumed_train_samples=8)
    monkeypatch.setattr(training, "get_args", lambda: args)
    line = training.training_log(1, 2.0, 1e-3, 0.5, 1.0, 1, num_zeros=17, params_norm=12.25)
    assert " num zeros: 17 |" in line and " params norm: 12.250 |" in line
    assert "num zeros" not in training.training_log(1, 2.0, 1e-3, 0.5, 1.0, 1)


# ---- housekeeping ----------------------------------------------------------------------------------------------
def _control_args(**kw):
    base = dict(exit_signal_handler=False, manual_gc=False, manual_gc_interval=0, manual_gc_eval=True,
                empty_unused_memory_level=0, record_memory_history=False, save=None, save_interval=None,
                non_persistent_save_interval=None, exit_duration_in_mins=None, exit_interval=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_manual_gc_and_empty_unused_memory(monkeypatch):
    from megatron.training import run_control

    assert gc.isenabled()
    with run_control.RunControl(_control_args(manual_gc=True, manual_gc_interval=3)) as control:
        assert not gc.isenabled() and control.collections == 1  # disabled, one collection at the start
        for it in range(1, 10):
            control.after_step(it)
        assert control.collections == 4  # iterations 3, 6, 9
        control.around_evaluation()
        assert control.collections == 5 and control.releases == 0
    assert gc.isenabled()
    calls = []
    monkeypatch.setattr(run_control, "release_cached_memory", lambda: calls.append(1))
    for level, want in ((1, 2), (2, 3)):
        calls.clear()
        control = run_control.RunControl(_control_args(empty_unused_memory_level=level))
        control.after_step(1)
        control.after_step(2)
        control.around_evaluation()
        assert control.releases == want and len(calls) == want
    assert run_control.RunControl(_control_args(exit_interval=2)).save_and_decide_exit(4, None) == (
        "exiting program at iteration 4 (--exit-interval 2)", False)


# ---- argument errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    (["--save-retain-interval", 3, "--save", "x", "--save-interval", 2],
     "--save-retain-interval (3) must be a multiple of --save-interval (2)"),
    (["--save-retain-interval", 4], "--save-retain-interval needs --save <dir> and --save-interval"),
    (["--non-persistent-save-interval", 2, "--save", "x"],
     "--non-persistent-save-interval needs --non-persistent-ckpt-type global"),
    (["--non-persistent-ckpt-type", "local"], "--non-persistent-ckpt-type local is not supported"),
    (["--exit-duration-in-mins", 0], "--exit-duration-in-mins must be positive (got 0)"),
    (["--use-checkpoint-args"], "--use-checkpoint-args needs --load <dir> or --pretrained-checkpoint <dir>"),
    (["--manual-gc-interval", -1], "--manual-gc-interval must be >= 0"),
    (["--logging-level", 99], "--logging-level must be in [0, 50]"),
])
def test_run_control_argument_errors(extra, message):
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args(args=[str(x) for x in TINY + ["--train-iters", 1] + extra])
    with pytest.raises(SystemExit, match="megatron argument error: " + __import__("re").escape(message)):
        validate_args(args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_record_memory_history_refused_without_cuda_and_logging_level():
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args(args=[str(x) for x in TINY + ["--train-iters", 1, "--record-memory-history"]])
    with pytest.raises(SystemExit, match="--record-memory-history records the CUDA allocator's history"):
        validate_args(args)
    before = logging.getLogger("megatron").level
    try:
        validate_args(parse_args(args=[str(x) for x in TINY + ["--train-iters", 1, "--logging-level", 10]]))
        assert logging.getLogger("megatron").level == 10
    finally:
        logging.getLogger("megatron").setLevel(before)
        logging.getLogger().setLevel(logging.WARNING)
