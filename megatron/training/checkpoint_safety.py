"""What keeps a training checkpoint honest: one job per save directory, atomic publication, checks on resume.

- **Exclusive save root.** Rank 0 holds an ``fcntl.flock`` on ``<save>/megatron_save.lock`` for the life of the
  job; the file records the holder (host, pid, start time, command). A second job that wants to save into the same
  directory fails fast with a message naming the lock file and its holder. The kernel drops the lock when the
  holder dies, so a lock left behind by a dead process (kill -9, node crash on a shared file system with working
  locks) is simply taken over, and said so.
- **Atomic saves.** A save is written to ``<save>/iter_0000100.partial`` and renamed to ``iter_0000100`` by rank 0
  only after every rank finished; the tracker is advanced after the rename. Names ending in ``.partial`` /
  ``.replaced`` are never loaded (the loader uses the exact ``iter_N`` name) and are removed by the next save (it
  holds the lock, so no other job can be writing them).
- **Start-up check.** ``check_save_dir`` (before training) creates ``--save``, writes a probe file and takes the
  lock; a failure stops every rank with a message naming ``--save``.
- **Resume checks.** ``checkpoint_args_mismatches`` compares the model-shape arguments stored in the checkpoint
  with the run's (upstream's ``check_checkpoint_args``); ``model_key_problems`` compares the model's tensor keys and
  global shapes with the checkpoint's (a 4-layer checkpoint never fills a 2-layer model silently).
- **Nothing replaced, nothing orphaned.** ``save_target_problem`` (start-up, before training) refuses a run whose
  saves would replace complete checkpoints already in ``--save`` or move its tracker back (``--finetune`` or a fresh
  run into a directory with checkpoints, ``--ckpt-step`` to an earlier one), unless ``--ckpt-overwrite``; a save
  checks it again for its own iteration. ``missing_tracker_problem`` refuses to start from scratch when ``--load``
  holds ``iter_N`` checkpoints but no tracker, unless ``--ckpt-fresh-start``.
- **Only finite states are published.** ``first_non_finite_shard`` checks the tensors a save writes (model and
  optimizer state, this rank's shards); a save holding NaN/Inf is kept aside as ``iter_N.nonfinite`` and the
  tracker stays where it was.
- **Named causes.** ``describe_save_failure`` turns ENOSPC / EDQUOT / EROFS / EACCES anywhere in an error (also
  inside DCP's per-rank failure text) into "no space left on device while writing <path>"-style messages.
"""
import atexit
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import threading
import time
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import dist_utils

