"""Save and load training checkpoints in upstream's ``torch_dist`` layout through ``megatron.core.dist_checkpointing``.

Layout::

    <save>/latest_checkpointed_iteration.txt     the iteration number (written last, atomically)
    <save>/iter_0000100/                          one dist checkpoint (model, optimizer, scheduler, RNG, args)

State dict keys (upstream's): ``model`` (the model's ``sharded_state_dict()``), ``optimizer``
(``optimizer.sharded_state_dict(model_sharded_sd)``), ``opt_param_scheduler``, ``rng_state`` (a ShardedObject
written by data-parallel rank 0, ``replica_id`` = DP rank, so a different DP size loads it), ``iteration``,
``args`` (with ``consumed_train_samples``), ``checkpoint_version``, ``num_floating_point_operations_so_far``.

Content metadata (upstream's ``_build_sharded_state_dict_metadata``, stored in the common state): the distributed
optimizer's ``distrib_optim_sharding_type`` (written: ``fully_reshardable``, see ``sharded_sd_metadata``),
``singleton_local_shards`` False and ``chained_optim_avoid_prefix`` True. A load passes the checkpoint's own content
metadata to ``optimizer.sharded_state_dict`` (as upstream), so the layout a checkpoint was written in is the one read;
a checkpoint without it (this fork's older ones) is read as ``fully_sharded_model_space``.

A save is written to ``<save>/iter_N.partial`` and renamed to ``iter_N`` only after every rank finished (a success
flag is all-reduced); the tracker is advanced after the rename, so a save that fails or is killed midway leaves the
previous checkpoint as the latest, and its leftovers are removed by the next save. Rank 0 holds an exclusive lock on
the save root for the whole job (``checkpoint_safety``). A load checks the model-shape arguments stored in the
checkpoint and the model's tensor keys/shapes against the run before any tensor is read.
"""
import os
import random
import shutil
import time
import warnings
from typing import Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_utils import barrier, get_rank, get_world_size, is_distributed
from megatron.training import checkpoint_safety as safety
from megatron.training.checkpoint_safety import CheckpointError  # noqa: F401  (its public home for callers)
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0, unwrap_model

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
NON_PERSISTENT_SUBDIR = "non_persistent"  # upstream's: <save>/non_persistent/iter_N (global non-persistent saves)
_saved_once = False  # --ckpt-assume-constant-structure: the first save of the process validates the sharding
CHECKPOINT_VERSION = 3.0
_TRACKER_MAX_BYTES = 4096


def get_checkpoint_tracker_filename(checkpoints_path: str) -> str:
    return os.path.join(checkpoints_path, TRACKER_FILENAME)


def get_checkpoint_name(checkpoints_path: str, iteration: int, release: bool = False, **unused) -> str:
    """``<path>/iter_0000100`` (``<path>/release`` for a release checkpoint)."""
    directory = "release" if release else "iter_{:07d}".format(iteration)
    return os.path.join(checkpoints_path, directory)


def read_metadata(tracker_filename: str) -> Tuple[int, bool]:
    """(iteration, release) from a tracker file (collective when distributed: every rank must read the same)."""
    iteration, release = _parse_tracker(tracker_filename)
    if release:
        return 0, True
    if is_distributed():  # every rank must agree on what it read
        t = torch.tensor([iteration, -iteration], dtype=torch.long, device=parallel_state.collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if int(t[0]) != iteration or int(-t[1]) != iteration:
            raise CheckpointError(f"checkpoint tracker {tracker_filename}: ranks read different iterations")
    return iteration, False


def _tracker_iteration(save_dir: str) -> Optional[int]:
    """The iteration the tracker of ``save_dir`` names, by this process alone; None without a (readable, numeric)
    tracker."""
    tracker = get_checkpoint_tracker_filename(save_dir)
    if not os.path.isfile(tracker):
        return None
    try:
        iteration, release = _parse_tracker(tracker)
    except CheckpointError:
        return None
    return None if release else iteration


def _parse_tracker(tracker_filename: str) -> Tuple[int, bool]:
    try:
        with open(tracker_filename, "rb") as f:
            raw = f.read(_TRACKER_MAX_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint tracker {tracker_filename}: {e}") from e
    if len(raw) > _TRACKER_MAX_BYTES:
        raise CheckpointError(f"checkpoint tracker {tracker_filename} is not a tracker: over {_TRACKER_MAX_BYTES} "
                              f"bytes (it holds an iteration number or 'release')")
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"checkpoint tracker {tracker_filename} holds binary data, not an iteration or "
                              f"'release' (first bytes {raw[:16]!r})") from None
    if text == "release":
        return 0, True
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointError(f"checkpoint tracker {tracker_filename}: expected an iteration or 'release', got {text!r}")
    if iteration < 0:
        raise CheckpointError(f"checkpoint tracker {tracker_filename}: negative iteration {iteration}")
    return iteration, False


def _write_tracker(save_dir: str, iteration: int) -> None:
    path = get_checkpoint_tracker_filename(save_dir)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    safety.fsync_dir(save_dir)


# ---- RNG --------------------------------------------------------------------------------------------------
def get_rng_state():
    """This rank's RNG states as upstream's ``rng_state`` ShardedObject: one per (pipeline, tensor)-parallel rank
    (shape ``(pp, tp)``, offset ``(pp_rank, tp_rank)``), written by DP rank 0 only; with the model-parallel tracker's
    states."""
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }
    tp, tp_rank = (parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_tensor_model_parallel_rank())
    pp, pp_rank = (parallel_state.get_pipeline_model_parallel_world_size(),
                   parallel_state.get_pipeline_model_parallel_rank())
    return ShardedObject("rng_state", [state], (pp, tp), (pp_rank, tp_rank),
                         replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))


