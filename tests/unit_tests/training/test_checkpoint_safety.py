"""Training checkpoints that are atomic, exclusive and checked on resume (issue 12, parts 3-5), for real on CPU:
two jobs racing into one --save, kill -9 in the middle of a save, a layer-count mismatch on resume, a tracker of
binary garbage, a full disk and a read-only --save (fake writers raising ENOSPC / EROFS: the tests run as root),
NaN weights with --check-weights-finite, and one error line under torchrun."""
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.unit_tests.dist_utils import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--vocab-size 64 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --lr-decay-iters 100 --seed 7 --mock-data --log-interval 1 "
        "--eval-iters 0 --distributed-backend gloo --transformer-impl local --hidden-dropout 0 "
        "--attention-dropout 0").split()
TRACKER = "latest_checkpointed_iteration.txt"


def _run(argv, on_iteration_end=None):
    import pretrain_gpt
    from megatron.training.training import pretrain

    return pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider, None,
                    pretrain_gpt.forward_step, args=[str(a) for a in argv], on_iteration_end=on_iteration_end)


def _with_layers(n):
    out = list(TINY)
    out[out.index("--num-layers") + 1] = str(n)
    return out


def _tracker(d):
    with open(os.path.join(d, TRACKER)) as f:
        return f.read().strip()


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


# ---- two jobs saving into one directory ----------------------------------------------------------------------
def _race_job(rank, world_size, ckpt, out, job, attempt):
    from megatron.training.checkpointing import CheckpointError

    try:
        res = _run(TINY + ["--train-iters", attempt + 1, "--save", ckpt, "--save-interval", 1, "--load", ckpt])
        assert sorted(res.losses) == [attempt + 1]  # resumed from the previous attempt's checkpoint
        outcome = "saved"
    except CheckpointError as e:
        outcome = f"refused: {e}"
    if rank == 0:
        with open(os.path.join(out, f"{attempt}_{job}.txt"), "w") as f:
            f.write(outcome)
        if outcome == "saved":  # keep holding the save root until the other job has tried
            other = os.path.join(out, f"{attempt}_{1 - job}.txt")
            deadline = time.time() + 240
            while not os.path.exists(other) and time.time() < deadline:
                time.sleep(0.05)
    dist.barrier()


def test_two_jobs_racing_into_one_save_dir(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path)
    ctx = mp.get_context("fork")
    for attempt in range(3):
        jobs = [ctx.Process(target=run_distributed, args=(_race_job, 2, ckpt, out, job, attempt)) for job in (0, 1)]
        for p in jobs:
            p.start()
        for p in jobs:
            p.join(timeout=400)
        assert [p.exitcode for p in jobs] == [0, 0]
        outcomes = [open(os.path.join(out, f"{attempt}_{job}.txt")).read() for job in (0, 1)]
        assert sorted(o == "saved" for o in outcomes) == [False, True], outcomes  # never two successful saves
        refused = next(o for o in outcomes if o != "saved")
        assert re.search(r"--save \S+ is in use by another job: lock file \S+megatron_save.lock is held by host "
                         r"\S+, pid \d+", refused), refused
        assert _tracker(ckpt) == str(attempt + 1)
        assert sorted(n for n in os.listdir(ckpt) if n.startswith("iter_")) == [
            f"iter_{i:07d}" for i in range(1, attempt + 2)]  # complete checkpoints only, no .partial
    run_distributed(_load_latest_body, 2, ckpt, 3)


def _load_latest_body(rank, world_size, ckpt, iteration):
    res = _run(TINY + ["--train-iters", iteration + 1, "--load", ckpt])
    assert sorted(res.losses) == [iteration + 1]  # the latest checkpoint loads


# ---- kill -9 in the middle of a save ---------------------------------------------------------------------------
_KILLER = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import torch.distributed.checkpoint.filesystem as fs
real = fs._write_item
partial = os.path.join({ckpt!r}, "iter_0000004.partial")

def write_then_die(*args, **kwargs):
    result = real(*args, **kwargs)
    if os.path.isdir(partial):  # the second save: one item written, then SIGKILL
        os.kill(os.getpid(), signal.SIGKILL)
    return result

