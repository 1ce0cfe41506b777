"""The sharded-tensor helpers: a layer's local tensors as ShardedTensor / ShardedObject pieces of the global
checkpoint tensor (the tensor-parallel axis and fragment, the data-parallel replica id, the prepended layer / expert
axes, a Megatron-FSDP DTensor's dim-0 shard).

They stand at the bottom of the model stack: ``tensor_parallel/layers.py``, ``tensor_parallel/te_layers.py`` and
``transformer/`` build their ``sharded_state_dict`` with them. Upstream keeps these names in
``megatron/core/utils.py`` and ``megatron/core/transformer/utils.py``; both re-export them from here.
"""
from typing import Dict, Iterable, Optional, Tuple

import torch

from megatron.core import parallel_state
from megatron.core.dtensor_utils import chunk_range, dtensor_shard_layout, is_dtensor
from megatron.core.tensor_parallel.utils import tp_group_info


# Upstream's layout: a module's sharded state dict is keyed by its state-dict names (``decoder.layers.0.mlp...``)
# while each ShardedTensor/ShardedObject ``.key`` is the checkpoint key. ``sharded_offsets`` is a tuple of
# ``(axis, offset, fragments)`` for the PREPENDED axes (axis 0: the layer index of stacked homogeneous layers, axis
# 1: the expert index of SequentialMLP experts); the local tensor does not have those axes.
def _tp_info(tp_group=None) -> Tuple[int, int]:
    """``(tp_rank, tp_size)`` of ``tp_group`` (default: the tensor-parallel group; ``(0, 1)`` before init)."""
    _, size, rank = tp_group_info(tp_group=tp_group)
    return rank, size


def _dp_replica_id(tp_group=None) -> Tuple[int, int, int]:
    """Upstream's replica id of a TP-replicated tensor: ``(0, tp_rank, dp_rank)`` (rank 0 of both writes it)."""
    return (0, _tp_info(tp_group)[0], parallel_state.get_data_parallel_rank(with_context_parallel=True))


def _check_prepend_offsets(key: str, prepend_offsets) -> Tuple[Tuple[int, int, int], ...]:
    """The offsets sorted by axis; they must be exactly the axes ``0..n-1`` (the prepended axes)."""
    offs = tuple(sorted((tuple(int(x) for x in o) for o in prepend_offsets), key=lambda o: o[0]))
    if [o[0] for o in offs] != list(range(len(offs))):
        raise ValueError(f"{key}: sharded_offsets {prepend_offsets} must name the prepended axes 0..n-1 exactly once")
    return offs


