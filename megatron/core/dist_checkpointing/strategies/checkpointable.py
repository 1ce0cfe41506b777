"""A ShardedTensor that PyTorch DCP saves directly (upstream 0.19's ``strategies.checkpointable``).

``CheckpointableShardedTensor.from_sh_ten(sh_ten)`` is a data-less tensor of the global shape that implements DCP's
checkpointable protocol (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``): DCP writes
the shard's local data at its global offset, as one chunk. It supports no tensor operations. Flattened shards
(``flattened_range``) are refused: their data is not one box of the global tensor.

``LocalShardsContainer([...])`` holds several such shards of one key on one rank (DCP takes one tensor per key
and rank): its write items and chunks are those of every shard, and a read is matched to the shard at the index's
offset.
"""
from typing import List

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..core import CheckpointingException
from ..mapping import ShardedTensor


def _box(sh_ten: ShardedTensor):
    """(global offset, local shape) of the shard, checked against its data."""
    if sh_ten.flattened_range is not None:
        raise CheckpointingException(
            f"{sh_ten.key}: a flattened ShardedTensor (flattened_range={sh_ten.flattened_range}) cannot be a "
            "CheckpointableShardedTensor"
        )
    shape = torch.Size(sh_ten.local_shape)
    if sh_ten.data is None or tuple(sh_ten.data.shape) != tuple(shape):
        got = None if sh_ten.data is None else tuple(sh_ten.data.shape)
        raise CheckpointingException(f"{sh_ten.key}: data of shape {got} does not match local_shape {tuple(shape)}")
    return torch.Size(sh_ten.global_offset), shape


class CheckpointableShardedTensor(torch.Tensor):
    """One rank's shard of a global tensor, saved by DCP at its global offset (DCP's checkpointable protocol)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, sh_ten: ShardedTensor):
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(sh_ten.global_shape), dtype=sh_ten.dtype)

    def __init__(self, data: torch.Tensor, sh_ten: ShardedTensor):
        self._data = data
        self._sh_ten = sh_ten

    @classmethod
    def from_sh_ten(cls, sh_ten: ShardedTensor) -> "CheckpointableShardedTensor":
        """Wrap ``sh_ten`` (a ShardedTensor with data)."""
        if not isinstance(sh_ten, ShardedTensor):
            raise CheckpointingException(f"from_sh_ten expects a ShardedTensor, got {type(sh_ten).__name__}")
        _box(sh_ten)
        return cls(sh_ten.data, sh_ten)

    def __create_write_items__(self, fqn: str, sh_ten: "CheckpointableShardedTensor", index: int = None):
        offsets, shape = _box(sh_ten._sh_ten)
        data = sh_ten._sh_ten.data
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets, index),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=shape),
                    properties=TensorProperties.create_from_tensor(data),
                    size=torch.Size(sh_ten._sh_ten.global_shape),
                ),
            )
        ]

    def __create_chunk_list__(self):
        offsets, shape = _box(self._sh_ten)
        return [ChunkStorageMetadata(offsets=offsets, sizes=shape)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self._sh_ten.data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{cls.__name__} supports no tensor operations (called {func})")

    def __repr__(self):
        return f"{type(self).__name__}({self._sh_ten!r})"


class LocalShardsContainer(torch.Tensor):
    """Several ``CheckpointableShardedTensor`` shards of one global tensor held by one rank, saved as one DCP
    tensor (DCP's checkpointable protocol, delegated to the shards)."""

    @staticmethod
    def __new__(cls, local_shards: List[CheckpointableShardedTensor]):
        if not local_shards:
            raise CheckpointingException("LocalShardsContainer needs at least one local shard")
        first = local_shards[0]
        return torch.Tensor._make_wrapper_subclass(cls, first.size(), dtype=first.dtype)

    def __init__(self, local_shards: List[CheckpointableShardedTensor]):
        for shard in local_shards:
            if not isinstance(shard, CheckpointableShardedTensor):
                raise CheckpointingException(
                    f"LocalShardsContainer holds CheckpointableShardedTensors, got {type(shard).__name__}")
            if shard._sh_ten.key != local_shards[0]._sh_ten.key:
                raise CheckpointingException(f"LocalShardsContainer: shards of different tensors "
                                             f"({local_shards[0]._sh_ten.key!r}, {shard._sh_ten.key!r})")
        self._local_shards = list(local_shards)

    def __create_write_items__(self, fqn: str, container: "LocalShardsContainer"):
        return [item for i, shard in enumerate(container._local_shards)
                for item in shard.__create_write_items__(fqn, shard, index=i)]

    def __create_chunk_list__(self):
        return [chunk for shard in self._local_shards for chunk in shard.__create_chunk_list__()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The data of the shard at ``index.offset`` (``index.index`` tried first)."""
        if index.offset is None:
            raise CheckpointingException(f"{index.fqn}: a LocalShardsContainer lookup needs an offset")
        shards = self._local_shards
        if index.index is not None and index.index < len(shards):
            candidates = [shards[index.index], *shards]
        else:
            candidates = shards
        for shard in candidates:
            if torch.Size(shard._sh_ten.global_offset) == index.offset:
                return shard.__get_tensor_shard__(index)
        raise CheckpointingException(f"{index.fqn}: no local shard at offset {tuple(index.offset)}")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{cls.__name__} supports no tensor operations (called {func})")

    def __repr__(self):
        return f"{type(self).__name__}({self._local_shards!r})"
