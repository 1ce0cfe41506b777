"""Save and load training checkpoints in upstream's ``torch_dist`` layout through ``megatron.core.dist_checkpointing``.

Layout::

    <save>/latest_checkpointed_iteration.txt     the iteration number (written last, atomically)
    <save>/iter_0000100/                          one dist checkpoint (model, optimizer, scheduler, RNG, args)

State dict keys (upstream's): ``model`` (the model's ``sharded_state_dict()``), ``optimizer``
(``optimizer.sharded_state_dict(model_sharded_sd)``), ``opt_param_scheduler``, ``rng_state`` (a ShardedObject
written by data-parallel rank 0, ``replica_id`` = DP rank, so a different DP size loads it), ``iteration``,
``args`` (with ``consumed_train_samples``), ``checkpoint_version``, ``num_floating_point_operations_so_far``.

The tracker is advanced only after every rank finished its part of the save (a success flag is all-reduced),
so a save that fails midway leaves the previous checkpoint as the latest.
"""
import os
import random
import sys
import time
from typing import Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing, parallel_state
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0, unwrap_model

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or unreadable; the message names the directory or file."""


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _barrier() -> None:
    if _dist():
        dist.barrier()


def get_checkpoint_tracker_filename(checkpoints_path: str) -> str:
    return os.path.join(checkpoints_path, TRACKER_FILENAME)


def get_checkpoint_name(checkpoints_path: str, iteration: int, release: bool = False, **unused) -> str:
    """``<path>/iter_0000100`` (``<path>/release`` for a release checkpoint)."""
    directory = "release" if release else "iter_{:07d}".format(iteration)
    return os.path.join(checkpoints_path, directory)


def read_metadata(tracker_filename: str) -> Tuple[int, bool]:
    """(iteration, release) from a tracker file."""
    try:
        with open(tracker_filename) as f:
            text = f.read().strip()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint tracker {tracker_filename}: {e}") from e
    if text == "release":
        return 0, True
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointError(f"checkpoint tracker {tracker_filename}: expected an iteration or 'release', got {text!r}")
    if iteration < 0:
        raise CheckpointError(f"checkpoint tracker {tracker_filename}: negative iteration {iteration}")
    if _dist():  # every rank must agree on what it read
        t = torch.tensor([iteration, -iteration], dtype=torch.long, device=parallel_state.collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if int(t[0]) != iteration or int(-t[1]) != iteration:
            raise CheckpointError(f"checkpoint tracker {tracker_filename}: ranks read different iterations")
    return iteration, False


def _write_tracker(save_dir: str, iteration: int) -> None:
    path = get_checkpoint_tracker_filename(save_dir)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---- RNG --------------------------------------------------------------------------------------------------
def get_rng_state():
    """This rank's RNG states as upstream's ``rng_state`` ShardedObject (written by DP rank 0 only)."""
    from megatron.core.dist_checkpointing import ShardedObject

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": {},
    }
    return ShardedObject("rng_state", [state], (1, 1), (0, 0), replica_id=parallel_state.get_data_parallel_rank())


def set_rng_state(rng_state) -> None:
    state = rng_state[0] if isinstance(rng_state, (list, tuple)) else rng_state
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("cuda_rng_state") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])


# ---- state dict ---------------------------------------------------------------------------------------------
def _chunks(model):
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _model_sharded_state_dict(model_chunk) -> dict:
    if hasattr(model_chunk, "sharded_state_dict"):
        return model_chunk.sharded_state_dict()
    return unwrap_model(model_chunk).sharded_state_dict()


def generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, iteration: int,
                        is_loading: bool = False, optim_sd_kwargs=None, num_floating_point_operations_so_far=0):
    chunks = _chunks(model)
    state_dict = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                  "num_floating_point_operations_so_far": num_floating_point_operations_so_far}
    if len(chunks) == 1:
        state_dict["model"] = _model_sharded_state_dict(chunks[0])
    else:
        for i, chunk in enumerate(chunks):
            state_dict[f"model{i}"] = _model_sharded_state_dict(chunk)
    if optimizer is not None:
        model_sd = state_dict["model"] if len(chunks) == 1 else {
            k: v for i in range(len(chunks)) for k, v in state_dict[f"model{i}"].items()}
        state_dict["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                               **(optim_sd_kwargs or {}))
    if opt_param_scheduler is not None:
        state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if rng_state is not None:
        state_dict["rng_state"] = rng_state
    return state_dict


def _parallelization_group():
    """The data-parallel group for the fully-parallel wrappers; None (= WORLD) when it spans every rank, as it
    always does in this DP-only fork."""
    group = parallel_state.get_data_parallel_group()
    if group is None or not _dist() or dist.get_world_size(group) == dist.get_world_size():
        return None
    return group


def _save_strategy(args):
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    if args.ckpt_fully_parallel_save:
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        strategy = FullyParallelSaveStrategyWrapper(strategy, _parallelization_group())
    return strategy


def _load_strategy(args):
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    strategy = TorchDistLoadShardedStrategy(stream_ckpt_dequant=bool(args.stream_ckpt_dequant))
    if args.ckpt_fully_parallel_load:
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

        strategy = FullyParallelLoadStrategyWrapper(strategy, _parallelization_group())
    return strategy


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far=0,
                    checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None,
                    pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False,
                    train_data_iterator=None, preprocess_common_state_dict_fn=None, save_dir=None):
    """Save ``<save>/iter_<iteration>/`` on all ranks, then (after all ranks succeeded) advance the tracker."""
    args = get_args()
    save_dir = save_dir or args.save
    if not save_dir:
        raise CheckpointError("save_checkpoint: no directory (--save)")
    if args.ckpt_format != "torch_dist":
        raise CheckpointError(f"--ckpt-format {args.ckpt_format}: only torch_dist is supported")
    checkpoint_dir = get_checkpoint_name(save_dir, iteration)
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {save_dir} in torch_dist format")
    if _rank() == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
    _barrier()

    ok, error, request = True, None, None
    async_save = bool(getattr(args, "async_save", False))
    if async_save:
        maybe_finalize_async_save(blocking=True)  # the previous save completes (and advances the tracker) first
    start = time.time()
    strategy = _save_strategy(args)
    try:
        rng_state = None if args.no_save_rng else get_rng_state()
        state_dict = generate_state_dict(
            args, model, None if args.no_save_optim else optimizer, opt_param_scheduler, rng_state, iteration,
            num_floating_point_operations_so_far=num_floating_point_operations_so_far,
        )
        request = dist_checkpointing.save(state_dict, checkpoint_dir, sharded_strategy=strategy,
                                          async_sharded_save=async_save)
    except Exception as e:  # decide together whether the save completed (async: whether it could be scheduled)
        ok, error = False, e
    if _dist():
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=parallel_state.collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        all_ok = bool(flag.item())
    else:
        all_ok = ok
    if not all_ok:
        where = f"{type(error).__name__}: {error}" if error is not None else "failed on another rank"
        raise CheckpointError(
            f"saving checkpoint {checkpoint_dir} failed ({where}); "
            f"{get_checkpoint_tracker_filename(save_dir)} was not advanced"
        ) from error
    if request is None:
        _finalize_save(save_dir, iteration)
        return
    request.add_finalize_fn(lambda: _finalize_save(save_dir, iteration, scheduled_at=start))
    _schedule_async_save(request, iteration, save_dir, start, strategy)


def _finalize_save(save_dir: str, iteration: int, scheduled_at: Optional[float] = None) -> None:
    """The end of a save, after every rank wrote its part: the one place that advances the tracker."""
    if _rank() == 0:
        _write_tracker(save_dir, iteration)
    _barrier()
    how = "" if scheduled_at is None else f" (asynchronous: finished {time.time() - scheduled_at:.2f} s after it was scheduled)"
    print_rank_0(f"  successfully saved checkpoint from iteration {iteration:7d} to {save_dir}{how}")


# ---- asynchronous save (--async-save) ---------------------------------------------------------------------------
_async_queue = None


def _schedule_async_save(request, iteration: int, save_dir: str, start: float, strategy) -> None:
    """Take the CPU copy now and write in the background (``--async-save``); the tracker advances in
    ``maybe_finalize_async_save`` once every rank finished."""
    global _async_queue
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, resolve_async_strategy

    args = get_args()
    if _async_queue is None:
        resolve_async_strategy(getattr(args, "async_strategy", "nvrx"))
        _async_queue = AsyncCallsQueue(persistent=bool(getattr(args, "use_persistent_ckpt_worker", False)))
    _async_queue.schedule_async_request(request)
    staged = getattr(getattr(strategy, "base_strategy", strategy), "last_staged_bytes", None)
    print_rank_0(f"  scheduled asynchronous checkpoint save of iteration {iteration:7d} to {save_dir}: training "
                 f"blocked {time.time() - start:.3f} s, {staged} bytes staged to CPU on rank 0")


def maybe_finalize_async_save(blocking: bool = False, terminate: bool = False) -> None:
    """Finalize (advance the tracker of) the asynchronous saves that finished on every rank; ``blocking``: wait for
    all of them; ``terminate``: then stop the background worker. Collective: call on every rank."""
    global _async_queue
    if _async_queue is None:
        return
    _async_queue.maybe_finalize_async_calls(blocking=blocking)
    if terminate:
        _async_queue.close()
        _async_queue = None


def _find_checkpoint(load_dir: str, args) -> Optional[Tuple[int, bool, str]]:
    """(iteration, release, checkpoint dir), or None when there is no tracker and no --ckpt-step."""
    tracker = get_checkpoint_tracker_filename(load_dir)
    step = getattr(args, "ckpt_step", None)
    if step is not None:
        iteration, release = step, False
    elif not os.path.isfile(tracker):
        return None
    else:
        iteration, release = read_metadata(tracker)
    checkpoint_dir = get_checkpoint_name(load_dir, iteration, release)
    if not os.path.isdir(checkpoint_dir):
        src = f"--ckpt-step {step}" if step is not None else f"the tracker {tracker}"
        raise CheckpointError(f"checkpoint directory {checkpoint_dir} (iteration {iteration}, from {src}) does not exist")
    return iteration, release, checkpoint_dir


def _copy_model_values(model_chunk, sharded_sd: dict, loaded: dict, strict: bool) -> None:
    """Write loaded values into the model's tensors (a no-op where the load already wrote in place)."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor, ShardedTensorFactory

    base = unwrap_model(model_chunk)
    missing = [k for k in sharded_sd if k not in loaded]
    if missing and strict:
        raise CheckpointError(f"checkpoint is missing model keys: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    with torch.no_grad():
        for key, sh in sharded_sd.items():
            if key not in loaded:
                continue
            value = loaded[key]
            if isinstance(sh, (ShardedTensor, ShardedTensorFactory)):  # a factory (gated fc1): its merged value
                dest = sh.data
                if isinstance(value, ShardedTensor):
                    value = value.data
                if value is not dest and isinstance(value, torch.Tensor):
                    if value.shape != dest.shape:
                        raise CheckpointError(f"model key {key}: loaded shape {tuple(value.shape)}, "
                                              f"model shape {tuple(dest.shape)}")
                    dest.copy_(value)
            elif isinstance(sh, ShardedObject) and key.endswith("_extra_state"):
                module = base.get_submodule(key[: -len("._extra_state")]) if "." in key else base
                try:
                    module.set_extra_state(value)
                except Exception as e:  # name the key: the module's own error cannot
                    raise CheckpointError(f"model key {key}: {e}") from e


def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg="load", strict=True, checkpointing_context=None,
                    skip_load_to_model_and_optimizer=False):
    """Load the latest (or ``--ckpt-step``) checkpoint of ``args.<load_arg>``.

    Returns ``(iteration, num_floating_point_operations_so_far)``; ``(0, 0)`` when there is no checkpoint
    (an error with ``--exit-on-missing-checkpoint``). ``--finetune``: the model only, iteration 0.
    ``--no-load-optim`` / ``--no-load-rng``: skip those parts. Sets ``args.consumed_train_samples``.
    """
    args = get_args()
    load_dir = getattr(args, load_arg)
    if not load_dir:
        return 0, 0
    found = _find_checkpoint(load_dir, args)
    if found is None:
        tracker = get_checkpoint_tracker_filename(load_dir)
        if args.exit_on_missing_checkpoint:
            raise CheckpointError(f"--exit-on-missing-checkpoint: no checkpoint tracker {tracker} in --{load_arg.replace('_', '-')} {load_dir}")
        print_rank_0(f"WARNING: no checkpoint tracker {tracker}; training from random initialization")
        return 0, 0
    iteration, release, checkpoint_dir = found
    print_rank_0(f"loading checkpoint from {load_dir} at iteration {iteration} (torch_dist)")

    load_optim = optimizer is not None and not (args.no_load_optim or args.finetune or release)
    load_rng = not (args.no_load_rng or args.finetune or release)
    chunks = _chunks(model)
    state_dict = generate_state_dict(
        args, model, optimizer if load_optim else None, opt_param_scheduler if load_optim else None,
        get_rng_state() if load_rng else None, iteration, is_loading=True,
    )
    for key in ("args", "checkpoint_version", "iteration", "num_floating_point_operations_so_far"):
        state_dict.pop(key, None)  # common state comes from the checkpoint
    sharded_model_sds = {k: v for k, v in state_dict.items() if k == "model" or k.startswith("model")}
    if opt_param_scheduler is not None and load_optim:
        state_dict.pop("opt_param_scheduler")  # a plain dict: comes from the checkpoint's common state
    strategy = _load_strategy(args)
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        mem_before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    try:
        with torch.no_grad():  # values land in place in parameters (leaves that require grad)
            loaded = dist_checkpointing.load(state_dict, checkpoint_dir, sharded_strategy=strategy,
                                             strict=args.dist_ckpt_strictness)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {checkpoint_dir} is incomplete: {e}") from e
    if on_cuda:
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - mem_before) / 2**20
        mem = f", peak GPU memory above the pre-load baseline {peak:.1f} MiB"
    else:
        mem = ""
    print_rank_0(f"  dist_checkpointing.load took {time.perf_counter() - start:.3f} s"
                 f" (stream_ckpt_dequant={getattr(strategy, 'stream_ckpt_dequant', False)}){mem}")

    if not skip_load_to_model_and_optimizer:
        if len(chunks) == 1:
            _copy_model_values(chunks[0], sharded_model_sds["model"], loaded["model"], strict)
        else:
            for i, chunk in enumerate(chunks):
                _copy_model_values(chunk, sharded_model_sds[f"model{i}"], loaded[f"model{i}"], strict)
        if load_optim:
            if "optimizer" not in loaded:
                raise CheckpointError(f"checkpoint {checkpoint_dir} has no optimizer state (use --no-load-optim)")
            optimizer.load_state_dict(loaded["optimizer"])
    if opt_param_scheduler is not None and load_optim:
        if "opt_param_scheduler" not in loaded:
            raise CheckpointError(f"checkpoint {checkpoint_dir} has no opt_param_scheduler state")
        opt_param_scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if load_rng:
        if "rng_state" not in loaded:
            raise CheckpointError(f"checkpoint {checkpoint_dir} has no rng_state (use --no-load-rng)")
        set_rng_state(loaded["rng_state"])

    ckpt_args = loaded.get("args")
    if args.finetune or release:
        iteration = 0
        args.consumed_train_samples = 0
        args.consumed_valid_samples = 0
    else:
        iteration = int(loaded.get("iteration", iteration))
        args.consumed_train_samples = int(getattr(ckpt_args, "consumed_train_samples", 0))
        args.consumed_valid_samples = int(getattr(ckpt_args, "consumed_valid_samples", 0))
    _barrier()
    print_rank_0(f"  successfully loaded checkpoint from {load_dir} at iteration {iteration}")
    return iteration, int(loaded.get("num_floating_point_operations_so_far", 0) or 0)
