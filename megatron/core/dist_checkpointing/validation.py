"""Checks around save and load: sharding integrity (across ranks) and strict key handling.

Key mismatch naming follows upstream megatron-core (it is about the *checkpoint*, unlike torch's load_state_dict):
- "unexpected" keys: requested in the sharded state dict but absent from the checkpoint;
- "missing" keys: present in the checkpoint but requested by no rank.
"""
import logging
import pickle
from collections import defaultdict
from enum import Enum
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple, Union

import torch.distributed as dist

from .. import dist_utils
from .core import CheckpointingException, check_is_distributed_checkpoint, maybe_load_config  # noqa: F401
# upstream 0.19 keeps the integrity manifest's names in this module; the code lives in integrity.py
from .integrity import INTEGRITY_FNAME, save_integrity_manifest, verify_integrity_manifest  # noqa: F401
from .dict_utils import diff, extract_matching_values, nested_values
from .mapping import ShardedBase, ShardedObject, ShardedStateDict, ShardedTensor, StateDict, is_main_replica

logger = logging.getLogger(__name__)


class StrictHandling(Enum):
    """How ``load`` treats mismatches between the requested keys and the checkpoint's keys.

    - ASSUME_OK_UNEXPECTED: no check (fastest); a requested key absent from the checkpoint fails in the strategy.
    - LOG_UNEXPECTED: log unexpected keys (warning), skip loading them; missing keys ignored.
    - LOG_ALL: log unexpected and missing keys.
    - RAISE_UNEXPECTED: raise on unexpected keys.
    - RAISE_ALL: raise on unexpected or missing keys.
    - RETURN_UNEXPECTED: ``load`` returns ``(state_dict, missing=set(), unexpected)``; unexpected keys are skipped.
    - RETURN_ALL: ``load`` returns ``(state_dict, missing, unexpected)``.
    - IGNORE_ALL: skip unexpected keys silently.
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: "StrictHandling") -> bool:
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: "StrictHandling") -> bool:
        """Missing keys (requested by no rank) need every rank's requests."""
        return val in (StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(val: "StrictHandling") -> bool:
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)

    @staticmethod
    def requires_raising(val: "StrictHandling") -> bool:
        return val in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL)


def parse_strict_flag(strict: Union[str, bool, StrictHandling]) -> StrictHandling:
    """A StrictHandling from itself, its value string (e.g. ``'raise_all'``) or a bool (True: RAISE_ALL,
    False: ASSUME_OK_UNEXPECTED)."""
    if isinstance(strict, StrictHandling):
        return strict
    if isinstance(strict, bool):
        return StrictHandling.RAISE_ALL if strict else StrictHandling.ASSUME_OK_UNEXPECTED
    if isinstance(strict, str):
        try:
            return StrictHandling(strict.lower())
        except ValueError:
            pass
    raise ValueError(
        f"invalid strict flag {strict!r}; expected one of {[s.value for s in StrictHandling]}"
    )


def _group_src(process_group=None) -> int:
    """The global rank of ``process_group``'s rank 0 (the source of its broadcasts)."""
    return 0 if process_group is None else dist.get_global_rank(process_group, 0)


def local_sharded_metadata(sharded_state_dict: ShardedStateDict) -> List[ShardedBase]:
    """Data-less copies of the sharded entries (anything with ``without_data``, as upstream: duck-typed)."""
    return [v.without_data() for v in nested_values(sharded_state_dict) if hasattr(v, "without_data")]


def determine_global_metadata(
    sharded_state_dict: ShardedStateDict, process_group: Optional[dist.ProcessGroup] = None
) -> Tuple[List[ShardedBase], List[List[ShardedBase]]]:
    """(this rank's metadata, every rank's metadata): data-less ShardedTensors/ShardedObjects, gathered over
    ``process_group`` (default: WORLD; collective over it)."""
    local = local_sharded_metadata(sharded_state_dict)
    if process_group is None and not dist_utils.is_distributed():
        return local, [local]  # one process without torch.distributed: nothing to gather
    ws = dist.get_world_size(group=process_group)  # an explicit group is always asked, as upstream
    if ws == 1:
        return local, [local]
    gathered: List[Optional[List[ShardedBase]]] = [None] * ws
    dist.all_gather_object(gathered, local, group=process_group)
    return local, gathered


