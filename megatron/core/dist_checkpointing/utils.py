"""Helpers on sharded state dicts (upstream's ``dist_checkpointing.utils``): extracting kinds of leaves, renaming
sharded keys, shard identities and debug timing."""
import logging
import time
from contextlib import contextmanager
from typing import Dict, Iterable, Optional, Tuple

from .dict_utils import dict_list_map_inplace, extract_matching_values, nested_values
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)

logger = logging.getLogger(__name__)

# The identity of a tensor shard across ranks: (key, global offset, local shape, (start, stop) of the flattened
# range or ()). Upstream's id has no local shape; here it has, so that uneven shards that share an offset (an empty
# shard next to a full one) stay distinct.
_ShardId = Tuple[str, Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]


def _sharded_tensor_shard_id(sharded_tensor: ShardedTensor) -> _ShardId:
    """The id of ``sharded_tensor``'s data: equal on every rank that holds a replica of the same shard."""
    fr = sharded_tensor.flattened_range
    return (
        str(sharded_tensor.key),
        tuple(int(o) for o in sharded_tensor.global_offset),
        tuple(int(s) for s in sharded_tensor.local_shape),
        () if fr is None else (int(fr.start), int(fr.stop)),
    )


def _sharded_object_id(sharded_object: ShardedObject) -> Tuple[str, Tuple[int, ...], Tuple[int, ...]]:
    """The id of ``sharded_object``'s data: (key, global offset, global shape)."""
    return sharded_object.key, tuple(sharded_object.global_offset), tuple(sharded_object.global_shape)


def zip_strict(*args: Iterable):
    """``zip`` that raises ValueError (with the lengths) if the iterables differ in length."""
    lists = [list(a) for a in args]
    lengths = [len(a) for a in lists]
    if len(set(lengths)) > 1:
        raise ValueError(f"zip_strict: iterables of different lengths {lengths}")
    return zip(*lists)


def _extract(sharded_state_dict: ShardedStateDict, types) -> Tuple[ShardedStateDict, StateDict]:
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, types))


def extract_sharded_tensors(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(the ShardedTensors, everything else), both keeping the nested structure."""
    return _extract(sharded_state_dict, ShardedTensor)


def extract_sharded_tensors_and_factories(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(the ShardedTensors and ShardedTensorFactories, everything else)."""
    return _extract(sharded_state_dict, (ShardedTensor, ShardedTensorFactory))


def extract_sharded_tensors_or_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """(the ShardedTensors, ShardedTensorFactories and LocalNonpersistentObjects, everything else)."""
    return _extract(sharded_state_dict, (ShardedTensor, ShardedTensorFactory, LocalNonpersistentObject))


def extract_sharded_base(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(the ShardedBase leaves: tensors, objects, factories; everything else)."""
    return _extract(sharded_state_dict, ShardedBase)


def extract_nonpersistent(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(the LocalNonpersistentObjects, everything else)."""
    return _extract(sharded_state_dict, LocalNonpersistentObject)


def _is_keyed(x) -> bool:
    return isinstance(x, (ShardedTensor, ShardedTensorFactory, ShardedObject))


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend ``prefix`` to the key of every sharded leaf, in place."""

    def fn(x):
        if _is_keyed(x):
            x.key = f"{prefix}{x.key}"
        return x

    dict_list_map_inplace(fn, sharded_state_dict)


def replace_prefix_for_sharding(sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str) -> None:
    """Replace ``old_prefix`` by ``new_prefix`` in the key of every sharded leaf, in place; ValueError naming the
    key if one does not start with ``old_prefix``."""

    def fn(x):
        if _is_keyed(x):
            if not x.key.startswith(old_prefix):
                raise ValueError(f"sharded key {x.key!r} does not start with prefix {old_prefix!r}")
            x.key = new_prefix + x.key[len(old_prefix):]
        return x

    dict_list_map_inplace(fn, sharded_state_dict)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: Dict[str, str]) -> None:
    """For every sharded leaf whose key starts with a prefix of ``prefix_map`` (the first matching one, in the
    map's order), replace that prefix by its value; other keys are kept. In place."""

    def fn(x):
        if _is_keyed(x):
            for old, new in prefix_map.items():
                if x.key.startswith(old):
                    x.key = new + x.key[len(old):]
                    break
        return x

    dict_list_map_inplace(fn, sharded_state_dict)


def force_all_tensors_to_non_fp8(sharded_state_dict: ShardedStateDict) -> None:
    """Replace, in place, every quantized (FP8/FP4) ``data`` of the sharded leaves by its high-precision
    dequantized value (upstream does this before every load; this fork's load does it only without
    ``--stream-ckpt-dequant``, see ``strategies/stream_ckpt_dequant.py``)."""
    from ..fp8_utils import dequantize, is_quantized_tensor

    for v in nested_values(sharded_state_dict):
        data = getattr(v, "data", None)
        if data is not None and is_quantized_tensor(data):
            v.data = dequantize(data)


_name_stack = []


@contextmanager
def logger_stack(name: Optional[str] = None, current_logger: Optional[logging.Logger] = None):
    """Push ``name`` on the stack of timing scopes; yields (the dotted scope name, the logger to use)."""
    if name:
        _name_stack.append(name)
    try:
        yield ".".join(_name_stack), current_logger or logger
    finally:
        if name:
            _name_stack.pop()


@contextmanager
def debug_time(name: str, logger: Optional[logging.Logger] = None, threshold: float = float("-inf"), level=None):
    """Log how long the block took (DEBUG; WARNING when ``threshold`` is given and exceeded); also a decorator."""
    with logger_stack(name, logger) as (scope, log):
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            if elapsed >= threshold:
                if level is None:
                    level = logging.DEBUG if threshold == float("-inf") else logging.WARNING
                log.log(level, f"{scope} took {elapsed:.4f}s")


def debug_msg(msg: str) -> None:
    """Log ``msg`` (DEBUG) prefixed with the current timing scope."""
    with logger_stack() as (scope, log):
        log.debug(f"{scope} {msg}")
