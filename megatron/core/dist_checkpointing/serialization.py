"""Saving and loading distributed (sharded) checkpoints: the entry points of ``megatron.core.dist_checkpointing``.

A checkpoint is a directory, written collectively by all ranks, in upstream megatron-core's ``torch_dist`` layout::

    metadata.json        {"sharded_backend": "torch_dist", "sharded_backend_version": 1}   (written last, by rank 0)
    .metadata            PyTorch DCP metadata (tensor keys -> TensorStorageMetadata with chunks; objects -> bytes)
    __<rank>_<n>.distcp  DCP data files (FileSystemWriter)
    integrity.json       only with ``save(..., verify_integrity=True)``: SHA-256 of every file (upstream's manifest)

as upstream megatron-core 0.19 writes it: the non-sharded ("common") state is the object ``common_state/shard_0_1``
inside the DCP files (written by rank 0), and every ShardedObject is a DCP bytes item ``<key>/shard_<offset>_<shape>``
holding ``torch.save([obj])``. The legacy layout (``common.pt`` beside the DCP files, ``metadata.json`` naming a
``common_backend``, objects stored unwrapped: older upstream versions and this fork before 0.19 parity) is read
too, and written only when ``save`` is given a ``common_strategy`` explicitly. Objects and common state are read with
``torch.load(weights_only=True)``.

Usage::

    sharded_sd = {"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world_size)), "iteration": 7}
    save(sharded_sd, ckpt_dir)                      # ckpt_dir must exist (and not hold a checkpoint)
    state = load(sharded_sd, ckpt_dir)              # {"w": <local, loaded in place>, "iteration": 7}

``load`` accepts a different sharding than the one saved (another rank count, axis, uneven shards, flattened
ranges). ``strict`` (StrictHandling or its string) controls key mismatch handling; RETURN_* modes make ``load``
return ``(state_dict, missing_keys, unexpected_keys)``. Bad input raises CheckpointingException naming the key, file
or directory; a failed save never touches an existing checkpoint.
"""
import logging
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional, Set, Tuple, Union

import torch
import torch.distributed as dist

from .. import dist_utils, parallel_state
from .core import CONFIG_FNAME, CheckpointingConfig, CheckpointingException, save_config
from .integrity import save_integrity_manifest, verify_integrity_manifest
from .dict_utils import extract_matching_values, map_matching_like, merge, restore_list_types
from .mapping import ShardedObject, ShardedStateDict, StateDict, apply_factory_merges
from .strategies.async_utils import check_async_strategy
from .strategies.common import COMMON_STATE_FNAME  # noqa: F401 (upstream imports it from here)
from .strategies.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
)
from .state_dict_utils import _load_preprocess, load_preprocess, save_preprocess  # noqa: F401 (upstream names)
from .validation import (
    StrictHandling,
    parse_strict_flag,
    validate_integrity_and_strict_load,
    verify_checkpoint,
    verify_checkpoint_and_load_strategy,
)

logger = logging.getLogger(__name__)

_CONTENT_METADATA_KEY = "content_metadata"
COMMON_STATE_KEY = "common_state"  # upstream 0.19: the common state is this ShardedObject inside the DCP files


def _common_state_object(common_state_dict) -> ShardedObject:
    """The common state as upstream 0.19 stores it: one object (``common_state/shard_0_1``) written by rank 0."""
    return ShardedObject(COMMON_STATE_KEY, common_state_dict, (1,), (0,), replica_id=dist_utils.get_rank())


def _is_object(x) -> bool:
    return isinstance(x, ShardedObject)


def _wrapped(obj: ShardedObject) -> ShardedObject:
    """Upstream 0.19 stores an object's data as a one-element list."""
    return replace(obj, data=[obj.data])


def _unwrapped(checkpoint_dir: Path):
    def fn(value, obj: ShardedObject):
        if not (isinstance(value, list) and len(value) == 1):
            raise CheckpointingException(
                f"object {obj.unique_key!r} of checkpoint {checkpoint_dir} is not stored as upstream 0.19 stores "
                f"objects (a one-element list), got {type(value).__name__}"
            )
        return value[0]

    return fn