def set_rng_state(rng_state) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = rng_state[0] if isinstance(rng_state, (list, tuple)) else rng_state
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("cuda_rng_state") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    if state.get("rng_tracker_states"):
        get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _checkpoint_model_parallel_sizes(checkpoint_dir) -> Tuple[int, int]:
    """The (--tensor-model-parallel-size, --pipeline-model-parallel-size) a checkpoint was saved with (its args; 1
    when absent)."""
    ckpt_args = dist_checkpointing.load_common_state_dict(checkpoint_dir).get("args")
    return (int(getattr(ckpt_args, "tensor_model_parallel_size", 1) or 1),
            int(getattr(ckpt_args, "pipeline_model_parallel_size", 1) or 1))


# ---- state dict ---------------------------------------------------------------------------------------------
def _chunks(model):
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _model_sharded_state_dict(model_chunk) -> dict:
    if hasattr(model_chunk, "sharded_state_dict"):
        return model_chunk.sharded_state_dict()
    return unwrap_model(model_chunk).sharded_state_dict()


def sharded_sd_metadata(args) -> dict:
    """The content metadata a save writes and passes to ``sharded_state_dict`` (upstream's keys). The distributed
    optimizer without Megatron-FSDP is written in upstream's ``fully_reshardable`` layout with or without
    ``--dist-ckpt-optim-fully-reshardable``: upstream 0.19.2 loads it whatever its own flags (its load reads this
    metadata), it is keyed by parameter names and reshards over TP/PP/DP. Upstream's default ``dp_reshardable`` is
    keyed by upstream's bucket layout, which this fork reproduces from upstream's rules and module order (checked
    against upstream for dense, GQA and MoE GPTs, local layers on CPU): it is loaded, and written only where
    ``sharded_state_dict`` is asked for it."""
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if args.use_distributed_optimizer and not getattr(args, "use_megatron_fsdp", False):
        from megatron.core.optimizer.distrib_optimizer import FULLY_RESHARDABLE

        metadata["distrib_optim_sharding_type"] = FULLY_RESHARDABLE
    return metadata


def loaded_sd_metadata(checkpoint_dir: str) -> dict:
    """The content metadata a checkpoint was saved with (what ``sharded_state_dict`` is given for its load; read by
    rank 0, broadcast); this fork's checkpoints from before it was written: the distributed optimizer's
    ``fully_sharded_model_space``."""
    from megatron.core.optimizer.distrib_optimizer import FULLY_SHARDED_MODEL_SPACE

    found = [(_read_content_metadata(checkpoint_dir), _fp32_main_params_location(checkpoint_dir),
              _checkpoint_state_dtypes(checkpoint_dir)) if get_rank() == 0 else None]
    if get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)
    content, where, state_dtypes = found[0]
    metadata = dict(content or {})
    if state_dtypes is not None:  # the Adam moments' precision it was saved from (precision_aware.py)
        metadata["checkpoint_state_dtypes"] = state_dtypes
    metadata.setdefault("distrib_optim_sharding_type", FULLY_SHARDED_MODEL_SPACE)
    if where is not None:  # where the checkpoint keeps its fp32 main params (MegatronOptimizer.sharded_state_dict)
        metadata["checkpoint_fp32_main_params"] = where
    return metadata


def _fp32_main_params_location(checkpoint_dir: str) -> Optional[str]:
    """``optimizer.fp32_main_params_location`` of the checkpoint's tensor keys (from its DCP metadata); None where
    they cannot be read (the load then says why)."""
    from pathlib import Path

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.strategies.torch import read_dcp_metadata
    from megatron.core.optimizer.optimizer import fp32_main_params_location

    try:
        sdm = read_dcp_metadata(Path(checkpoint_dir)).state_dict_metadata
    except (CheckpointingException, OSError):
        return None
    return fp32_main_params_location(k for k, md in sdm.items() if isinstance(md, TensorStorageMetadata))


