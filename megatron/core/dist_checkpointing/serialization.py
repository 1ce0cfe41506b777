"""Saving and loading distributed (sharded) checkpoints: the entry points of ``megatron.core.dist_checkpointing``.

A checkpoint is a directory, written collectively by all ranks, in upstream megatron-core's ``torch_dist`` layout::

    metadata.json        {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                          "common_backend": "torch", "common_backend_version": 1}   (written last, by rank 0)
    common.pt            the non-sharded ("common") state, torch.save by rank 0
    .metadata            PyTorch DCP metadata (tensor keys -> TensorStorageMetadata with chunks; objects -> bytes)
    __<rank>_<n>.distcp  DCP data files (FileSystemWriter)

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
from pathlib import Path
from typing import Optional, Set, Tuple, Union

import torch
import torch.distributed as dist

from .core import CONFIG_FNAME, CheckpointingConfig, CheckpointingException, save_config
from .dict_utils import dict_list_map_outplace, extract_matching_values, merge, nested_values
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
)
from .strategies.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
)
from .validation import (
    StrictHandling,
    determine_global_metadata,
    parse_strict_flag,
    validate_integrity_and_strict_load,
    validate_sharding_integrity,
    verify_checkpoint_and_load_strategy,
)

logger = logging.getLogger(__name__)

_CONTENT_METADATA_KEY = "content_metadata"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier():
    if _world_size() > 1:
        dist.barrier()


def _collective_error(error: Optional[str]):
    from .strategies.torch import raise_collectively

    raise_collectively(error)


def _copy_containers(x):
    """New nested dicts/lists, same leaves (so that applying factories does not modify the caller's dict)."""
    return dict_list_map_outplace(lambda v: v, x)


def _split(sharded_state_dict: ShardedStateDict):
    """(sharded part, nonpersistent part, common part) of a state dict whose factories were applied."""
    nonpersistent, rest = extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject), return_lists_as_dicts=True
    )
    sharded, common = extract_matching_values(rest, lambda v: isinstance(v, ShardedBase), return_lists_as_dicts=True)
    return sharded, nonpersistent, common


def _restore_list_types(x, like):
    """Turn the {index: value} dicts that stand for lists of ``like`` (fully sharded lists) back into lists."""
    if isinstance(like, list) and isinstance(x, dict) and set(x) == set(range(len(like))):
        return [_restore_list_types(x[i], like[i]) for i in range(len(like))]
    if isinstance(like, list) and isinstance(x, list):
        return [_restore_list_types(a, b) for a, b in zip(x, like)] + x[len(like):]
    if isinstance(like, dict) and isinstance(x, dict):
        return {k: _restore_list_types(v, like[k]) if k in like else v for k, v in x.items()}
    if isinstance(like, list) and isinstance(x, dict):
        return {k: _restore_list_types(v, like[k]) if isinstance(k, int) and k < len(like) else v for k, v in x.items()}
    return x


# ---- save ------------------------------------------------------------------------------------------------------
def get_default_save_sharded_strategy(backend: str = "torch_dist", version: int = 1) -> SaveShardedStrategy:
    return get_default_strategy(StrategyAction.SAVE_SHARDED, backend, version)


