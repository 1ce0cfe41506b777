"""A ShardedTensor that PyTorch DCP saves directly (upstream 0.19's ``strategies.checkpointable``).

``CheckpointableShardedTensor.from_sh_ten(sh_ten)`` is a data-less tensor of the global shape that implements DCP's
checkpointable protocol (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``): DCP writes
the shard's local data at its global offset, as one chunk. It supports no tensor operations. Flattened shards
(``flattened_range``) are refused: their data is not one box of the global tensor.

Not provided: upstream's ``LocalShardsContainer`` (several shards of one key on one rank).
"""
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
