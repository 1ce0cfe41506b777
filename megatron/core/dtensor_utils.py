"""How a Megatron-FSDP parameter is cut: the DTensor check and ``torch.chunk``'s dim-0 arithmetic.

A neutral home for the few facts that FSDP (``distributed/fsdp``), the sharded-tensor helpers
(``tensor_parallel/sharded_tensors.py``) and the optimizer all need about a ``Shard(0)`` DTensor, so that none of
them imports another for it. Plain torch only.
"""
from typing import Tuple

import torch

_DTENSOR_TYPE = None  # torch's DTensor class, imported on the first is_dtensor call (() without DTensor)


def is_dtensor(t) -> bool:
    """Whether ``t`` is a torch DTensor (a Megatron-FSDP sharded parameter). Called per parameter in every
    optimizer step, so the class is looked up once."""
    global _DTENSOR_TYPE
    if _DTENSOR_TYPE is None:
        try:
            from torch.distributed.tensor import DTensor as _DTENSOR_TYPE
        except ImportError:  # pragma: no cover - torch without DTensor
            _DTENSOR_TYPE = ()
    return isinstance(t, _DTENSOR_TYPE)


def chunk_range(dim0: int, world_size: int, rank: int) -> Tuple[int, int]:
    """``(offset, length)`` of ``rank``'s piece of ``torch.chunk(t, world_size, dim=0)`` (length may be 0)."""
    if dim0 == 0:
        return 0, 0
    size = -(-dim0 // world_size)
    start = min(rank * size, dim0)
    return start, max(0, min(size, dim0 - start))


def dtensor_shard_layout(t, key: str = "parameter") -> Tuple[int, int, int]:
    """``(shard rank, shard count, replica rank)`` of a Megatron-FSDP DTensor: ``Shard(0)`` on its last mesh
    dimension, ``Replicate()`` on the ones before it (hybrid sharding: replicas are the instances,
    ``--num-distributed-optimizer-instances``); anything else is refused naming ``key``."""
    from torch.distributed.tensor import Replicate, Shard

    placements, mesh = tuple(t.placements), t.device_mesh
    if not placements or placements[-1] != Shard(0) or not all(isinstance(p, Replicate) for p in placements[:-1]):
        raise NotImplementedError(f"{key}: only Shard(0) DTensors (after Replicate() mesh dimensions: hybrid "
                                  f"sharding) are supported, got {placements}")
    replica = 0
    for d in range(mesh.ndim - 1):
        replica = replica * mesh.size(d) + mesh.get_local_rank(d)
    return mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1), replica


def local_chunk_range(t, key: str = "parameter") -> Tuple[int, int]:
    """``(offset, length)`` on dim 0 of the full tensor of a Megatron-FSDP DTensor's local shard."""
    rank, count, _ = dtensor_shard_layout(t, key)
    return chunk_range(t.shape[0], count, rank)


def as_layout_of(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """(The optimizer's and ``precision_aware``'s helper.) ``value`` (a plain tensor: the LOCAL shard, or the full tensor) in ``param``'s layout (a DTensor shard when
    ``param`` is a DTensor)."""
    if not is_dtensor(param) or is_dtensor(value):
        return value
    out = torch.zeros_like(param, dtype=value.dtype)
    local = out.to_local()
    if tuple(value.shape) == tuple(local.shape):
        local.copy_(value)
    elif tuple(value.shape) == tuple(param.shape):
        start, length = local_chunk_range(param, "optimizer state")
        local.copy_(value[start : start + length])
    else:
        raise RuntimeError(
            f"optimizer state of shape {tuple(value.shape)} fits neither the local shard {tuple(local.shape)} nor "
            f"the parameter {tuple(param.shape)}"
        )
    return out