def _checkpoint_state_dtypes(checkpoint_dir: str) -> Optional[dict]:
    """The Adam moments' precision of the run that saved the checkpoint, from its args (``--exp-avg-dtype`` ...
    with ``--use-precision-aware-optimizer``, ours and upstream's); None where the args cannot be read."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.optimizer.precision_aware import checkpoint_state_dtypes

    try:
        saved_args = dist_checkpointing.load_common_state_dict(checkpoint_dir).get("args")
    except (CheckpointingException, OSError):
        return None
    return None if saved_args is None else checkpoint_state_dtypes(saved_args)


def _read_content_metadata(checkpoint_dir: str) -> Optional[dict]:
    """The checkpoint's content metadata, None where it has none or cannot be read (the load then says why)."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    try:
        with warnings.catch_warnings():  # DCP's note that a local (one-process) read is one
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            return dist_checkpointing.load_content_metadata(checkpoint_dir)
    except (CheckpointingException, OSError):
        return None


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
        model_sd = state_dict["model"] if len(chunks) == 1 else {  # chunk-prefixed: their local names repeat
            f"model{i}.{k}": v for i in range(len(chunks)) for k, v in state_dict[f"model{i}"].items()}
        state_dict["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                               **(optim_sd_kwargs or {}))
    if opt_param_scheduler is not None:
        state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if rng_state is not None:
        state_dict["rng_state"] = rng_state
    return state_dict


def _parallelization_group():
    """The data-parallel group for the fully-parallel wrappers; None (= WORLD) when it spans every rank, as it
    does without model parallelism (CP ranks are replicas too)."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if group is None or get_world_size(group) == get_world_size():
        return None
    return group


def _dist_save(args, model, optimizer, opt_param_scheduler, iteration, directory, strategy, async_save, validate,
               num_floating_point_operations_so_far=0, preprocess_common_state_dict_fn=None, check_finite=True):
    """``dist_checkpointing.save`` of the training state into ``directory`` (collective): ``(AsyncRequest or None,
    the name of a non-finite tensor or None)``."""
    rng_state = None if args.no_save_rng else get_rng_state()
    metadata = sharded_sd_metadata(args)
    state_dict = generate_state_dict(
        args, model, None if args.no_save_optim else optimizer, opt_param_scheduler, rng_state, iteration,
        optim_sd_kwargs=dict(metadata=metadata),
        num_floating_point_operations_so_far=num_floating_point_operations_so_far,
    )
    non_finite = _non_finite_state(args, state_dict) if check_finite else None
    request = dist_checkpointing.save(
        state_dict, directory, sharded_strategy=strategy, async_sharded_save=async_save,
        validate_access_integrity=validate, content_metadata=metadata,
        preprocess_common_before_consistancy_check=preprocess_common_state_dict_fn or preprocess_common_state_dict)
    return request, non_finite


def warm_up_async_save(model, optimizer, opt_param_scheduler) -> None:
    """``--async-save``, before training (collective): stage the training state once into the host buffers every
    asynchronous save reuses (``strategies/host_staging.py``), writing nothing, so the run's first save does not
    spend its blocked time allocating (and, on CUDA, page-locking) them. The optimizer state is created as a save
    would create it (zeros, the values torch's lazy init gives: the first step is unchanged)."""
    from megatron.core.dist_checkpointing.strategies.host_staging import release_host_stagers

    args = get_args()
    start = time.time()
    unused_dir = os.path.join(args.save, ".async_save_warm_up")  # the destination a save needs; nothing is written
    if get_rank() == 0:
        os.makedirs(unused_dir, exist_ok=True)
    barrier()
    try:
        request, _ = _dist_save(args, model, optimizer, opt_param_scheduler, args.iteration, unused_dir,
                                _save_strategy(args), async_save=True, validate=False, check_finite=False)
        request.preload_fn()  # the staging copy only; the write (async_fn) never runs
    finally:
        release_host_stagers()
        barrier()
        if get_rank() == 0:
            shutil.rmtree(unused_dir, ignore_errors=True)
    print_rank_0(f"  asynchronous save: host staging buffers allocated before training in {time.time() - start:.3f} s")


def _save_strategy(args):
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    if args.ckpt_fully_parallel_save:
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        strategy = FullyParallelSaveStrategyWrapper(strategy, _parallelization_group())
    return strategy


def _load_strategy(args):
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    strategy = TorchDistLoadShardedStrategy(stream_ckpt_dequant=bool(args.stream_ckpt_dequant),
                                            stream_ckpt_dequant_chunk_mb=args.stream_ckpt_dequant_chunk_mb)
    if args.ckpt_fully_parallel_load:
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

        strategy = FullyParallelLoadStrategyWrapper(strategy, _parallelization_group())
    return strategy


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far=0,
                    checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None,
                    pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False,
                    train_data_iterator=None, preprocess_common_state_dict_fn=None, save_dir=None):
    """Save ``<save>/iter_<iteration>/`` on all ranks: write ``iter_N.partial``, rename it to ``iter_N`` when every
    rank finished, then advance the tracker. Holds (takes, if the start-up check did not) the save root's lock."""
    args = get_args()
    if non_persistent_ckpt:  # --non-persistent-ckpt-type global: its own directory and tracker, latest kept
        save_dir = save_dir or non_persistent_dir(args, args.save)
    save_dir = save_dir or args.save
    if not save_dir:
        raise CheckpointError("save_checkpoint: no directory (--save)")
    if args.ckpt_format != "torch_dist":
        raise CheckpointError(f"--ckpt-format {args.ckpt_format}: only torch_dist is supported")
    checkpoint_dir = get_checkpoint_name(save_dir, iteration)
    partial_dir = safety.partial_name(checkpoint_dir)
    async_save = bool(getattr(args, "async_save", False))
    if async_save:  # the previous save completes (is published, advances the tracker) before this one starts
        maybe_finalize_async_save(blocking=True)
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {save_dir} in torch_dist format")
    safety.check_save_dir(save_dir)  # a no-op lock-wise when this job already holds it
    error = None
    if get_rank() == 0 and not getattr(args, "ckpt_overwrite", False):
        error = safety.overwrite_problem(save_dir, iteration, _tracker_iteration(save_dir), f"saving iteration {iteration}")
    safety.broadcast_error_from_rank0(error)
    if get_rank() == 0:
        try:
            removed = safety.remove_leftovers(save_dir)
            if removed:
                print(f"  removed leftovers of an earlier unfinished save in {save_dir}: {removed}", flush=True)
            os.makedirs(partial_dir)
        except OSError as e:
            error = f"saving checkpoint {checkpoint_dir} failed: {safety.describe_save_failure(e, partial_dir)}"
    safety.raise_collectively(error)

    error, cause, request, non_finite = None, None, None, None
    safety.quiet_writer_threads()  # a writer thread's error is named in the save's one line, not printed
    start = time.time()
    strategy = _save_strategy(args)
    try:
        global _saved_once
        validate = not (getattr(args, "ckpt_assume_constant_structure", False) and _saved_once)
        _saved_once = True
        request, non_finite = _dist_save(args, model, optimizer, opt_param_scheduler, iteration, partial_dir, strategy,
                                         async_save, validate, num_floating_point_operations_so_far,
                                         preprocess_common_state_dict_fn)
    except Exception as e:  # decide together whether the save completed (async: whether it could be scheduled)
        error, cause = e, safety.describe_save_failure(e, partial_dir)
    tracker = get_checkpoint_tracker_filename(save_dir)
    try:
        safety.raise_collectively(cause)  # every rank has stopped writing once this returns or raises
    except CheckpointError as e:
        if get_rank() == 0:
            shutil.rmtree(partial_dir, ignore_errors=True)
        raise CheckpointError(f"saving checkpoint {checkpoint_dir} failed: {e}; {tracker} was not advanced "
                              f"(it still names the previous checkpoint)") from error
    keep = 1 if non_persistent_ckpt else None  # non-persistent: only the latest is kept
    if request is None:
        _finalize_save(save_dir, iteration, partial_dir, checkpoint_dir, non_finite=non_finite, keep_latest=keep)
        return
    request.add_finalize_fn(
        lambda: _finalize_save(save_dir, iteration, partial_dir, checkpoint_dir, scheduled_at=start,
                               non_finite=non_finite, keep_latest=keep)
    )
    _schedule_async_save(request, iteration, save_dir, start, strategy)
    if non_finite is not None:  # stop now (the save is set aside when it finished), not at a later finalize
        maybe_finalize_async_save(blocking=True)


def _non_finite_state(args, state_dict: dict) -> Optional[str]:
    """Which tensor a save is about to write holds NaN/Inf ("<key> (rank R)", the first of the lowest rank), checked
    on every rank's own shards; None when all are finite. Collective. With --no-check-for-nan-in-loss-and-grad the
    finding is only a warning (that run goes on through non-finite values on purpose)."""
    start = time.perf_counter()
    key = safety.first_non_finite_shard(state_dict)
    found = [key]
    if get_world_size() > 1:
        found = [None] * get_world_size()
        dist.all_gather_object(found, key)
    bad = next((f"{k} (rank {r})" for r, k in enumerate(found) if k is not None), None)
    if bad is not None and not getattr(args, "check_for_nan_in_loss_and_grad", True):
        print_rank_0(f"WARNING: checkpoint tensor {bad} holds NaN or Inf; publishing it anyway "
                     f"(--no-check-for-nan-in-loss-and-grad)")
        return None
    print_rank_0(f"  checked the saved tensors for NaN/Inf in {time.perf_counter() - start:.3f} s")
    return bad


_RANK_ARGS = ("rank", "local_rank")  # arguments that differ between ranks on purpose


def preprocess_common_state_dict(common_state_dict: dict) -> dict:
    """The common state as a save compares it across ranks (upstream's name): ``args`` as a dict without the
    rank-specific arguments, so only real differences are warned about."""
    out = dict(common_state_dict)
    if hasattr(out.get("args"), "__dict__"):
        out["args"] = {k: v for k, v in vars(out["args"]).items() if k not in _RANK_ARGS}
    return out


def _finalize_save(save_dir: str, iteration: int, partial_dir: str, checkpoint_dir: str,
                   scheduled_at: Optional[float] = None, non_finite: Optional[str] = None,
                   keep_latest: Optional[int] = None) -> None:
    """The end of a save, after every rank wrote its part (collective): the one place that publishes the partial
    directory as ``iter_N`` and advances the tracker. A save holding NaN/Inf (``non_finite``: the tensor) is set
    aside as ``iter_N.nonfinite`` instead, the tracker stays, and every rank raises CheckpointError."""
    if non_finite is not None:
        error = None
        if get_rank() == 0:
            try:
                aside = safety.set_aside_non_finite(partial_dir, checkpoint_dir)
            except OSError as e:
                aside = f"(not kept: {safety.describe_save_failure(e, save_dir)})"
            previous = _tracker_iteration(save_dir)
            error = (f"checkpoint of iteration {iteration} not published: tensor {non_finite} holds NaN or Inf; "
                     f"written aside to {aside}; {get_checkpoint_tracker_filename(save_dir)} still names "
                     f"{'no checkpoint' if previous is None else f'iteration {previous}'}")
        safety.broadcast_error_from_rank0(error)
    error = None
    if get_rank() == 0:
        try:
            previous = _tracker_iteration(save_dir)
            safety.publish(partial_dir, checkpoint_dir)
            _write_tracker(save_dir, iteration)
        except OSError as e:
            error = (f"saving checkpoint {checkpoint_dir} failed while publishing it: "
                     f"{safety.describe_save_failure(e, save_dir)}")
        else:
            retain = None if keep_latest else getattr(get_args(), "save_retain_interval", None)
            _drop_old_checkpoints(save_dir, iteration, previous, retain, keep_latest)
    safety.raise_collectively(error)
    how = "" if scheduled_at is None else f" (asynchronous: finished {time.time() - scheduled_at:.2f} s after it was scheduled)"
    print_rank_0(f"  successfully saved checkpoint from iteration {iteration:7d} to {save_dir}{how}")


def non_persistent_dir(args, base_dir: Optional[str]) -> Optional[str]:
    """Where global non-persistent checkpoints live: ``--non-persistent-global-ckpt-dir``, else
    ``<base_dir>/non_persistent`` (upstream's layout)."""
    explicit = getattr(args, "non_persistent_global_ckpt_dir", None)
    if explicit:
        return explicit
    return os.path.join(base_dir, NON_PERSISTENT_SUBDIR) if base_dir else None


def _drop_old_checkpoints(save_dir: str, iteration: int, previous: Optional[int], retain: Optional[int],
                          keep_latest: Optional[int]) -> None:
    """Rank 0, after ``iter_<iteration>`` was published: ``--save-retain-interval R`` deletes the previous
    checkpoint unless its iteration is a multiple of R (a symbolic link is left alone); ``keep_latest`` (the
    non-persistent directory) deletes every ``iter_N`` but the newest ``keep_latest``."""
    doomed = []
    if keep_latest:
        doomed = safety.complete_checkpoints(save_dir)[:-keep_latest]  # sorted by iteration
    elif retain and previous is not None and previous > 0 and previous != iteration and previous % retain:
        doomed = [previous]
    for old in doomed:
        path = get_checkpoint_name(save_dir, old)
        if os.path.islink(path):
            print(f"  not deleting checkpoint {path}: a symbolic link", flush=True)
            continue
        shutil.rmtree(path, ignore_errors=True)
        why = "non-persistent: only the latest is kept" if keep_latest else f"--save-retain-interval {retain}"
        print(f"  deleted checkpoint {path} ({why})", flush=True)


def check_save_target(args, start_iteration: int) -> None:
    """Before training (collective): refuse a run whose saves into ``--save`` would replace complete checkpoints
    there or move its tracker back (``--finetune``, a fresh run, ``--ckpt-step`` to an earlier checkpoint), unless
    ``--ckpt-overwrite``."""
    if not args.save or getattr(args, "ckpt_overwrite", False):
        return
    error = None
    if get_rank() == 0:
        why = (" (--finetune)" if args.finetune else f" (--ckpt-step {args.ckpt_step})" if args.ckpt_step is not None
               else " (from scratch)" if start_iteration == 0 else "")
        error = safety.overwrite_problem(args.save, start_iteration + 1, _tracker_iteration(args.save),
                                         f"this run starts at iteration {start_iteration}{why} and its saves")
    safety.broadcast_error_from_rank0(error)


# ---- asynchronous save (--async-save) ---------------------------------------------------------------------------
_async_queue = None


def _schedule_async_save(request, iteration: int, save_dir: str, start: float, strategy) -> None:
    """Take the CPU copy now and write in the background (``--async-save``); the partial directory is published and
    the tracker advanced in ``maybe_finalize_async_save`` once every rank finished."""
    global _async_queue
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, resolve_async_strategy

    args = get_args()
    if _async_queue is None:
        resolve_async_strategy(getattr(args, "async_strategy", "nvrx"))
        _async_queue = AsyncCallsQueue(persistent=bool(getattr(args, "use_persistent_ckpt_worker", False)))
    _async_queue.schedule_async_request(request)
    staged = getattr(getattr(strategy, "base_strategy", strategy), "last_staged_bytes", None)
    print_rank_0(f"  scheduled asynchronous checkpoint save of iteration {iteration:7d} to {save_dir}: training "
                 f"blocked {time.time() - start:.3f} s, {staged} bytes staged to host memory on rank 0")


def maybe_finalize_async_save(blocking: bool = False, terminate: bool = False) -> None:
    """Finalize (publish, advance the tracker of) the asynchronous saves that finished on every rank; ``blocking``:
    wait for all of them; ``terminate``: then stop the background worker. Collective: call on every rank."""
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
        partial = safety.partial_name(checkpoint_dir)
        note = f" ({partial} exists: that save never finished)" if os.path.isdir(partial) else ""
        raise CheckpointError(f"checkpoint directory {checkpoint_dir} (iteration {iteration}, from {src}) does not "
                              f"exist{note}")
    return iteration, release, checkpoint_dir


def _pick_checkpoint(args, load_arg: str, load_dir: Optional[str]):
    """(directory, ``_find_checkpoint`` result) a load reads: the latest of ``--load`` (or ``--ckpt-step``); the
    global non-persistent checkpoint instead when it is as new or newer (upstream's rule); ``--pretrained-checkpoint``
    when ``--load`` has none, loaded as with ``--finetune`` (sets ``args.finetune``)."""
    found = _find_checkpoint(load_dir, args) if load_dir else None
    if load_arg != "load":
        return load_dir, found
    np_dir = non_persistent_dir(args, load_dir)
    if (getattr(args, "non_persistent_ckpt_type", None) == "global" and getattr(args, "ckpt_step", None) is None
            and np_dir and os.path.isfile(get_checkpoint_tracker_filename(np_dir))):
        np_found = _find_checkpoint(np_dir, args)
        if np_found is not None and (found is None or np_found[0] >= found[0]):
            print_rank_0(f"  the non-persistent checkpoint {np_found[2]} is the newest: loading it")
            return np_dir, np_found
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if found is None and pretrained:
        print_rank_0(f"  no checkpoint in --load {load_dir}: loading --pretrained-checkpoint {pretrained} "
                     f"(model only, as --finetune)")
        found = _find_checkpoint(pretrained, args)
        if found is None:
            raise CheckpointError(f"--pretrained-checkpoint {pretrained}: no checkpoint tracker "
                                  f"{get_checkpoint_tracker_filename(pretrained)} (and no checkpoint in --load)")
        args.finetune = True
        return pretrained, found
    return load_dir, found


def checkpoint_format(checkpoint_dir: str) -> str:
    """The format of a checkpoint directory: the backend its ``metadata.json`` names (``torch_dist``), ``torch``
    for upstream's legacy layout (``mp_rank_XX/model_optim_rng.pt``), else ``unknown``."""
    from megatron.core.dist_checkpointing.core import maybe_load_config

    config = maybe_load_config(checkpoint_dir)
    if config is not None:
        return config.sharded_backend
    try:
        names = os.listdir(checkpoint_dir)
    except OSError:
        return "unknown"
    if any(n.startswith("mp_rank_") for n in names):
        return "torch"
    return "torch_dist" if os.path.isfile(os.path.join(checkpoint_dir, ".metadata")) else "unknown"


def load_args_from_checkpoint(args, load_arg: str = "load") -> bool:
    """``--use-checkpoint-args``: take the model-shape arguments from the checkpoint's stored args (upstream's
    rule: the sizes only where the run did not give them, the rest always). Reads the latest checkpoint of
    ``args.<load_arg>``, else of ``--pretrained-checkpoint`` (no collectives: before the process groups exist).
    Returns whether arguments were read."""
    found = None
    for d in (getattr(args, load_arg, None), getattr(args, "pretrained_checkpoint", None)):
        tracker = get_checkpoint_tracker_filename(d) if d else None
        if args.ckpt_step is not None and d:
            found = get_checkpoint_name(d, args.ckpt_step)
        elif tracker and os.path.isfile(tracker):
            iteration, release = _parse_tracker(tracker)
            found = get_checkpoint_name(d, iteration, release)
        if found:
            break
    if found is None:
        raise CheckpointError("--use-checkpoint-args: no checkpoint tracker in --load or --pretrained-checkpoint")
    common = dist_checkpointing.load_common_state_dict(found)
    ckpt_args = common.get("args") if isinstance(common, dict) else None
    if ckpt_args is None:
        raise CheckpointError(f"--use-checkpoint-args: checkpoint {found} stores no arguments")
    values = ckpt_args if isinstance(ckpt_args, dict) else vars(ckpt_args)
    taken = []
    for name in CHECKPOINT_MODEL_ARGS:
        fill_only = name in _FILL_ONLY_ARGS
        if name not in values or values[name] is None or (fill_only and getattr(args, name, None) is not None):
            continue
        setattr(args, name, values[name])
        taken.append(f"{name}={values[name]}")
    print_rank_0(f"  --use-checkpoint-args: from {found}: {', '.join(taken)}")
    return True


# --use-checkpoint-args: the sizes are taken only where the run did not give them; the others always (upstream)
_FILL_ONLY_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads",
                   "kv_channels", "max_position_embeddings", "vocab_size", "num_experts", "moe_ffn_hidden_size",
                   "tokenizer_type")