# ---- save ------------------------------------------------------------------------------------------------------
def _check_sharded_strategy_arg(fn: str, sharded_strategy, strategy_cls: type, later_params: str) -> None:
    """Refuse a ``sharded_strategy`` (the third argument of ``fn``) that is neither a ``strategy_cls`` nor a
    (backend, version) tuple, naming upstream 0.19's order of ``fn``'s parameters (``later_params``: after the
    fourth)."""
    if sharded_strategy is not None and not isinstance(sharded_strategy, (strategy_cls, tuple)):
        raise CheckpointingException(
            f"{fn}: sharded_strategy must be a {strategy_cls.__name__} or a (backend, version) tuple, got "
            f"{type(sharded_strategy).__name__} (upstream 0.19 order: {fn}(sharded_state_dict, checkpoint_dir, "
            f"sharded_strategy, validate_access_integrity, {later_params}))"
        )


def get_default_save_sharded_strategy(backend: str = "torch_dist", version: int = 1) -> SaveShardedStrategy:
    return get_default_strategy(StrategyAction.SAVE_SHARDED, backend, version)


def get_default_save_common_strategy(backend: str = "torch", version: int = 1) -> SaveCommonStrategy:
    return get_default_strategy(StrategyAction.SAVE_COMMON, backend, version)


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: Union[str, Path],
    sharded_strategy: Union[SaveShardedStrategy, Tuple[str, int], None] = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Optional[Callable[[StateDict], StateDict]] = None,
    content_metadata: Optional[dict] = None,
    async_strategy: Optional[str] = "nvrx",
    verify_integrity: bool = False,
    *,
    common_strategy: Union[SaveCommonStrategy, Tuple[str, int], None] = None,
    process_group: Optional[dist.ProcessGroup] = None,
) -> Optional["AsyncRequest"]:  # noqa: F821
    """Save ``sharded_state_dict`` to ``checkpoint_dir`` (collective over all ranks); upstream 0.19's parameters and
    order, this fork's extras keyword-only.

    ``checkpoint_dir`` must exist. If it already holds a checkpoint (a ``metadata.json``) the save is refused (nothing
    is overwritten); other content is kept and a warning is logged, like upstream. With
    ``validate_access_integrity`` the sharding is checked across ranks first (each element of each tensor saved by
    exactly one main replica; consistent global shapes and dtypes) and every rank's common state is compared with
    rank 0's (the one saved; upstream's warning on a difference, after
    ``preprocess_common_before_consistancy_check``). ``content_metadata`` is stored in the common state (see
    ``load_content_metadata``). ``async_sharded_save=True`` returns an ``AsyncRequest`` (see
    ``strategies/async_utils.py``) to schedule with an ``AsyncCallsQueue``: the tensors are copied to CPU when it is
    scheduled and written in the background; ``metadata.json`` (and ``integrity.json``) are written by its finalize
    functions, after every rank finished writing, so until then the directory is not a loadable checkpoint.

    ``async_strategy`` ("nvrx" or "mcore", upstream's 8th parameter): both run this fork's built-in asynchronous
    save (nvidia-resiliency-ext is not needed; see ``async_utils.resolve_async_strategy``); anything else is refused.
    ``verify_integrity`` (9th) writes upstream's ``integrity.json`` (SHA-256 of every file) last.

    Keyword-only extras: ``common_strategy`` writes the legacy layout (``common.pt``) instead of upstream 0.19's; ``process_group``
    (default WORLD) is the group of the validation collectives (the DCP write itself always spans WORLD).
    """
    check_async_strategy(async_strategy or "nvrx", "save")
    _check_sharded_strategy_arg("save", sharded_strategy, SaveShardedStrategy, "async_sharded_save, ...")
    checkpoint_dir = Path(checkpoint_dir)
    error = None
    if dist_utils.get_rank() == 0:
        if not checkpoint_dir.is_dir():
            error = f"checkpoint destination directory does not exist: {checkpoint_dir}"
        elif (checkpoint_dir / CONFIG_FNAME).exists():
            error = (
                f"checkpoint destination {checkpoint_dir} already holds a checkpoint ({CONFIG_FNAME}); refusing to "
                f"overwrite it"
            )
        elif next(checkpoint_dir.iterdir(), None) is not None:
            logger.warning(f"checkpoint destination {checkpoint_dir} is not empty; writing into it")
    dist_utils.raise_collectively(error, CheckpointingException, "checkpointing")

    if sharded_strategy is None:
        sharded_strategy = get_default_save_sharded_strategy()
    elif isinstance(sharded_strategy, tuple):
        sharded_strategy = get_default_save_sharded_strategy(*sharded_strategy)
    if isinstance(common_strategy, tuple):
        common_strategy = get_default_save_common_strategy(*common_strategy)
    legacy = common_strategy is not None or not sharded_strategy.can_handle_sharded_objects
    if legacy and common_strategy is None:
        common_strategy = get_default_save_common_strategy()

    sharded_part, common_state_dict = save_preprocess(
        sharded_state_dict,
        validate_access_integrity,
        preprocess_common_before_consistancy_check,
        process_group=process_group,
    )
    if content_metadata is not None:
        common_state_dict[_CONTENT_METADATA_KEY] = content_metadata

    if legacy:
        sharded_part = _save_legacy_common(sharded_strategy, common_strategy, sharded_part, common_state_dict,
                                           checkpoint_dir)
        config = CheckpointingConfig(
            sharded_strategy.backend, sharded_strategy.version, common_strategy.backend, common_strategy.version
        )
    else:
        sharded_part = map_matching_like(sharded_part, sharded_part, _is_object, lambda _, obj: _wrapped(obj))
        sharded_part = {"sharded": sharded_part, "common": _wrapped(_common_state_object(common_state_dict))}
        config = CheckpointingConfig(sharded_strategy.backend, sharded_strategy.version)

    def finalize():
        dist_utils.barrier()
        if dist_utils.get_rank() == 0:
            save_config(config, checkpoint_dir)
            if verify_integrity:
                save_integrity_manifest(checkpoint_dir)
        dist_utils.barrier()
        _rank0_leaves_last()

    if async_sharded_save:
        if not hasattr(sharded_strategy, "async_save"):
            raise CheckpointingException(
                f"save(async_sharded_save=True): {type(sharded_strategy).__name__} cannot save asynchronously"
            )
        request = sharded_strategy.async_save(sharded_part, checkpoint_dir, async_strategy or "nvrx")
        request.add_finalize_fn(finalize)
        return request
    sharded_strategy.save(sharded_part, checkpoint_dir)
    finalize()