def get_default_save_common_strategy(backend: str = "torch", version: int = 1) -> SaveCommonStrategy:
    return get_default_strategy(StrategyAction.SAVE_COMMON, backend, version)


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: Union[str, Path],
    sharded_strategy: Union[SaveShardedStrategy, Tuple[str, int], None] = None,
    common_strategy: Union[SaveCommonStrategy, Tuple[str, int], None] = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check=None,
    content_metadata: Optional[dict] = None,
) -> None:
    """Save ``sharded_state_dict`` to ``checkpoint_dir`` (collective over all ranks).

    ``checkpoint_dir`` must exist. If it already holds a checkpoint (a ``metadata.json``) the save is refused (nothing
    is overwritten); other content is kept and a warning is logged, like upstream. With
    ``validate_access_integrity`` the sharding is checked across ranks first (each element of each tensor saved by
    exactly one main replica; consistent global shapes and dtypes). ``content_metadata`` is stored in the common
    state (see ``load_content_metadata``).
    """
    if async_sharded_save:
        raise CheckpointingException("async_sharded_save is not supported by this megatron-core fork")
    checkpoint_dir = Path(checkpoint_dir)
    error = None
    if _rank() == 0:
        if not checkpoint_dir.is_dir():
            error = f"checkpoint destination directory does not exist: {checkpoint_dir}"
        elif (checkpoint_dir / CONFIG_FNAME).exists():
            error = (
                f"checkpoint destination {checkpoint_dir} already holds a checkpoint ({CONFIG_FNAME}); refusing to "
                f"overwrite it"
            )
        elif next(checkpoint_dir.iterdir(), None) is not None:
            logger.warning(f"checkpoint destination {checkpoint_dir} is not empty; writing into it")
    _collective_error(error)

    if sharded_strategy is None:
        sharded_strategy = get_default_save_sharded_strategy()
    elif isinstance(sharded_strategy, tuple):
        sharded_strategy = get_default_save_sharded_strategy(*sharded_strategy)
    if common_strategy is None:
        common_strategy = get_default_save_common_strategy()
    elif isinstance(common_strategy, tuple):
        common_strategy = get_default_save_common_strategy(*common_strategy)

    sharded_state_dict = _copy_containers(sharded_state_dict)
    apply_factories(sharded_state_dict)
    sharded_part, _, common_state_dict = _split(sharded_state_dict)
    if content_metadata is not None:
        common_state_dict[_CONTENT_METADATA_KEY] = content_metadata

    error = None
    try:
        for sh in nested_values(sharded_part):
            sh.validate_metadata_integrity()
    except CheckpointingException as e:
        error = str(e)
    _collective_error(error)
    if validate_access_integrity:
        _, global_metadata = determine_global_metadata(sharded_part)
        validate_sharding_integrity(global_metadata)

    if not sharded_strategy.can_handle_sharded_objects:
        objects, sharded_part = extract_matching_values(sharded_part, lambda v: isinstance(v, ShardedObject))
        common_strategy.save_sharded_objects(objects, checkpoint_dir)
    error = None
    try:
        common_strategy.save_common(common_state_dict, checkpoint_dir)
    except Exception as e:  # e.g. an unpicklable common value: fail on every rank, before any sharded file
        error = f"saving the common state to {checkpoint_dir} failed: {type(e).__name__}: {e}"
    _collective_error(error)
    sharded_strategy.save(sharded_part, checkpoint_dir)
    _barrier()
    if _rank() == 0:
        save_config(
            CheckpointingConfig(
                sharded_strategy.backend, sharded_strategy.version, common_strategy.backend, common_strategy.version
            ),
            checkpoint_dir,
        )
    _barrier()


# ---- load ------------------------------------------------------------------------------------------------------
def get_default_load_sharded_strategy(checkpoint_dir: Union[str, Path]) -> LoadShardedStrategy:
    return verify_checkpoint_and_load_strategy(checkpoint_dir)[0]


def load_common_state_dict(checkpoint_dir: Union[str, Path]) -> StateDict:
    """The common (non-sharded) state of the checkpoint (``common.pt``)."""
    _, common_strategy = verify_checkpoint_and_load_strategy(checkpoint_dir)
    return common_strategy.load_common(checkpoint_dir)


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
    common_strategy: Optional[LoadCommonStrategy] = None,
) -> ShardedStateDict:
    """Tensors (as ``load_tensors_metadata``) and ShardedObjects (keyed by unique_key, no data) of the checkpoint."""
    sharded_strategy, common_strategy = verify_checkpoint_and_load_strategy(
        checkpoint_dir, sharded_strategy, common_strategy
    )
    out = dict(common_strategy.load_sharded_metadata(Path(checkpoint_dir)))
    out.update(sharded_strategy.load_sharded_metadata(Path(checkpoint_dir)))
    return out


