"""strategies.checkpointable.LocalShardsContainer: two shards of one key per rank saved and loaded by plain
PyTorch DCP on 2 gloo ranks (values per shard distinct), and its bad input."""
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

from megatron.core.dist_checkpointing import CheckpointingException, ShardedTensor
from megatron.core.dist_checkpointing.strategies.checkpointable import (
    CheckpointableShardedTensor,
    LocalShardsContainer,
)
from tests.unit_tests.dist_utils import run_distributed


def _container(rank, world_size, base):
    shards = []
    for part in range(2):  # rows [rank] and [world_size + rank] of a (2 * world_size, 3) tensor
        row = part * world_size + rank
        sh = ShardedTensor.from_rank_offsets("w", torch.full((1, 3), base + row), (0, row, 2 * world_size))
        shards.append(CheckpointableShardedTensor.from_sh_ten(sh))
    return {"w": LocalShardsContainer(shards)}


def _body(rank, world_size, ckpt_dir):
    dcp.save(_container(rank, world_size, 10.0), checkpoint_id=ckpt_dir)
    meta = FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata["w"]
    assert isinstance(meta, TensorStorageMetadata) and tuple(meta.size) == (2 * world_size, 3)
    assert len(meta.chunks) == 2 * world_size
    loaded = _container(rank, world_size, 0.0)
    dcp.load(loaded, checkpoint_id=ckpt_dir)
    rows = [s._sh_ten.data[0, 0].item() for s in loaded["w"]._local_shards]
    assert rows == [10.0 + rank, 10.0 + world_size + rank]


def test_two_local_shards_per_rank_round_trip(tmp_path):
    run_distributed(_body, 2, str(tmp_path / "ckpt"))


def test_bad_input():
    with pytest.raises(CheckpointingException, match="at least one"):
        LocalShardsContainer([])
    with pytest.raises(CheckpointingException, match="CheckpointableShardedTensors, got Tensor"):
        LocalShardsContainer([torch.zeros(2)])
    a = CheckpointableShardedTensor.from_sh_ten(ShardedTensor.from_rank_offsets("a", torch.zeros(2)))
    b = CheckpointableShardedTensor.from_sh_ten(ShardedTensor.from_rank_offsets("b", torch.zeros(2)))
    with pytest.raises(CheckpointingException, match="different tensors"):
        LocalShardsContainer([a, b])
    with pytest.raises(NotImplementedError, match="no tensor operations"):
        LocalShardsContainer([a]) + 1