_leave_send = None  # this rank's last "left save" message to rank 0 (see _rank0_leaves_last), kept until the next


def _rank0_leaves_last() -> None:
    """The end of every save (after the closing barrier): each other rank posts a message to rank 0 and returns at
    once (it does not wait for the send), rank 0 returns once it received them all, so rank 0 leaves ``save`` last.
    A barrier releases all ranks together, and on an oversubscribed host (8 ranks on 2 cores) rank 0 often ran on
    before another rank was scheduled: code that changes the checkpoint on rank 0 right after ``save`` (upstream's
    ``if rank == 0: remove_sharded_tensors(...)`` in its ``test_remove_sharded_tensors``, whose other ranks list
    the directory with no barrier in between) deleted files before the other ranks had looked. An ordering, not a
    guarantee: reads a rank does after ``save`` still need a barrier before rank 0 changes the checkpoint."""
    global _leave_send
    size = dist_utils.get_world_size()
    if size == 1:
        return
    token = torch.zeros(1, device=parallel_state.collective_device())
    if dist_utils.get_rank() == 0:
        for src in range(1, size):
            dist.recv(token, src=src)
    else:
        # the previous save's message was received (rank 0 returned from that save only after it): drop it
        _leave_send = (dist.isend(token, dst=0), token)


def _save_legacy_common(sharded_strategy, common_strategy, sharded_part, common_state_dict, checkpoint_dir: Path):
    """The legacy layout's ``common.pt`` (and the objects, for a sharded strategy that cannot store them); returns
    what is left for the sharded strategy."""
    if not sharded_strategy.can_handle_sharded_objects:
        objects, sharded_part = extract_matching_values(sharded_part, lambda v: isinstance(v, ShardedObject))
        common_strategy.save_sharded_objects(objects, checkpoint_dir)
    error = None
    try:
        common_strategy.save_common(common_state_dict, checkpoint_dir)
    except Exception as e:  # e.g. an unpicklable common value: fail on every rank, before any sharded file
        error = f"saving the common state to {checkpoint_dir} failed: {type(e).__name__}: {e}"
    dist_utils.raise_collectively(error, CheckpointingException, "checkpointing")
    return sharded_part