# ---- sharding integrity -----------------------------------------------------------------------------------------
def flat_range_boxes(
    local_shape: Tuple[int, ...], start: int, stop: int
) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """Decompose the flat range ``[start, stop)`` of a row-major ``local_shape`` array into boxes ``(offset, shape)``
    (each one also contiguous in memory); at most ``2 * ndim - 1`` boxes."""
    nd = len(local_shape)
    if stop <= start:
        return []
    if nd == 0:
        return [((), ())]
    strides = [1] * nd
    for i in range(nd - 2, -1, -1):
        strides[i] = strides[i + 1] * local_shape[i + 1]

    def unravel(idx):
        out = []
        for s in strides:
            out.append(idx // s)
            idx %= s
        return out

    boxes = []
    pos = start
    while pos < stop:
        coords = unravel(pos)
        # largest axis k such that the box "coords[:k] fixed, axis k from coords[k], axes > k full" fits
        chosen = None
        for k in range(nd):
            if all(c == 0 for c in coords[k + 1 :]):
                count = min(local_shape[k] - coords[k], (stop - pos) // strides[k])
                if count >= 1:
                    chosen = (k, count)
                    break
        k, count = chosen
        shape = [1] * k + [count] + list(local_shape[k + 1 :])
        boxes.append((tuple(coords), tuple(shape)))
        pos += count * strides[k]
    return boxes


def _shard_boxes(sh_ten: ShardedTensor) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """Global boxes covered by a shard (one box; several for a flattened range)."""
    offset, box_shape = sh_ten.global_box()
    if sh_ten.flattened_range is None:
        return [(offset, box_shape)] if all(s > 0 for s in box_shape) else []
    fr = sh_ten.flattened_range
    return [
        (tuple(o + lo for o, lo in zip(offset, b_off)), b_shape)
        for b_off, b_shape in flat_range_boxes(box_shape, fr.start, fr.stop)
    ]


def _overlap(a, b) -> bool:
    (o1, s1), (o2, s2) = a, b
    return all(x1 < x2 + l2 and x2 < x1 + l1 for x1, l1, x2, l2 in zip(o1, s1, o2, s2))


def _validate_tensor_key(key: str, shards: List[ShardedTensor]) -> Optional[str]:
    shapes = {t.global_shape for t in shards}
    if len(shapes) > 1:
        return f"inconsistent global shapes for key {key!r} across shards: {sorted(shapes)}"
    dtypes = {t.dtype for t in shards}
    if len(dtypes) > 1:
        return f"inconsistent dtypes for key {key!r} across shards: {sorted(map(str, dtypes))}"
    global_shape = shards[0].global_shape
    total = 1
    for s in global_shape:
        total *= s
    boxes = []
    for t in shards:
        if is_main_replica(t.replica_id):
            boxes.extend((b, t) for b in _shard_boxes(t))
    covered = 0
    for (o, s), _ in boxes:
        n = 1
        for x in s:
            n *= x
        covered += n
    # sweep along the largest axis
    if global_shape and len(boxes) > 1:
        dim = max(range(len(global_shape)), key=lambda d: global_shape[d])
        order = sorted(range(len(boxes)), key=lambda i: (boxes[i][0][0][dim], boxes[i][0][0]))
        active: List[int] = []
        for i in order:
            (o, s), t = boxes[i]
            start = o[dim]
            active = [j for j in active if boxes[j][0][0][dim] + boxes[j][0][1][dim] > start]
            for j in active:
                if _overlap(boxes[i][0], boxes[j][0]):
                    t2 = boxes[j][1]
                    return (
                        f"overlapping main-replica shards of key {key!r} (global shape {global_shape}): offsets "
                        f"{t2.global_offset} and {t.global_offset} (local shapes {t2.local_shape} and "
                        f"{t.local_shape}); exactly one main replica (replica_id 0) may hold each element"
                    )
            active.append(i)
    if covered != total:
        return (
            f"incomplete sharding of key {key!r}: main replicas (replica_id 0) cover {covered} of {total} elements "
            f"of global shape {global_shape}"
        )
    return None


def _validate_object_key(key: str, shards: List[ShardedObject]) -> Optional[str]:
    shapes = {o.global_shape for o in shards}
    if len(shapes) > 1:
        return f"inconsistent global shapes for sharded object {key!r}: {sorted(shapes)}"
    seen = set()
    for o in shards:
        if not is_main_replica(o.replica_id):
            continue
        if o.global_offset in seen:
            return f"sharded object {o.unique_key!r} has more than one main replica (replica_id 0)"
        seen.add(o.global_offset)
    expected = 1
    for s in shards[0].global_shape:
        expected *= s
    if len(seen) != expected:
        return f"incomplete sharded object {key!r}: main replicas of {len(seen)} of {expected} shards"
    return None


def sharding_integrity_errors(global_metadata: List[List[ShardedBase]]) -> List[str]:
    """Errors of the gathered metadata: per key consistent shape/dtype and exact cover by main replicas."""
    tensors: Dict[str, List[ShardedTensor]] = defaultdict(list)
    objects: Dict[str, List[ShardedObject]] = defaultdict(list)
    for rank_md in global_metadata:
        for sh in rank_md:
            if isinstance(sh, ShardedTensor):
                tensors[sh.key].append(sh)
            elif isinstance(sh, ShardedObject):
                objects[sh.key].append(sh)
    errors = []
    for key in sorted(tensors):
        err = _validate_tensor_key(key, tensors[key])
        if err:
            errors.append(err)
    for key in sorted(objects):
        if key in tensors:
            errors.append(f"key {key!r} is both a ShardedTensor and a ShardedObject")
            continue
        err = _validate_object_key(key, objects[key])
        if err:
            errors.append(err)
    return errors


_NOT_COMPARABLE = "<common state of rank 0 is not picklable>"


def _validate_common_state_dict(common_state_dict, process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Log (warning, upstream's text) on every rank whose common state differs from rank 0's (only rank 0's is
    saved). Collective over ``process_group`` (default: WORLD); nothing without torch.distributed."""
    rank, ws = dist_utils.get_rank(process_group), dist_utils.get_world_size(process_group)
    if ws == 1:
        return
    box = [None]
    if rank == 0:
        try:  # an unpicklable common state is not compared here: the save fails on it later, naming it
            pickle.dumps(common_state_dict)
            box = [common_state_dict]
        except Exception:
            box = [_NOT_COMPARABLE]
    dist.broadcast_object_list(box, src=_group_src(process_group), group=process_group)
    if rank == 0 or (isinstance(box[0], str) and box[0] == _NOT_COMPARABLE):
        return
    only_in_rank0, only_here, mismatch = diff(box[0], common_state_dict)
    if only_in_rank0 or only_here or mismatch:
        logger.warning(
            f"Rank {rank} common state dict differs from rank 0 common state dict. "
            f"Keys only on rank 0: {only_in_rank0}, "
            f"Keys only on {rank}: {only_here}, "
            f"Mismatched keys: {mismatch}"
        )


def validate_sharding_integrity(
    global_metadata: List[List[ShardedBase]],
    common_state_dict: Optional[StateDict] = None,
    process_group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Check the gathered metadata (upstream's signature): the group's rank 0 checks, every rank of
    ``process_group`` (default: WORLD) raises the same CheckpointingException on error (collective).

    With ``common_state_dict`` (what a save writes from rank 0), every other rank first compares its own common
    state with rank 0's and logs upstream's "Rank R common state dict differs from rank 0 ..." warning."""
    if common_state_dict is not None:
        _validate_common_state_dict(common_state_dict, process_group)
    rank, ws = dist_utils.get_rank(process_group), dist_utils.get_world_size(process_group)
    errors = sharding_integrity_errors(global_metadata) if rank == 0 else None
    if ws > 1:
        box = [errors]
        dist.broadcast_object_list(box, src=_group_src(process_group), group=process_group)
        errors = box[0]
    if errors:
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise CheckpointingException("invalid sharding: " + "; ".join(errors[:3]) + more)


# ---- strict key handling ----------------------------------------------------------------------------------------
def _determine_missing_and_unexpected_keys(
    ckpt_sharded_metadata: ShardedStateDict,
    local_metadata: List[ShardedBase],
    global_metadata: Optional[List[List[ShardedBase]]] = None,
) -> Tuple[Set[str], Set[str]]:
    """(missing, unexpected): checkpoint keys requested by no rank (needs global metadata; else empty) and locally
    requested keys absent from the checkpoint."""
    ckpt_keys = {sh.key for sh in ckpt_sharded_metadata.values()}
    local_keys = {sh.key for sh in local_metadata}
    unexpected = local_keys - ckpt_keys
    if global_metadata is not None:
        global_keys = {sh.key for rank_md in global_metadata for sh in rank_md}
        missing = ckpt_keys - global_keys
    else:
        missing = set()
    return missing, unexpected


def adjust_non_strict_load(sharded_state_dict: ShardedStateDict, sharded_keys_to_remove: Set[str]):
    """Drop the ShardedTensors/ShardedObjects whose key is in ``sharded_keys_to_remove``."""

    def is_unexpected(x):
        return isinstance(x, ShardedBase) and x.key in sharded_keys_to_remove

    _, kept = extract_matching_values(sharded_state_dict, is_unexpected)
    return kept


def maybe_report_missing_and_unexpected_keys(
    missing_keys: Set[str], unexpected_keys: Set[str], raise_error: bool = True
) -> None:
    """Raise (CheckpointingException) or log (warning) the key mismatch, in upstream's words ("Unexpected keys
    ...", "Missing keys ..."), on one line; nothing if both sets are empty."""
    if not missing_keys and not unexpected_keys:
        return
    parts = []
    if unexpected_keys:
        parts.append(
            "Unexpected keys (not found in the checkpoint) encountered in the provided sharded state dict: "
            f"unexpected keys (for this rank): {sorted(unexpected_keys)}."
        )
    if missing_keys:
        parts.append(
            "Some keys found in the checkpoint are missing in the provided sharded state dict: "
            f"Missing keys (for all ranks): {sorted(missing_keys)}."
        )
    msg = " ".join(parts)
    if raise_error:
        raise CheckpointingException(msg)
    logger.warning(msg)


def validate_integrity_and_strict_load(
    sharded_state_dict: ShardedStateDict,
    strict: StrictHandling,
    validate_access_integrity: bool,
    local_metadata: Optional[List[ShardedBase]] = None,
    global_metadata: Optional[List[List[ShardedBase]]] = None,
    ckpt_sharded_metadata: Optional[ShardedStateDict] = None,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
) -> Tuple[ShardedStateDict, Set[str], Set[str]]:
    """Apply ``strict`` and (optionally) the sharding integrity check before a load.

    Returns the sharded state dict to load (unexpected keys dropped unless raising) and (missing, unexpected).
    Raising happens on every rank (the decision is collective when distributed).
    """
    missing_keys: Set[str] = set()
    unexpected_keys: Set[str] = set()
    ws = dist_utils.get_world_size(process_group)
    if local_metadata is None and (validate_access_integrity or StrictHandling.requires_explicit_ckpt_mismatch_check(strict)):
        local_metadata = local_sharded_metadata(sharded_state_dict)
    need_global = validate_access_integrity or StrictHandling.requires_global_app_metadata(strict)
    if need_global and global_metadata is None:
        if ws > 1:
            global_metadata = [None] * ws
            dist.all_gather_object(global_metadata, local_metadata, group=process_group)
        else:
            global_metadata = [local_metadata]
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        if ckpt_sharded_metadata is None:
            raise CheckpointingException(f"strict={strict.value} needs the checkpoint's sharded metadata")
        missing_keys, unexpected_keys = _determine_missing_and_unexpected_keys(
            ckpt_sharded_metadata,
            local_metadata,
            global_metadata if StrictHandling.requires_global_app_metadata(strict) else None,
        )
        if strict == StrictHandling.IGNORE_ALL:
            missing_keys, unexpected_keys = set(), set()
        elif strict in (
            StrictHandling.RAISE_UNEXPECTED,
            StrictHandling.LOG_UNEXPECTED,
            StrictHandling.RETURN_UNEXPECTED,
        ):
            missing_keys = set()
        if StrictHandling.requires_raising(strict):
            error = None
            try:
                maybe_report_missing_and_unexpected_keys(missing_keys, unexpected_keys, raise_error=True)
            except CheckpointingException as e:
                error = str(e)
            dist_utils.raise_collectively(error, CheckpointingException, "strict load", process_group)
        else:
            if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
                maybe_report_missing_and_unexpected_keys(missing_keys, unexpected_keys, raise_error=False)
        # drop the requested keys that the checkpoint does not have (everyone's, so integrity stays coherent)
        _, _unexp_all = _determine_missing_and_unexpected_keys(ckpt_sharded_metadata, local_metadata)
        if _unexp_all:
            sharded_state_dict = adjust_non_strict_load(sharded_state_dict, _unexp_all)
            if global_metadata is not None:
                global_metadata = [[sh for sh in md if sh.key not in _unexp_all] for md in global_metadata]
    if validate_access_integrity:
        validate_sharding_integrity(_one_request_per_region(global_metadata), process_group=process_group)
    return sharded_state_dict, missing_keys, unexpected_keys


def _one_request_per_region(global_metadata: List[List[ShardedBase]]) -> List[List[ShardedBase]]:
    """A load's requests with, per rank, only the first of several ShardedTensors that ask for the same region of
    one key (same offsets, shape and flattened range) in different dtypes: reading one region twice, once per
    dtype, is a valid load (an optimizer's fp32 main params read from the model's weights beside the model's own
    bf16 copy), not an overlap of two main replicas."""
    out = []
    for rank_md in global_metadata:
        seen, kept = set(), []
        for sh in rank_md:
            if isinstance(sh, ShardedTensor):
                fr = sh.flattened_range
                ident = (sh.key, tuple(sh.global_offset), tuple(sh.local_shape),
                         (fr.start, fr.stop) if fr is not None else None)
                if ident in seen:
                    continue
                seen.add(ident)
            kept.append(sh)
        out.append(kept)
    return out


def _default_or_checked_strategy(strategy, action, backend, version):
    """The default ``action`` strategy for ``backend``/``version`` if ``strategy`` is None, else ``strategy`` after
    its backend and version compatibility checks."""
    from .strategies.base import get_default_strategy

    if strategy is None:
        return get_default_strategy(action, backend, version)
    strategy.check_backend_compatibility(backend)
    strategy.check_version_compatibility(version)
    return strategy


def verify_checkpoint(checkpoint_dir: Union[str, Path]):
    """The checkpoint's CheckpointingConfig (``metadata.json``); CheckpointingException naming the directory if it
    does not exist or is not a distributed checkpoint (upstream's ``verify_checkpoint``)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointingException(f"checkpoint directory {checkpoint_dir} does not exist")
    config = maybe_load_config(checkpoint_dir)
    if config is None:
        raise CheckpointingException(
            f"{checkpoint_dir} is not a distributed checkpoint: {checkpoint_dir / 'metadata.json'} is missing"
        )
    return config


def verify_checkpoint_and_load_strategy(checkpoint_dir: Union[str, Path], sharded_strategy=None, common_strategy=None):
    """(sharded_strategy, common_strategy) to load ``checkpoint_dir``: the defaults for its metadata.json, or the
    given ones after a compatibility check; common_strategy is None for upstream 0.19's layout (no ``common.pt``).
    CheckpointingException if it is not a distributed checkpoint."""
    from .strategies.base import StrategyAction, get_default_strategy

    checkpoint_dir = Path(checkpoint_dir)
    config = verify_checkpoint(checkpoint_dir)
    try:
        if isinstance(sharded_strategy, tuple):
            sharded_strategy = get_default_strategy(StrategyAction.LOAD_SHARDED, *sharded_strategy)
        if isinstance(common_strategy, tuple):
            common_strategy = get_default_strategy(StrategyAction.LOAD_COMMON, *common_strategy)
        sharded_strategy = _default_or_checked_strategy(
            sharded_strategy, StrategyAction.LOAD_SHARDED, config.sharded_backend, config.sharded_backend_version
        )
        if config.has_common_file:
            common_strategy = _default_or_checked_strategy(
                common_strategy, StrategyAction.LOAD_COMMON, config.common_backend, config.common_backend_version
            )
        else:  # upstream 0.19's layout: the common state is an object inside the sharded (DCP) part
            common_strategy = None
    except CheckpointingException as e:
        raise CheckpointingException(f"{checkpoint_dir / 'metadata.json'}: {e}") from e
    return sharded_strategy, common_strategy