def load_plain_tensors(checkpoint_dir: Union[str, Path]) -> StateDict:
    """{key: full global tensor on CPU} for every tensor of the checkpoint (every rank reads everything)."""
    sharded_state_dict = load_tensors_metadata(checkpoint_dir)
    for key, sh in sharded_state_dict.items():
        sh.data = torch.empty(sh.global_shape, dtype=sh.dtype)
    return load(sharded_state_dict, checkpoint_dir, validate_access_integrity=False)


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
    """Drop the tensors whose key starts with ``key_prefix`` from the checkpoint (collective)."""
    sharded_strategy = get_default_load_sharded_strategy(checkpoint_dir)
    sharded_strategy.remove_sharded_tensors(Path(checkpoint_dir), key_prefix)


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: Union[str, Path],
    sharded_strategy: Union[LoadShardedStrategy, None] = None,
    common_strategy: Union[LoadCommonStrategy, None] = None,
    validate_access_integrity: bool = True,
    strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
) -> Union[StateDict, Tuple[StateDict, Set[str], Set[str]]]:
    """Load ``sharded_state_dict`` from ``checkpoint_dir`` (collective over all ranks).

    ShardedTensors are loaded in place (into their ``data``) and replaced by the loaded tensors; ShardedObjects by the
    loaded objects; factories are merged; LocalNonpersistentObjects are unwrapped; the checkpoint's common state is
    merged in. For RETURN_UNEXPECTED / RETURN_ALL returns ``(state_dict, missing_keys, unexpected_keys)``.
    """
    checkpoint_dir = Path(checkpoint_dir)
    error, strategies = None, None
    try:
        strategies = verify_checkpoint_and_load_strategy(checkpoint_dir, sharded_strategy, common_strategy)
    except CheckpointingException as e:
        error = str(e)
    _collective_error(error)
    sharded_strategy, common_strategy = strategies
    strict = parse_strict_flag(strict)

    common_state_dict, error = None, None
    try:
        common_state_dict = common_strategy.load_common(checkpoint_dir)
    except CheckpointingException as e:
        error = str(e)
    _collective_error(error)

    sharded_state_dict = _copy_containers(sharded_state_dict)
    with_factories = _copy_containers(sharded_state_dict)
    apply_factories(sharded_state_dict)
    built = _copy_containers(sharded_state_dict)  # the structure factories built (lists stay lists)
    sharded_part, nonpersistent, _ = _split(sharded_state_dict)

    ckpt_sharded_metadata = None
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        error = None
        try:
            ckpt_sharded_metadata = load_sharded_metadata(checkpoint_dir, sharded_strategy, common_strategy)
        except CheckpointingException as e:
            error = str(e)
        _collective_error(error)
    sharded_part, missing_keys, unexpected_keys = validate_integrity_and_strict_load(
        sharded_part, strict, validate_access_integrity, ckpt_sharded_metadata=ckpt_sharded_metadata
    )

    if not sharded_strategy.can_handle_sharded_objects:
        objects, sharded_part = extract_matching_values(sharded_part, lambda v: isinstance(v, ShardedObject))
        loaded_objects = common_strategy.load_sharded_objects(objects, checkpoint_dir)
        merge(common_state_dict, loaded_objects)
    loaded = sharded_strategy.load(sharded_part, checkpoint_dir)  # collective: called even with nothing to load
    loaded = _restore_list_types(loaded, built)  # before merges: merge_fn gets what build_fn built (e.g. a list)
    loaded = apply_factory_merges(loaded, with_factories)
    merge(common_state_dict, loaded)
    nonpersistent = dict_list_map_outplace(lambda v: v.unwrap(), nonpersistent) if nonpersistent else nonpersistent
    if nonpersistent:
        merge(common_state_dict, nonpersistent)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return common_state_dict, missing_keys, unexpected_keys
    return common_state_dict