# ---- load ------------------------------------------------------------------------------------------------------
def get_default_load_sharded_strategy(checkpoint_dir: Optional[Union[str, Path]] = None) -> LoadShardedStrategy:
    """The default load strategy: for ``checkpoint_dir``'s backend (checked against its ``metadata.json``), or,
    without a directory, upstream's default (``torch_dist``, version 1)."""
    if checkpoint_dir is None:
        return get_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1)
    return verify_checkpoint_and_load_strategy(checkpoint_dir)[0]


def load_common(checkpoint_dir: Union[str, Path]) -> StateDict:
    """The common (non-sharded) state of the checkpoint: the ``common_state`` object (upstream 0.19's layout) or
    ``common.pt`` (legacy). No communication, so it may be called on one rank only."""
    from .strategies.torch import load_objects_local

    _, common_strategy = verify_checkpoint_and_load_strategy(checkpoint_dir)
    if common_strategy is not None:
        return common_strategy.load_common(checkpoint_dir)
    obj = _common_state_object(None)
    value = load_objects_local(checkpoint_dir, [obj.unique_key])[obj.unique_key]
    return _unwrapped(Path(checkpoint_dir))(value, obj)


def load_common_state_dict(checkpoint_dir: Union[str, Path]) -> StateDict:
    """Upstream's name for ``load_common`` (checks first that ``checkpoint_dir`` is a distributed checkpoint)."""
    verify_checkpoint(checkpoint_dir)
    return load_common(checkpoint_dir)


def load_tensors_metadata(
    checkpoint_dir: Union[str, Path], sharded_strategy: Optional[LoadShardedStrategy] = None
) -> ShardedStateDict:
    """{key: ShardedTensor} with the checkpoint's global shapes and dtypes (data on the 'meta' device). No
    communication, so it may be called on one rank only."""
    sharded_strategy, _ = verify_checkpoint_and_load_strategy(checkpoint_dir, sharded_strategy)
    return sharded_strategy.load_tensors_metadata(Path(checkpoint_dir))


def load_sharded_metadata(
    checkpoint_dir: Union[str, Path],
    sharded_strategy: Optional[LoadShardedStrategy] = None,
    *,
    common_strategy: Optional[LoadCommonStrategy] = None,
) -> ShardedStateDict:
    """Tensors (as ``load_tensors_metadata``) and ShardedObjects (keyed by unique_key, no data) of the checkpoint;
    as upstream, the common state's object (key ``common_state``) is among them when the checkpoint stores it so."""
    sharded_strategy, common_strategy = verify_checkpoint_and_load_strategy(
        checkpoint_dir, sharded_strategy, common_strategy
    )
    out = dict(common_strategy.load_sharded_metadata(Path(checkpoint_dir))) if common_strategy is not None else {}
    out.update(sharded_strategy.load_sharded_metadata(Path(checkpoint_dir)))
    return out


def load_plain_tensors(checkpoint_dir: Union[str, Path]) -> StateDict:
    """{key: full global tensor on CPU} for every tensor of the checkpoint (every rank reads everything)."""
    return load(load_tensors_metadata(checkpoint_dir), checkpoint_dir, validate_access_integrity=False)


def load_content_metadata(
    checkpoint_dir: Optional[Union[str, Path]] = None, *, preloaded_state_dict: Optional[StateDict] = None
) -> Optional[dict]:
    """The ``content_metadata`` given to ``save`` (None if there was none)."""
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise CheckpointingException("load_content_metadata needs checkpoint_dir or preloaded_state_dict")
        preloaded_state_dict = load_common_state_dict(checkpoint_dir)
    return preloaded_state_dict.get(_CONTENT_METADATA_KEY)