LOCK_FILENAME = "megatron_save.lock"
PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"
NONFINITE_SUFFIX = ".nonfinite"  # a save holding NaN/Inf, kept aside for inspection (never loaded, never removed)
_CHECKPOINT_DIR = re.compile(r"^iter_(\d{7,})$")
_LEFTOVER = re.compile(r"^(iter_\d{7}|release)(\.partial|\.replaced)$|^latest_checkpointed_iteration\.txt\.tmp\.\d+$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, unreadable or does not fit the run; the message names the directory,
    file, flag or argument."""


def raise_collectively(error: Optional[str]) -> None:
    """Raise the same CheckpointError on every rank if any rank has an error (collective when distributed)."""
    dist_utils.raise_collectively(error, CheckpointError, "checkpoint")


def broadcast_error_from_rank0(error: Optional[str]) -> None:
    """Raise rank 0's error (a string or None computed on rank 0 only) on every rank."""
    if dist_utils.get_world_size() > 1:
        box = [error if dist_utils.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise CheckpointError(error)


# ---- named OS errors ----------------------------------------------------------------------------------------
_NAMED_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
_TEXT_MARKERS = [(f"[Errno {code}]", code) for code in _NAMED_ERRNOS] + [
    (os.strerror(code), code) for code in _NAMED_ERRNOS]


def _chain(exc: Optional[BaseException]) -> Iterable[BaseException]:
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # torch DCP CheckpointException
            todo.append(failure[0] if isinstance(failure, tuple) else failure)


def named_os_error(exc: Optional[BaseException]) -> Optional[Tuple[int, Optional[str]]]:
    """(errno, filename) of the first ENOSPC/EDQUOT/EROFS/EACCES/EPERM in ``exc`` (its chain, DCP failures, or
    the text a wrapper kept), or None."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _NAMED_ERRNOS:
            return e.errno, e.filename
    for e in _chain(exc):
        text = str(e)
        for marker, code in _TEXT_MARKERS:
            if marker in text:
                m = re.search(re.escape(marker) + r"[^']*'([^']+)'", text)
                return code, m.group(1) if m else None
    return None


def _free_bytes(path: str) -> Optional[int]:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _any_os_error(exc: Optional[BaseException]) -> Optional[OSError]:
    return next((e for e in _chain(exc) if isinstance(e, OSError) and e.errno), None)


def describe_save_failure(exc: Optional[BaseException], path: str) -> str:
    """One line for a failed save: the named OS cause with its path when there is one, else the errno the error
    carries (``--save /proc/x``: ENOENT, not a full disk), else what a DCP writer thread raised, else a full file
    system detected afterwards (the writer's own error lost the errno), else the exception."""
    named = named_os_error(exc)
    if named is None:
        other = _any_os_error(exc)
        if other is not None:
            code = other.errno
            return (f"{os.strerror(code).lower()} (errno {errno.errorcode.get(code, code)}) while writing "
                    f"{other.filename or path}")
    if named is None:
        named = named_os_error(pop_writer_thread_error())
    if named is None and _free_bytes(path) == 0:
        named = (errno.ENOSPC, None)
    if named is not None:
        code, filename = named
        return f"{_NAMED_ERRNOS[code]} (errno {errno.errorcode[code]}) while writing {filename or path}"
    return f"{type(exc).__name__}: {exc}" if exc is not None else "failed on another rank"


# ---- DCP writer threads: their errors are summarised by the save, not printed as tracebacks ---------------------
_WRITER_THREAD = "_write_files_from_queue"  # torch DCP FileSystemWriter's worker threads are named after it
_writer_errors: List[BaseException] = []
_previous_excepthook = None


def quiet_writer_threads() -> None:
    """Install (once) a ``threading.excepthook`` that keeps the exception of a DCP writer thread (a full disk, a
    read-only file system) for ``describe_save_failure`` instead of printing its traceback: the save itself fails
    on every rank with one line naming the cause. Other threads' exceptions are printed as before."""
    global _previous_excepthook
    if _previous_excepthook is not None:
        return
    _previous_excepthook = threading.excepthook

    def hook(args):
        if args.thread is not None and _WRITER_THREAD in args.thread.name and isinstance(args.exc_value, Exception):
            del _writer_errors[:-7]  # keep the latest few
            _writer_errors.append(args.exc_value)
            return
        _previous_excepthook(args)

    threading.excepthook = hook


def pop_writer_thread_error() -> Optional[BaseException]:
    """The first exception a DCP writer thread raised since the last call (and forget them), or None."""
    first = _writer_errors[0] if _writer_errors else None
    _writer_errors.clear()
    return first


# ---- the save root's lock -----------------------------------------------------------------------------------
_HELD: Dict[str, int] = {}  # realpath of a save root -> fd holding its flock (this process)


def _owner_text(info: dict) -> str:
    return (f"host {info.get('host', '?')}, pid {info.get('pid', '?')}, since {info.get('time', '?')}"
            + (f", command {info['command']}" if info.get("command") else ""))


def _read_owner(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
        info = json.loads(raw.decode("utf-8"))
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _current_owner(path: str, wait_s: float = 2.0) -> dict:
    """The holder recorded in a lock file someone holds. The holder writes its record right after taking the lock,
    so an empty record, or one of a dead process on this host (the previous holder's), is read again for a moment."""
    deadline = time.monotonic() + wait_s
    while True:
        info = _read_owner(path)
        fresh = info and not (info.get("host") == socket.gethostname() and not _pid_alive(info.get("pid")))
        if fresh or time.monotonic() > deadline:
            return info
        time.sleep(0.02)


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True
    return True


def acquire_save_lock(save_dir: str) -> Optional[str]:
    """Take (or keep, if this process holds it) the exclusive lock of ``save_dir``. Returns a note when a lock left
    by a finished/dead job was taken over; raises CheckpointError naming the lock file and its holder when another
    live job holds it. Call on one rank (rank 0)."""
    key = os.path.realpath(save_dir)
    if key in _HELD:
        return None
    path = os.path.join(save_dir, LOCK_FILENAME)
    for _ in range(10):  # retry when the file was replaced between open and flock
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                info = _current_owner(path)
                raise CheckpointError(
                    f"--save {save_dir} is in use by another job: lock file {path} is held by "
                    f"{_owner_text(info) if info else 'an unknown process'}; two jobs must not save into one "
                    f"directory (use another --save, or stop the other job)"
                ) from None
            raise CheckpointError(f"cannot lock {path} (--save {save_dir}): {e}") from e
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        previous = _read_owner(path)
        info = {"host": socket.gethostname(), "pid": os.getpid(),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(fd)
        _HELD[key] = fd
        if previous and previous.get("pid") != os.getpid():
            dead = previous.get("host") == info["host"] and not _pid_alive(previous.get("pid"))
            return (f"took over the stale lock {path} left by {_owner_text(previous)}"
                    f"{' (that process is no longer running)' if dead else ' (its lock was released)'}")
        return None
    raise CheckpointError(f"cannot lock {path} (--save {save_dir}): the lock file keeps being replaced")


def release_save_lock(save_dir: str) -> None:
    """Drop this process's lock of ``save_dir`` (removes the lock file while still holding it)."""
    fd = _HELD.pop(os.path.realpath(save_dir), None)
    if fd is None:
        return
    try:
        os.unlink(os.path.join(save_dir, LOCK_FILENAME))
    except OSError:
        pass
    os.close(fd)


@atexit.register
def _release_all() -> None:
    for key in list(_HELD):
        release_save_lock(key)


# ---- start-up check -----------------------------------------------------------------------------------------
def check_save_dir(save_dir: str, flag: str = "--save") -> None:
    """Before training: ``save_dir`` exists (created), is writable (a probe file is written, synced, removed) and
    this job holds its lock. Collective: every rank raises the same CheckpointError naming ``flag`` otherwise."""
    error = None
    if dist_utils.get_rank() == 0:
        probe = os.path.join(save_dir, f".write_probe.{os.getpid()}")
        try:
            os.makedirs(save_dir, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"megatron")
                f.flush()
                os.fsync(f.fileno())
            os.unlink(probe)
        except OSError as e:
            error = f"{flag} {save_dir} is not writable: {describe_save_failure(e, save_dir)}"
        if error is None:
            try:
                note = acquire_save_lock(save_dir)
                if note:
                    print(f"WARNING: {note}", flush=True)
            except CheckpointError as e:
                error = str(e)
    broadcast_error_from_rank0(error)


# ---- atomic publication -------------------------------------------------------------------------------------
def partial_name(checkpoint_dir: str) -> str:
    return checkpoint_dir.rstrip(os.sep) + PARTIAL_SUFFIX


def remove_leftovers(save_dir: str) -> List[str]:
    """Remove what crashed saves left in ``save_dir`` (``iter_N.partial``, ``iter_N.replaced``, tracker temp
    files). Call only while holding the lock. Returns the removed names."""
    removed = []
    for name in sorted(os.listdir(save_dir)):
        if _LEFTOVER.match(name):
            path = os.path.join(save_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(name)
    return removed


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(partial_dir: str, checkpoint_dir: str) -> None:
    """Rename the finished ``partial_dir`` to ``checkpoint_dir``. An existing ``checkpoint_dir`` (the same iteration
    saved again) is moved to ``<name>.replaced`` first and removed after."""
    replaced = None
    if os.path.lexists(checkpoint_dir):
        replaced = checkpoint_dir.rstrip(os.sep) + REPLACED_SUFFIX
        os.rename(checkpoint_dir, replaced)
    os.rename(partial_dir, checkpoint_dir)
    fsync_dir(os.path.dirname(checkpoint_dir.rstrip(os.sep)) or ".")
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


# ---- nothing replaced, nothing orphaned ---------------------------------------------------------------------
def complete_checkpoints(save_dir: str) -> List[int]:
    """Iterations of the complete checkpoints in ``save_dir``, sorted: ``iter_N`` directories holding DCP's
    ``.metadata`` (written last by every save, ours and upstream's)."""
    try:
        names = os.listdir(save_dir)
    except OSError:
        return []
    found = []
    for name in names:
        m = _CHECKPOINT_DIR.match(name)
        if m and os.path.isfile(os.path.join(save_dir, name, ".metadata")):
            found.append(int(m.group(1)))
    return sorted(found)


def short_list(items: Iterable, limit: int = 6, sep: str = ", ") -> str:
    """``a, b, c``: at most ``limit`` items named, then how many more."""
    items = [str(i) for i in items]
    more = f"{sep}... ({len(items) - limit} more)" if len(items) > limit else ""
    return sep.join(items[:limit]) + more


def checkpoint_names(iterations: Iterable[int]) -> str:
    return short_list(f"iter_{i:07d}" for i in iterations)


def overwrite_problem(save_dir: str, first_iteration: int, tracker_iteration: Optional[int], what: str) -> Optional[str]:
    """Why saves of iterations ``first_iteration`` and later into ``save_dir`` would lose a checkpoint: complete
    checkpoints at or after ``first_iteration`` would be replaced (or orphaned once the tracker names an earlier
    one), or the tracker (``tracker_iteration``, beyond ``first_iteration``) would move back. None when nothing is at stake. ``what`` names the
    saves in the message."""
    later = [n for n in complete_checkpoints(save_dir) if n >= first_iteration]
    back = tracker_iteration is not None and tracker_iteration > first_iteration
    if not later and not back:
        return None
    harm = ([f"replace or orphan {checkpoint_names(later)}"] if later else []) + (
        [f"move its tracker back from iteration {tracker_iteration}"] if back else [])
    return (f"--save {save_dir}: {what} would {' and '.join(harm)}; use another --save, resume from its latest "
            f"checkpoint (--load {save_dir} without --finetune/--ckpt-step), or pass --ckpt-overwrite to replace them")


def missing_tracker_problem(load_dir: str, tracker: str) -> Optional[str]:
    """Why ``load_dir`` without a tracker must not mean "train from scratch": it holds complete checkpoints."""
    found = complete_checkpoints(load_dir)
    if not found:
        return None
    return (f"--load {load_dir} has no tracker {os.path.basename(tracker)} but holds {checkpoint_names(found)}: "
            f"resume from the latest with --ckpt-step {found[-1]}, or pass --ckpt-fresh-start to train from random "
            f"initialization")


def set_aside_non_finite(partial_dir: str, checkpoint_dir: str) -> str:
    """Rename the finished ``partial_dir`` of a save holding NaN/Inf to ``<iter_N>.nonfinite`` (an earlier one of
    that name is replaced); returns that name. The tracker is left alone."""
    aside = checkpoint_dir.rstrip(os.sep) + NONFINITE_SUFFIX
    if os.path.lexists(aside):
        shutil.rmtree(aside, ignore_errors=True)
    os.rename(partial_dir, aside)
    fsync_dir(os.path.dirname(aside) or ".")
    return aside


# ---- resume checks ------------------------------------------------------------------------------------------
# Arguments that decide the shapes (or the meaning) of the model's weights. (name, default when absent)
MODEL_ARGS = (
    ("num_layers", None), ("hidden_size", None), ("ffn_hidden_size", None), ("num_attention_heads", None),
    ("kv_channels", None), ("group_query_attention", False), ("num_query_groups", 1),
    ("max_position_embeddings", None), ("position_embedding_type", "learned_absolute"),
    ("normalization", "LayerNorm"), ("swiglu", False), ("add_bias_linear", True), ("add_qkv_bias", False),
    ("untie_embeddings_and_output_weights", False), ("num_experts", None), ("moe_ffn_hidden_size", None),
    ("moe_layer_freq", 1), ("quick_geglu", False), ("multi_latent_attention", False), ("q_lora_rank", None), ("kv_lora_rank", 32),
    ("qk_head_dim", 128), ("qk_pos_emb_head_dim", 64), ("v_head_dim", 128),
)  # Parallel sizes are not compared: torch_dist checkpoints reshard (upstream skips them with dist ckpt too). Nor is
# ``padded_vocab_size`` (upstream does not with dist ckpt): the padding depends on TP, and the word-embedding and
# output-layer rows load where both have them (``vocab_padding_note``).


def checkpoint_args_mismatches(ckpt_args, args) -> List[Tuple[str, object, object]]:
    """(name, checkpoint value, run value) for each model-shape argument that differs. Arguments the checkpoint
    does not store are skipped; ``num_query_groups`` only counts with grouped-query attention on either side;
    ``moe_ffn_hidden_size`` only with experts."""
    out = []
    for name, default in MODEL_ARGS:
        if not hasattr(ckpt_args, name):
            continue
        old, new = getattr(ckpt_args, name), getattr(args, name, default)
        if name == "num_query_groups" and not (getattr(ckpt_args, "group_query_attention", False)
                                               or getattr(args, "group_query_attention", False)):
            continue
        if name in ("moe_ffn_hidden_size", "moe_layer_freq") and not (
                getattr(ckpt_args, "num_experts", None) or getattr(args, "num_experts", None)):
            continue
        if name in _MLA_SIZES and not (getattr(ckpt_args, "multi_latent_attention", False)
                                       or getattr(args, "multi_latent_attention", False)):
            continue
        if old != new:
            out.append((name, old, new))
    return out


_MLA_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")  # only with MLA


def _optimizer_kind(a) -> str:
    """The optimizer-state layout a run's arguments write and read: ``distopt`` (the distributed optimizer, also
    Megatron-FSDP's ``optim`` strategy, a DDP wrapper), ``fsdp`` (Megatron-FSDP on FSDP2) or ``ddp``."""
    if getattr(a, "use_megatron_fsdp", False):
        strategy = getattr(a, "data_parallel_sharding_strategy", None) or "optim_grads_params"
        return {"optim": "distopt", "no_shard": "ddp"}.get(strategy, "fsdp")
    return "distopt" if getattr(a, "use_distributed_optimizer", False) else "ddp"


_KIND_FLAGS = {"distopt": "--use-distributed-optimizer", "fsdp": "--use-megatron-fsdp",
               "ddp": "DDP without --use-distributed-optimizer"}


def _saved_optimizer_form(common) -> Tuple[bool, set]:
    """(whether a checkpoint's optimizer state is chained, its distributed-optimizer sharding types) from its common
    state: upstream's chained dense + expert optimizers are ``{0: ..., 1: ...}`` under ``optimizer``."""
    opt = common.get("optimizer") if isinstance(common, dict) else None
    if not isinstance(opt, dict):
        return False, set()
    chained = bool(opt) and all(isinstance(k, int) for k in opt)
    parts = list(opt.values()) if chained else [opt]
    kinds = {p.get("param_state_sharding_type") for p in parts if isinstance(p, dict)} - {None}
    return chained, kinds


def optimizer_layout_problem(ckpt_args, ckpt_keys: Iterable[str], args, common=None) -> Optional[str]:
    """Why the optimizer state of a checkpoint (saved with ``ckpt_args``; its tensor keys; its common state) cannot
    load into this run's optimizer, or None. DDP and Megatron-FSDP read each other's and the distributed optimizer's
    unchained ``fully_reshardable`` / ``fully_sharded_model_space`` state (the fp32 main params from the optimizer
    state or the fp32 model weights: ``MegatronOptimizer.sharded_state_dict``); the distributed optimizer reads its
    own layouts only. A checkpoint without optimizer state is left to the load (it names --no-load-optim)."""
    keys = list(ckpt_keys)
    if ckpt_args is None or not any(k.startswith(("optimizer.", "chained_")) for k in keys):
        return None
    saved, run = _optimizer_kind(ckpt_args), _optimizer_kind(args)
    way_out = "resume with --no-load-optim (the model weights load and the optimizer starts afresh), or with "
    if run == "distopt" and saved != "distopt":
        return (f"its optimizer state was saved by {_KIND_FLAGS[saved]}; {_KIND_FLAGS[run]} reads its own "
                f"optimizer-state layouts only: {way_out}the saving run's engine (DDP and Megatron-FSDP load this "
                f"state)")
    if run == "distopt":
        return None
    chained, kinds = _saved_optimizer_form(common)
    if chained:
        return (f"its optimizer state is a distributed optimizer's chained dense and expert optimizers (expert "
                f"parallelism); this run's {_KIND_FLAGS[run]} reads one optimizer's state: {way_out}"
                f"--use-distributed-optimizer")
    if "dp_reshardable" in kinds:
        return (f"its optimizer state is a distributed optimizer's dp_reshardable layout (by gradient buckets); "
                f"this run's {_KIND_FLAGS[run]} reads states by parameter only: {way_out}--use-distributed-optimizer")
    return None


def format_mismatches(mismatches) -> str:
    return ", ".join(f"{name} (checkpoint {old!r} vs run {new!r})" for name, old, new in mismatches)


NON_MODEL_TENSOR_PREFIXES = ("optimizer.", "chained_")  # upstream's chained dp_reshardable: chained_<i>.optimizer...


def _rows_may_differ(key: str, model_shape: tuple, ckpt_shape: tuple, resizable) -> bool:
    """A tensor marked ``allow_shape_mismatch`` (the word embedding, the output layer: the padded vocabulary) whose
    shapes differ only in the number of rows."""
    return key in resizable and len(model_shape) == len(ckpt_shape) and tuple(model_shape[1:]) == tuple(ckpt_shape[1:])


def model_key_problems(requested: Dict[str, tuple], ckpt_shapes: Dict[str, tuple], resizable=()) -> List[str]:
    """Problems of loading a model whose tensors are ``requested`` ({key: global shape}) from a checkpoint holding
    ``ckpt_shapes`` ({key: global shape}, every tensor): tensors of the model missing from the checkpoint, global
    shapes that differ (but the row count of ``resizable`` keys), and checkpoint tensors the model does not have
    (every tensor outside ``optimizer.*``, the optimizer state's namespace, is a model tensor)."""
    problems = []
    for key in sorted(requested):
        if key not in ckpt_shapes:
            problems.append(f"model key {key} is not in the checkpoint")
        elif tuple(ckpt_shapes[key]) != tuple(requested[key]) and not _rows_may_differ(
                key, requested[key], ckpt_shapes[key], resizable):
            problems.append(f"model key {key}: checkpoint shape {tuple(ckpt_shapes[key])}, "
                            f"model shape {tuple(requested[key])}")
    unexpected = sorted(k for k in ckpt_shapes if k not in requested and not k.startswith(NON_MODEL_TENSOR_PREFIXES))
    if unexpected:
        problems.append(f"unexpected model keys in the checkpoint (not in the model): {short_list(unexpected, 4)}")
    return problems


def vocab_padding_note(requested: Dict[str, tuple], ckpt_shapes: Dict[str, tuple], resizable) -> Optional[str]:
    """One line when the vocabulary padding differs between the checkpoint and the model (upstream allows it:
    the padding is a multiple of ``--make-vocab-size-divisible-by`` x TP): which rows load, which checkpoint rows are
    dropped or which model rows are zero (as upstream's load pads them); None when nothing differs."""
    keys = sorted(k for k in resizable if k in ckpt_shapes and k in requested
                  and tuple(ckpt_shapes[k]) != tuple(requested[k])
                  and _rows_may_differ(k, requested[k], ckpt_shapes[k], resizable))
    if not keys:
        return None
    ckpt_rows, model_rows = ckpt_shapes[keys[0]][0], requested[keys[0]][0]
    kept = min(ckpt_rows, model_rows)
    rest = (f"checkpoint rows {kept}-{ckpt_rows - 1} dropped" if ckpt_rows > model_rows
            else f"model rows {kept}-{model_rows - 1} are zero (padding, as upstream)")
    return (f"vocabulary padding differs ({', '.join(keys)}): checkpoint {ckpt_rows} rows, model {model_rows}: "
            f"rows 0-{kept - 1} loaded, {rest}")


# ---- weights finite -----------------------------------------------------------------------------------------
def first_non_finite(named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> Optional[str]:
    """Name of the first floating-point tensor holding NaN or Inf (local data of DTensors; quantized tensors
    dequantized one at a time), else None. One read of each tensor (``aminmax``: NaN propagates to both extremes,
    an Inf is one; no mask tensor) and one host sync for all of them."""
    from megatron.core.fp8_utils import dequantize, is_quantized_tensor

    names, extremes = [], []
    for name, t in named_tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        if is_quantized_tensor(t):
            t = dequantize(t)
        elif hasattr(t, "to_local"):
            t = t.to_local()
        if t.is_floating_point() and t.numel():
            lo, hi = torch.aminmax(t.detach())
            names.append(name)
            extremes.append(torch.stack([lo, hi]).float().to(extremes[0].device if extremes else lo.device))
    if not names:
        return None
    bad = (~torch.isfinite(torch.stack(extremes)).all(dim=1)).nonzero().flatten().tolist()
    return names[bad[0]] if bad else None


def first_non_finite_shard(state_dict: dict) -> Optional[str]:
    """Key of the first ShardedTensor (or factory) of a sharded state dict whose local data holds NaN or Inf: the
    tensors a save writes from this rank (model and optimizer state)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    return first_non_finite((v.key, v.data) for v in nested_values(state_dict)
                            if isinstance(v, (ShardedTensor, ShardedTensorFactory)))