fs._write_item = write_then_die
import pretrain_gpt
pretrain_gpt.main({argv!r})
"""


def _after_kill_body(rank, world_size, ckpt):
    res = _run(TINY + ["--train-iters", 6, "--save", ckpt, "--save-interval", 2, "--load", ckpt])
    assert sorted(res.losses) == [3, 4, 5, 6]  # the previous checkpoint (iteration 2) loaded
    assert _tracker(ckpt) == "6"
    names = sorted(os.listdir(ckpt))
    assert "iter_0000004" in names and "iter_0000006" in names
    assert not [n for n in names if n.endswith((".partial", ".replaced"))], names  # leftovers removed
    again = _run(TINY + ["--train-iters", 6, "--load", ckpt, "--ckpt-step", 4])
    assert sorted(again.losses) == [5, 6]
    assert again.losses == {5: res.losses[5], 6: res.losses[6]}


def test_kill_9_during_save_keeps_previous_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    argv = [str(a) for a in TINY + ["--train-iters", 4, "--save", ckpt, "--save-interval", 2]]
    proc = subprocess.run([sys.executable, "-c", _KILLER.format(repo=REPO, ckpt=ckpt, argv=argv)], env=_env(),
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "successfully saved checkpoint from iteration       2" in proc.stdout
    assert _tracker(ckpt) == "2"
    names = sorted(os.listdir(ckpt))
    assert "iter_0000004" not in names and "iter_0000004.partial" in names, names  # never a half iter_4
    with open(os.path.join(ckpt, "megatron_save.lock")) as f:
        assert json.load(f)["pid"] > 0  # the dead job's lock file is still there; the next job takes it over
    from megatron.training.checkpointing import CheckpointError, _find_checkpoint

    class A:
        ckpt_step = 4

    with pytest.raises(CheckpointError, match=r"iter_0000004 \(iteration 4, from --ckpt-step 4\) does not exist "
                                              r"\(\S+iter_0000004.partial exists: that save never finished\)"):
        _find_checkpoint(ckpt, A())
    run_distributed(_after_kill_body, 2, ckpt)


# ---- the save root's lock ----------------------------------------------------------------------------------------
def test_lock_held_by_live_process_and_stale_lock_taken_over(tmp_path, capsys):
    from megatron.training import checkpoint_safety as safety

    d = str(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.path.insert(0, %r)\n"
         "from megatron.training.checkpoint_safety import acquire_save_lock\n"
         "acquire_save_lock(%r); print('locked', flush=True); sys.stdin.read()" % (REPO, d)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(safety.CheckpointError) as e:
            safety.acquire_save_lock(d)
        msg = str(e.value)
        assert f"lock file {os.path.join(d, 'megatron_save.lock')} is held by host" in msg
        assert f"pid {holder.pid}," in msg
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    # The holder exited (without removing the file, as after kill -9): its pid is dead, the lock is taken over.
    with open(os.path.join(d, "megatron_save.lock"), "w") as f:
        json.dump({"host": os.uname().nodename, "pid": holder.pid, "time": "then"}, f)
    note = safety.acquire_save_lock(d)
    assert note is not None and f"pid {holder.pid}" in note and "no longer running" in note
    with open(os.path.join(d, "megatron_save.lock")) as f:
        assert json.load(f)["pid"] == os.getpid()
    assert safety.acquire_save_lock(d) is None  # this process holds it already
    safety.release_save_lock(d)
    assert not os.path.exists(os.path.join(d, "megatron_save.lock"))


def test_lock_refusal_waits_for_the_new_holders_record(tmp_path):
    """A job that finds the lock held while its holder has not yet written its record (the file still empty or
    still naming the previous, dead holder) names the new holder, not an unknown or dead one."""
    from megatron.training import checkpoint_safety as safety

    d = str(tmp_path)
    path = os.path.join(d, "megatron_save.lock")
    with open(path, "w") as f:
        json.dump({"host": os.uname().nodename, "pid": 2**22 + 12345, "time": "earlier"}, f)  # a dead holder
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, json, os, sys, time\n"
         "fd = os.open(%r, os.O_RDWR)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "print('locked', flush=True); time.sleep(0.5)\n"
         "os.ftruncate(fd, 0); os.pwrite(fd, json.dumps({'host': os.uname().nodename, 'pid': os.getpid()}).encode(), 0)\n"
         "sys.stdin.read()" % path],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(safety.CheckpointError, match=rf"is held by host \S+, pid {holder.pid}, "):
            safety.acquire_save_lock(d)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def test_leftovers_and_publish(tmp_path):
    from megatron.training import checkpoint_safety as safety

    d = str(tmp_path)
    for name in ("iter_0000002", "iter_0000004.partial", "iter_0000003.replaced", "iter_0000005"):
        os.makedirs(os.path.join(d, name))
    for name in (TRACKER, TRACKER + ".tmp.123", "notes.partial"):
        open(os.path.join(d, name), "w").close()
    assert safety.remove_leftovers(d) == ["iter_0000003.replaced", "iter_0000004.partial", TRACKER + ".tmp.123"]
    assert sorted(os.listdir(d)) == ["iter_0000002", "iter_0000005", TRACKER, "notes.partial"]
    old = os.path.join(d, "iter_0000005")
    open(os.path.join(old, "old"), "w").close()
    os.makedirs(os.path.join(d, "iter_0000005.partial"))
    open(os.path.join(d, "iter_0000005.partial", "new"), "w").close()
    safety.publish(os.path.join(d, "iter_0000005.partial"), old)  # the same iteration saved again: replaced
    assert os.listdir(old) == ["new"]
    assert sorted(os.listdir(d)) == ["iter_0000002", "iter_0000005", TRACKER, "notes.partial"]


# ---- resume checks -----------------------------------------------------------------------------------------------
def _mismatch_body(rank, world_size, tmp):
    from megatron.training.checkpointing import CheckpointError

    ckpt = os.path.join(tmp, "four")
    _run(_with_layers(4) + ["--train-iters", 1, "--save", ckpt])
    for extra in ([], ["--no-load-optim"]):
        with pytest.raises(CheckpointError) as e:
            _run(_with_layers(2) + ["--train-iters", 2, "--load", ckpt] + extra)
        assert "arguments that differ: num_layers (checkpoint 4 vs run 2)" in str(e.value)
    # --finetune: the argument check is skipped only when the tensors still fit; 4 stacked layers do not fit 2.
    with pytest.raises(CheckpointError) as e:
        _run(_with_layers(2) + ["--train-iters", 1, "--load", ckpt, "--finetune"])
    msg = str(e.value)
    # Layers 2 and 3 are named as unexpected (per-layer keys), or the stacked layer tensors as resized (4 vs 2).
    assert re.search(r"unexpected model keys in the checkpoint \(not in the model\): decoder\.layers\.2\.|"
                     r"model key decoder\.layers\.\S+: checkpoint shape \(4, [\d, ]+\), model shape \(2, ", msg), msg
    assert "num_layers (checkpoint 4 vs run 2)" in msg
    # Fewer heads, same hidden size: every tensor has the same shape, so --finetune loads it (a warning only) ...
    heads = list(TINY)
    heads[heads.index("--num-attention-heads") + 1] = "2"
    two = os.path.join(tmp, "two")
    _run(TINY + ["--train-iters", 1, "--save", two])
    res = _run(heads + ["--train-iters", 1, "--load", two, "--finetune"])
    assert sorted(res.losses) == [1]
    # ... and a resume without --finetune is refused, naming the argument.
    with pytest.raises(CheckpointError, match=r"num_attention_heads \(checkpoint 4 vs run 2\)"):
        _run(heads + ["--train-iters", 2, "--load", two])
    # Untied output layer: the checkpoint has a tensor the model does not (the tied model loads an untied one).
    untied = os.path.join(tmp, "untied")
    _run(TINY + ["--train-iters", 1, "--save", untied, "--untie-embeddings-and-output-weights"])
    with pytest.raises(CheckpointError) as e:
        _run(TINY + ["--train-iters", 1, "--load", untied, "--finetune"])
    assert "unexpected model keys in the checkpoint (not in the model): output_layer.weight;" in str(e.value)


def test_resume_checks_model_args_and_keys(tmp_path):
    run_distributed(_mismatch_body, 2, str(tmp_path))


def _nan_body(rank, world_size, ckpt):
    from megatron.training.checkpointing import CheckpointError

    def poison(iteration, model, loss):
        if iteration == 1:
            with torch.no_grad():
                dict(model[0].module.named_parameters())["decoder.layers.1.mlp.linear_fc2.weight"][0, 0] = float("nan")

    # only --no-check-for-nan-in-loss-and-grad publishes a non-finite state (with a warning; see
    # test_checkpoint_publication.py)
    _run(TINY + ["--train-iters", 1, "--save", ckpt, "--no-check-for-nan-in-loss-and-grad"], on_iteration_end=poison)
    with pytest.raises(CheckpointError, match=r"--check-weights-finite: model tensor "
                                              r"decoder\.layers\.1\.mlp\.linear_fc2\.weight holds NaN or Inf right "
                                              r"after loading"):
        _run(TINY + ["--train-iters", 2, "--load", ckpt, "--check-weights-finite"])


def test_check_weights_finite_names_the_tensor(tmp_path):
    run_distributed(_nan_body, 2, str(tmp_path / "nan"))


# ---- messages ----------------------------------------------------------------------------------------------------
def test_tracker_garbage_names_the_file(tmp_path):
    from megatron.training.checkpointing import CheckpointError, read_metadata

    path = str(tmp_path / TRACKER)
    with open(path, "wb") as f:
        f.write(b"\x80\xff\x00garbage\xfe")
    with pytest.raises(CheckpointError, match=re.escape(path) + r" holds binary data, not an iteration or "
                                                                r"'release' \(first bytes b'\\x80\\xff"):
        read_metadata(path)
    with open(path, "wb") as f:
        f.write(b"7" * 5000)
    with pytest.raises(CheckpointError, match=re.escape(path) + " is not a tracker: over 4096 bytes"):
        read_metadata(path)
    with open(path, "w") as f:
        f.write(" 12\n")
    assert read_metadata(path) == (12, False)


def _full_disk_body(rank, world_size, ckpt):
    import torch.distributed.checkpoint.filesystem as fs
    from megatron.training.checkpointing import CheckpointError

    _run(TINY + ["--train-iters", 1, "--save", ckpt])
    real = fs._write_item

    def no_space(transforms, stream, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), stream.name)

    fs._write_item = no_space if rank == 0 else real  # rank 0 writes the replicated tensors
    try:
        with pytest.raises(CheckpointError) as e:
            _run(TINY + ["--train-iters", 2, "--save", ckpt, "--load", ckpt])
    finally:
        fs._write_item = real
    msg = str(e.value)
    partial = os.path.join(ckpt, "iter_0000002.partial")
    assert re.search(r"no space left on device \(errno ENOSPC\) while writing " + re.escape(partial)
                     + r"/__0_\d+\.distcp", msg), msg
    assert f"{os.path.join(ckpt, TRACKER)} was not advanced" in msg
    assert _tracker(ckpt) == "1"
    dist.barrier()
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("iter_")) == ["iter_0000001"]  # no partial left
    res = _run(TINY + ["--train-iters", 2, "--save", ckpt, "--load", ckpt])  # space again: the save succeeds
    assert sorted(res.losses) == [2] and _tracker(ckpt) == "2"


def test_full_disk_is_named(tmp_path):
    run_distributed(_full_disk_body, 2, str(tmp_path / "full"))


def _read_only_body(rank, world_size, save):
    import builtins

    from megatron.training.checkpointing import CheckpointError

    real_open = builtins.open

    def read_only_open(file, mode="r", *args, **kwargs):
        if str(file).startswith(save) and any(c in mode for c in "wax+"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(file))
        return real_open(file, mode, *args, **kwargs)

    iterations = []
    builtins.open = read_only_open
    try:
        with pytest.raises(CheckpointError) as e:
            _run(TINY + ["--train-iters", 2, "--save", save], on_iteration_end=lambda i, m, l: iterations.append(i))
    finally:
        builtins.open = real_open
    assert iterations == []  # stopped before training, on every rank
    assert re.search(r"--save " + re.escape(save) + r" is not writable: read-only file system \(errno EROFS\) "
                     r"while writing " + re.escape(save) + r"/\.write_probe\.\d+", str(e.value)), str(e.value)


def test_read_only_save_dir_stops_at_start_up(tmp_path):
    run_distributed(_read_only_body, 2, str(tmp_path / "ro"))


def test_torchrun_error_is_one_line_on_rank_0(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_four_layers, 1, ckpt)
    argv = [str(a) for a in _with_layers(2) + ["--train-iters", 2, "--load", ckpt]]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                          os.path.join(REPO, "pretrain_gpt.py")] + argv, env=_env(), cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode != 0
    lines = [l for l in (out.stdout + out.stderr).splitlines() if l.startswith("error: ")]
    assert len(lines) == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "checkpoint error" in lines[0] and "num_layers (checkpoint 4 vs run 2)" in lines[0]
    assert "raise CheckpointError" not in out.stderr  # no per-rank traceback


def _save_four_layers(rank, world_size, ckpt):
    _run(_with_layers(4) + ["--train-iters", 1, "--save", ckpt])


def test_full_disk_named_when_the_writer_lost_the_errno(tmp_path, monkeypatch):
    """A real full disk surfaces from torch's zip writer as 'unexpected pos 704 vs 598' (the ENOSPC stays in a
    writer thread): a file system with no space left is then named from statvfs (seen for real on a 300k tmpfs)."""
    from megatron.training import checkpoint_safety as safety

    lost = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    path = str(tmp_path / "iter_0000001.partial")
    assert safety.describe_save_failure(lost, path) == f"RuntimeError: {lost}"  # space left: no guess
    real = os.statvfs

    class Full:
        f_bavail, f_frsize = 0, 4096

    monkeypatch.setattr(os, "statvfs", lambda p: Full() if str(p).startswith(str(tmp_path)) else real(p))
    assert safety.describe_save_failure(lost, path) == f"no space left on device (errno ENOSPC) while writing {path}"
    wrapped = RuntimeError("save of x failed: rank 1: OSError: [Errno 30] Read-only file system: '/ro/__1_0.distcp'")
    assert safety.describe_save_failure(wrapped, path) == \
        "read-only file system (errno EROFS) while writing /ro/__1_0.distcp"


# ---- optimizer state across engines --------------------------------------------------------------------------
def _a(**kw):
    import argparse

    base = dict(use_megatron_fsdp=False, use_distributed_optimizer=False, bf16=True, fp16=False,
                data_parallel_sharding_strategy=None, expert_model_parallel_size=1)
    base.update(kw)
    return argparse.Namespace(**base)


CHAINED = {"optimizer": {0: {"param_state_sharding_type": "fully_reshardable"},
                         1: {"param_state_sharding_type": "fully_reshardable"}}}
BUCKETS = {"optimizer": {"param_state_sharding_type": "dp_reshardable", "optimizer": {}}}


@pytest.mark.parametrize("saved, run, common, refused", [
    (dict(use_megatron_fsdp=True), dict(use_distributed_optimizer=True), None, True),  # FSDP --bf16 -> distopt
    (dict(), dict(use_distributed_optimizer=True), None, True),  # DDP -> distopt
    (dict(use_megatron_fsdp=True, bf16=False), dict(bf16=False, use_distributed_optimizer=True), None, True),
    (dict(), dict(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim"), None, True),  # into ZeRO-1
    (dict(use_distributed_optimizer=True), dict(), CHAINED, True),  # chained dense + expert -> DDP
    (dict(use_distributed_optimizer=True), dict(use_megatron_fsdp=True), CHAINED, True),
    (dict(use_distributed_optimizer=True), dict(), BUCKETS, True),  # dp_reshardable -> DDP
    (dict(use_megatron_fsdp=True), dict(), None, False),  # -> DDP: its main params come from the fp32 weights
    (dict(), dict(use_megatron_fsdp=True), None, False),
    (dict(use_distributed_optimizer=True), dict(use_megatron_fsdp=True), None, False),
    (dict(use_distributed_optimizer=True, expert_model_parallel_size=2), dict(), None, False),  # unchained
    (dict(use_megatron_fsdp=True), dict(use_megatron_fsdp=True), None, False),  # the same engine
    (dict(use_distributed_optimizer=True), dict(use_distributed_optimizer=True), CHAINED, False),
    (dict(use_distributed_optimizer=True), dict(use_distributed_optimizer=True), BUCKETS, False),
    (dict(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim"), dict(use_distributed_optimizer=True),
     None, False),  # Megatron-FSDP's ZeRO-1 is the distributed optimizer
])
def test_optimizer_layout_problem_only_where_the_state_cannot_load(saved, run, common, refused):
    from megatron.training import checkpoint_safety as safety

    keys = ["embedding.word_embeddings.weight", "optimizer.state.exp_avg.embedding.word_embeddings.weight"]
    problem = safety.optimizer_layout_problem(_a(**saved), keys, _a(**run), common)
    assert (problem is not None) == refused, problem
    if refused:
        assert "--no-load-optim" in problem
    assert safety.optimizer_layout_problem(_a(**saved), keys[:1], _a(**run), common) is None  # no optimizer state
    assert safety.optimizer_layout_problem(None, keys, _a(**run), common) is None  # a checkpoint without args