CHECKPOINT_MODEL_ARGS = _FILL_ONLY_ARGS + (
    "num_query_groups", "group_query_attention", "position_embedding_type", "rotary_base", "rotary_percent",
    "add_bias_linear", "add_qkv_bias", "swiglu", "untie_embeddings_and_output_weights", "apply_layernorm_1p",
    "normalization", "norm_epsilon", "qk_layernorm", "make_vocab_size_divisible_by", "moe_layer_freq",
    "moe_router_topk", "moe_router_pre_softmax", "moe_router_score_function", "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor", "moe_grouped_gemm", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate", "window_size", "window_attn_skip_freq", "softmax_type", "quick_geglu",
    "glu_linear_offset", "activation_func_clamp_value",
)


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


def _requested_model_shapes(sharded_model_sds: dict) -> Tuple[dict, set]:
    """({key: global shape} of every tensor the model requests (factories built), the keys whose shape may differ
    from the checkpoint's (``allow_shape_mismatch``: the padded vocabulary)), united over the ranks."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    shapes, resizable = {}, set()

    def visit(values):
        for v in values:
            if isinstance(v, ShardedTensorFactory):
                visit(nested_values(v.build()))
            elif isinstance(v, ShardedTensor):
                shapes[v.key] = tuple(v.global_shape)
                if v.allow_shape_mismatch:
                    resizable.add(v.key)

    visit(nested_values(sharded_model_sds))
    if get_world_size() > 1:
        gathered = [None] * get_world_size()
        dist.all_gather_object(gathered, (shapes, resizable))
        for d, r in gathered:
            shapes.update(d)
            resizable.update(r)
    return shapes, resizable


def _check_resume(args, checkpoint_dir: str, sharded_model_sds: dict, strict: bool, load_optim: bool = False) -> None:
    """Before any tensor is read (collective; rank 0 reads the checkpoint's common state and tensor metadata):
    the model-shape arguments stored in the checkpoint vs the run's (upstream's ``check_checkpoint_args``; with
    ``--finetune`` a difference is only a warning, as long as the tensors still fit), then the model's tensor keys
    and global shapes vs the checkpoint's (missing, resized and unexpected model keys are errors;
    ``--dist-ckpt-strictness log_*`` or ``strict=False``: warnings; ``ignore_all``: not checked)."""
    requested, resizable = _requested_model_shapes(sharded_model_sds)
    error = None
    if get_rank() == 0:
        from megatron.core.dist_checkpointing.core import CheckpointingException

        try:
            with warnings.catch_warnings():  # DCP's note that a local (one-process) read is one
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                common = dist_checkpointing.load_common_state_dict(checkpoint_dir)
                ckpt_shapes = {k: tuple(v.global_shape)
                               for k, v in dist_checkpointing.load_tensors_metadata(checkpoint_dir).items()}
        except (CheckpointingException, OSError):
            common, ckpt_shapes = None, None  # the load itself reports what is wrong with the files
        if common is not None:
            ckpt_args = common.get("args") if isinstance(common, dict) else None
            mismatches = safety.checkpoint_args_mismatches(ckpt_args, args) if ckpt_args is not None else []
            differ = f"arguments that differ: {safety.format_mismatches(mismatches)}" if mismatches else ""
            strictness = str(getattr(args, "dist_ckpt_strictness", "assume_ok_unexpected"))
            problems = [] if strictness == "ignore_all" else safety.model_key_problems(requested, ckpt_shapes,
                                                                                      resizable)
            note = safety.vocab_padding_note(requested, ckpt_shapes, resizable)
            if note:
                print(f"checkpoint {checkpoint_dir}: {note}", flush=True)
            problems = [safety.short_list(problems, 2, "; ")] if problems else []  # one line: a count for the rest
            layout = (safety.optimizer_layout_problem(ckpt_args, ckpt_shapes or (), args, common)
                      if load_optim else None)
            if layout:
                error = f"checkpoint {checkpoint_dir}: {layout}"
            elif mismatches and not args.finetune:
                error = (f"checkpoint {checkpoint_dir} was saved by a different model: {differ} "
                         f"(--finetune loads its weights anyway where every tensor still fits)")
            elif problems:
                text = f"checkpoint {checkpoint_dir} does not fit the model: {problems[0]}{'; ' + differ if differ else ''}"
                if strict and not strictness.startswith("log_"):
                    error = text
                else:
                    print(f"WARNING: {text}", flush=True)
            elif mismatches:
                print(f"WARNING: --finetune: checkpoint {checkpoint_dir}: {differ}; every tensor fits, loading it",
                      flush=True)
    safety.broadcast_error_from_rank0(error)


def _check_weights_finite(model) -> None:
    """``--check-weights-finite``: every rank checks its (local) model tensors; the first non-finite one is named
    on every rank."""
    error = None
    for i, chunk in enumerate(_chunks(model)):
        base = unwrap_model(chunk)
        name = safety.first_non_finite(list(base.named_parameters()) + list(base.named_buffers()))
        if name is not None:
            error = f"--check-weights-finite: model{'' if len(_chunks(model)) == 1 else i} tensor {name} holds " \
                    f"NaN or Inf right after loading the checkpoint"
            break
    safety.raise_collectively(error)


def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg="load", strict=True, checkpointing_context=None,
                    skip_load_to_model_and_optimizer=False):
    """Load the latest (or ``--ckpt-step``) checkpoint of ``args.<load_arg>``.

    Returns ``(iteration, num_floating_point_operations_so_far)``; ``(0, 0)`` when there is no checkpoint
    (an error with ``--exit-on-missing-checkpoint``). ``--finetune``: the model only, iteration 0.
    ``--no-load-optim`` / ``--no-load-rng``: skip those parts. Sets ``args.consumed_train_samples``. Every read
    verifies item checksums as ``--ckpt-verify`` says.
    """
    from megatron.core.dist_checkpointing.strategies.filesystem import checksum_verification

    with checksum_verification(getattr(get_args(), "ckpt_verify", "auto")):
        return _load_checkpoint(model, optimizer, opt_param_scheduler, load_arg, strict,
                                skip_load_to_model_and_optimizer)


def _load_checkpoint(model, optimizer, opt_param_scheduler, load_arg, strict, skip_load_to_model_and_optimizer):
    args = get_args()
    load_dir = getattr(args, load_arg)
    if not load_dir and not (load_arg == "load" and getattr(args, "pretrained_checkpoint", None)):
        return 0, 0
    load_dir, found = _pick_checkpoint(args, load_arg, load_dir)
    if found is None:
        tracker = get_checkpoint_tracker_filename(load_dir)
        if args.exit_on_missing_checkpoint:
            raise CheckpointError(f"--exit-on-missing-checkpoint: no checkpoint tracker {tracker} in --{load_arg.replace('_', '-')} {load_dir}")
        if not getattr(args, "ckpt_fresh_start", False):
            safety.broadcast_error_from_rank0(
                safety.missing_tracker_problem(load_dir, tracker) if get_rank() == 0 else None)
        print_rank_0(f"WARNING: no checkpoint tracker {tracker}; training from random initialization")
        return 0, 0
    iteration, release, checkpoint_dir = found
    fmt = checkpoint_format(checkpoint_dir)
    if fmt != "torch_dist":
        how = " (detected: --auto-detect-ckpt-format)" if getattr(args, "auto_detect_ckpt_format", False) else ""
        raise CheckpointError(f"checkpoint {checkpoint_dir} is in format {fmt!r}{how}; this fork loads torch_dist "
                              f"only (convert it with upstream's tools/checkpoint/convert.py)")
    print_rank_0(f"loading checkpoint from {load_dir} at iteration {iteration} (torch_dist)")

    load_optim = optimizer is not None and not (args.no_load_optim or args.finetune or release)
    load_rng = not (args.no_load_rng or args.finetune or release)
    if load_rng and _checkpoint_model_parallel_sizes(checkpoint_dir) != (args.tensor_model_parallel_size,
                                                                         args.pipeline_model_parallel_size):
        # as upstream: per-(PP, TP)-rank RNG states do not carry over to other TP/PP sizes
        print_rank_0(f"WARNING: checkpoint saved with another --tensor-model-parallel-size or "
                     f"--pipeline-model-parallel-size than ({args.tensor_model_parallel_size}, "
                     f"{args.pipeline_model_parallel_size}): its RNG state is not loaded")
        load_rng = False
    chunks = _chunks(model)
    state_dict = generate_state_dict(
        args, model, optimizer if load_optim else None, opt_param_scheduler if load_optim else None,
        get_rng_state() if load_rng else None, iteration, is_loading=True,
        optim_sd_kwargs=dict(metadata=loaded_sd_metadata(checkpoint_dir)) if load_optim else None,
    )
    for key in ("args", "checkpoint_version", "iteration", "num_floating_point_operations_so_far"):
        state_dict.pop(key, None)  # common state comes from the checkpoint
    sharded_model_sds = {k: v for k, v in state_dict.items() if k == "model" or k.startswith("model")}
    if opt_param_scheduler is not None and load_optim:
        state_dict.pop("opt_param_scheduler")  # a plain dict: comes from the checkpoint's common state
    _check_resume(args, checkpoint_dir, sharded_model_sds, strict, load_optim)
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
        if optimizer is not None and not load_optim and hasattr(optimizer, "reload_model_params"):
            optimizer.reload_model_params()  # fp32 main params (bf16/fp16, distributed optimizer) from the model
        if load_optim:
            if "optimizer" not in loaded:
                raise CheckpointError(f"checkpoint {checkpoint_dir} has no optimizer state (use --no-load-optim)")
            optimizer.load_state_dict(loaded["optimizer"])
        if getattr(args, "check_weights_finite", False):
            _check_weights_finite(model)
    if opt_param_scheduler is not None and load_optim:
        if "opt_param_scheduler" not in loaded:
            raise CheckpointError(f"checkpoint {checkpoint_dir} has no opt_param_scheduler state")
        try:
            opt_param_scheduler.load_state_dict(loaded["opt_param_scheduler"])
        except ValueError as e:  # a scheduler value differs from the checkpoint's: one line naming the flags
            raise CheckpointError(f"{checkpoint_dir}: {e}") from None
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
    barrier()
    print_rank_0(f"  successfully loaded checkpoint from {load_dir} at iteration {iteration}")
    return iteration, int(loaded.get("num_floating_point_operations_so_far", 0) or 0)