def remove_sharded_tensors(checkpoint_dir: Union[str, Path], key_prefix: str) -> None:
    """Drop the tensors whose key starts with ``key_prefix`` from the checkpoint. Not collective, as upstream: call
    it from one rank (e.g. rank 0), then a barrier before the other ranks read the checkpoint."""
    sharded_strategy = get_default_load_sharded_strategy(checkpoint_dir)
    sharded_strategy.remove_sharded_tensors(Path(checkpoint_dir), key_prefix)


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: Union[str, Path],
    sharded_strategy: Union[LoadShardedStrategy, Tuple[str, int], None] = None,
    validate_access_integrity: bool = True,
    strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
    verify_integrity: bool = False,
    process_group: Optional[dist.ProcessGroup] = None,
    *,
    common_strategy: Union[LoadCommonStrategy, Tuple[str, int], None] = None,
) -> Union[StateDict, Tuple[StateDict, Set[str], Set[str]]]:
    """Load ``sharded_state_dict`` from ``checkpoint_dir`` (collective over all ranks); upstream 0.19's parameters
    and order, this fork's ``common_strategy`` (legacy layout only) keyword-only.

    ShardedTensors are loaded in place (into their ``data``) and replaced by the loaded tensors; ShardedObjects by the
    loaded objects; factories are merged; LocalNonpersistentObjects are unwrapped; the checkpoint's common state is
    merged in. ShardedTensors without real data (``None``, or plain tensors on the 'meta' device as
    ``load_tensors_metadata`` builds them) are loaded into new CPU tensors, so
    ``load(load_tensors_metadata(d), d, validate_access_integrity=False)`` returns the full tensors.
    For RETURN_UNEXPECTED / RETURN_ALL returns ``(state_dict, missing_keys, unexpected_keys)``.
    ``verify_integrity`` first checks every file against ``integrity.json`` (upstream's manifest).
    ``process_group`` (default WORLD) is the group of the validation and strict-check collectives; the DCP read
    itself always spans WORLD, so every rank calls ``load``.
    """
    _check_sharded_strategy_arg(
        "load", sharded_strategy, LoadShardedStrategy, "strict, verify_integrity, process_group"
    )
    checkpoint_dir = Path(checkpoint_dir)
    if verify_integrity:
        verify_integrity_manifest(checkpoint_dir)
    error, strategies = None, None
    try:
        strategies = verify_checkpoint_and_load_strategy(checkpoint_dir, sharded_strategy, common_strategy)
    except CheckpointingException as e:
        error = str(e)
    dist_utils.raise_collectively(error, CheckpointingException, "checkpointing")
    sharded_strategy, common_strategy = strategies
    strict = parse_strict_flag(strict)

    common_state_dict, error = None, None
    if common_strategy is not None:  # legacy layout: common.pt
        try:
            common_state_dict = common_strategy.load_common(checkpoint_dir)
        except CheckpointingException as e:
            error = str(e)
        dist_utils.raise_collectively(error, CheckpointingException, "checkpointing")

    sharded_part, nonpersistent, with_factories, built = _load_preprocess(sharded_state_dict)

    ckpt_sharded_metadata = None
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        error = None
        try:
            ckpt_sharded_metadata = load_sharded_metadata(
                checkpoint_dir, sharded_strategy, common_strategy=common_strategy
            )
            # the common state is loaded separately (load_common), never a key of the state dict
            ckpt_sharded_metadata = {
                k: v for k, v in ckpt_sharded_metadata.items() if getattr(v, "key", None) != COMMON_STATE_KEY
            }
        except CheckpointingException as e:
            error = str(e)
        dist_utils.raise_collectively(error, CheckpointingException, "checkpointing")
    sharded_part, missing_keys, unexpected_keys = validate_integrity_and_strict_load(
        sharded_part,
        strict,
        validate_access_integrity,
        ckpt_sharded_metadata=ckpt_sharded_metadata,
        process_group=process_group,
    )

    if common_strategy is None:  # upstream 0.19's layout: objects wrapped, the common state one of them
        request = {"sharded": sharded_part, "common": _common_state_object(None)}
        loaded = map_matching_like(
            sharded_strategy.load(request, checkpoint_dir), request, _is_object, _unwrapped(checkpoint_dir)
        )
        loaded, common_state_dict = loaded["sharded"], loaded["common"]
    else:
        if not sharded_strategy.can_handle_sharded_objects:
            objects, sharded_part = extract_matching_values(sharded_part, lambda v: isinstance(v, ShardedObject))
            merge(common_state_dict, common_strategy.load_sharded_objects(objects, checkpoint_dir))
        loaded = sharded_strategy.load(sharded_part, checkpoint_dir)  # collective: called even with nothing to load
    loaded = restore_list_types(loaded, built)  # before merges: merge_fn gets what build_fn built (e.g. a list)
    loaded = apply_factory_merges(loaded, with_factories)
    merge(common_state_dict, loaded)
    if nonpersistent:
        merge(common_state_dict, nonpersistent)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return common_state_dict, missing_keys, unexpected_keys
    return common_state_dict