def _dtensor_sharded_tensor(tensor, key: str, prepend_offsets, tp_axis: Optional[int] = None, tp_group=None,
                            **kwargs):
    """The local shard of a ``Shard(0)`` DTensor (torch.chunk-style, possibly uneven or empty) placed in the global
    tensor: its dim 0 is global axis ``len(prepend_offsets)``. With ``tp_axis`` the DTensor is this TP rank's piece
    (split on ``tp_axis``), placed at ``tp_rank * piece`` on that axis. A TP-split or DP-sharded piece is distinct
    on every rank (``replica_id=0``); a TP-replicated one is written by TP rank 0 (``replica_id=(0, tp_rank, 0)``);
    under hybrid sharding (``(Replicate(), Shard(0))``) the shards of instance 0 are written (last replica entry:
    the instance)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    shard_rank, shard_count, replica = dtensor_shard_layout(tensor, key)
    tp_shape = tuple(tensor.shape)
    if not tp_shape:
        raise NotImplementedError(f"{key}: 0-dim sharded parameter")
    local = tensor.to_local()
    if isinstance(local, torch.nn.Parameter):
        local = local.data
    start, length = chunk_range(tp_shape[0], shard_count, shard_rank)
    if local.shape[0] != length or tuple(local.shape[1:]) != tp_shape[1:]:
        raise RuntimeError(
            f"{key}: local shard shape {tuple(local.shape)} is not torch.chunk's piece {length} of {tp_shape}"
        )
    offs = _check_prepend_offsets(key, prepend_offsets)
    global_shape, offset = list(tp_shape), [start] + [0] * (len(tp_shape) - 1)
    tp_rank, tp_size = _tp_info(tp_group)
    replica_id = 0 if replica == 0 else (0, 0, replica)  # hybrid sharding: instance 0 writes
    if tp_axis is not None:
        global_shape[tp_axis] *= tp_size
        offset[tp_axis] += tp_rank * tp_shape[tp_axis]
    elif tp_size > 1:
        replica_id = (0, tp_rank, replica)
    return ShardedTensor.from_global_offsets(
        key,
        local,
        tuple(o[2] for o in offs) + tuple(global_shape),
        tuple(o[1] for o in offs) + tuple(offset),
        replica_id=replica_id,
        prepend_axis_num=len(offs),
        **kwargs,
    )


def make_sharded_tensor_for_checkpoint(tensor, key: str, prepend_offsets=(), replica_id=None, tp_group=None,
                                       **kwargs):
    """A ShardedTensor of a tensor replicated over tensor- and data-parallel ranks with the prepended axes
    ``prepend_offsets`` (``replica_id=(0, tp_rank, dp_rank)`` as upstream); a DTensor (Megatron-FSDP)
    contributes its local shard (see ``_dtensor_sharded_tensor``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if is_dtensor(tensor):
        return _dtensor_sharded_tensor(tensor, key, prepend_offsets, tp_group=tp_group, **kwargs)
    offs = _check_prepend_offsets(key, prepend_offsets)
    if replica_id is None:
        replica_id = _dp_replica_id(tp_group)
    return ShardedTensor.from_rank_offsets(
        key, tensor, *offs, replica_id=replica_id, prepend_axis_num=len(offs), **kwargs
    )


def make_tp_sharded_tensor_for_checkpoint(tensor, key: str, tp_axis: int = 0, prepend_offsets=(), replica_id=None,
                                          tp_group=None, **kwargs):
    """A ShardedTensor of this TP rank's piece of a tensor split on ``tp_axis`` (of the local tensor): that axis
    is the fragment ``(tp_rank, tp_size)`` of the global tensor, replicated over data-parallel ranks
    (``replica_id=(0, 0, dp_rank)``), as upstream. A DTensor (Megatron-FSDP) is also sharded on its dim 0."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if is_dtensor(tensor):
        return _dtensor_sharded_tensor(tensor, key, prepend_offsets, tp_axis=tp_axis, tp_group=tp_group, **kwargs)
    offs = _check_prepend_offsets(key, prepend_offsets)
    tp_rank, tp_size = _tp_info(tp_group)
    if replica_id is None:
        replica_id = (0, 0, parallel_state.get_data_parallel_rank(with_context_parallel=True))
    return ShardedTensor.from_rank_offsets(
        key, tensor, *offs, (tp_axis + len(offs), tp_rank, tp_size), replica_id=replica_id,
        prepend_axis_num=len(offs), **kwargs
    )


def extra_state_shape_and_offset(key: str, sharded_offsets=()) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """``(global_shape, global_offset)`` of an ``_extra_state`` ShardedObject: one object per prepended-axis index
    (``(L,)`` per layer, ``(L, E)`` per expert), ``(1,)``/``(0,)`` without prepended axes, as upstream."""
    offs = _check_prepend_offsets(key, sharded_offsets)
    if not offs:
        return (1,), (0,)
    return tuple(o[2] for o in offs), tuple(o[1] for o in offs)


def make_sharded_object_for_checkpoint(obj, key: str, sharded_offsets=(), replica_id=None, tp_group=None, **kwargs):
    """A ShardedObject (e.g. ``_extra_state``) replicated over TP and DP ranks (``(0, tp_rank, dp_rank)``), one per prepended-axis index (stored as
    ``key/shard_<offsets>_<shape>``, e.g. ``.../_extra_state/shard_1.3_2.4`` for layer 1, expert 3 of (2, 4))."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if replica_id is None:
        replica_id = _dp_replica_id(tp_group)
    shape, offset = extra_state_shape_and_offset(key, sharded_offsets)
    return ShardedObject(key, obj, shape, offset, replica_id=replica_id, **kwargs)


def make_sharded_tensors_for_checkpoint(
    state_dict: Dict[str, object],
    prefix: str,
    tensor_parallel_layers_axis_map: Optional[Dict[str, int]] = None,
    sharded_offsets: Iterable[Tuple[int, int, int]] = (),
    extra_state_suffix: str = "_extra_state",
    tp_group=None,
) -> Dict[str, object]:
    """``{prefix + key: ShardedTensor | ShardedObject}`` for a module's local ``state_dict``.

    Keys in ``tensor_parallel_layers_axis_map`` are TP-split on that axis (:func:`make_tp_sharded_tensor_for_checkpoint`),
    other tensors TP-replicated (:func:`make_sharded_tensor_for_checkpoint`), all with the prepended axes
    ``sharded_offsets``; ``*_extra_state`` entries become ShardedObjects.
    """
    sharded_offsets = tuple(sharded_offsets)
    axis_map = tensor_parallel_layers_axis_map or {}
    out = {}
    for key, value in state_dict.items():
        full = f"{prefix}{key}"
        if key.endswith(extra_state_suffix):
            out[full] = make_sharded_object_for_checkpoint(value, full, sharded_offsets, tp_group=tp_group)
        elif isinstance(value, torch.Tensor):
            if key in axis_map:
                out[full] = make_tp_sharded_tensor_for_checkpoint(value, full, axis_map[key], sharded_offsets,
                                                                  tp_group=tp_group)
            else:
                out[full] = make_sharded_tensor_for_checkpoint(value, full, sharded_offsets, tp_group=tp_group)
        else:
            raise TypeError(f"make_sharded_tensors_for_checkpoint: state dict entry {full!r} is a {type(value)}")
    return out
