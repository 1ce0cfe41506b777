"""Upstream 0.19 modules and names added in issue 26's second pass: ``strategies.checkpointable`` (plain PyTorch DCP
saves a CheckpointableShardedTensor at its global offset, 2 gloo ranks) and the integrity-manifest names of
``validation``."""
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import CheckpointingException, ShardedTensor, integrity, validation
from megatron.core.dist_checkpointing.strategies.checkpointable import CheckpointableShardedTensor
from tests.unit_tests.dist_utils import run_distributed


def _dcp_body(rank, world, tmp_path):
    full = torch.arange(4 * world * 3, dtype=torch.float32).reshape(4 * world, 3)
    local = full.chunk(world)[rank].clone()
    sh = ShardedTensor.from_rank_offsets("w", local, (0, rank, world))
    wrapped = CheckpointableShardedTensor.from_sh_ten(sh)
    assert tuple(wrapped.shape) == (4 * world, 3) and wrapped.dtype == torch.float32
    d = str(tmp_path / "dcp")
    dcp.save({"w": wrapped}, checkpoint_id=d)
    dist.barrier()
    md = dcp.FileSystemReader(d).read_metadata().state_dict_metadata["w"]
    assert tuple(md.size) == (4 * world, 3)
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks) == [((4 * r, 0), (4, 3)) for r in range(world)]
    out = {"w": torch.zeros(4 * world, 3)}  # a plain tensor: DCP reads the whole global tensor
    dcp.load(out, checkpoint_id=d)
    assert torch.equal(out["w"], full)


def test_checkpointable_sharded_tensor_saved_by_plain_dcp(tmp_path):
    run_distributed(_dcp_body, 2, tmp_path)


def test_checkpointable_refuses_bad_shards():
    flat = ShardedTensor.from_rank_offsets_flat("f", torch.zeros(4), (2, 4), flattened_range=slice(0, 4))
    with pytest.raises(CheckpointingException, match="f: a flattened ShardedTensor"):
        CheckpointableShardedTensor.from_sh_ten(flat)
    with pytest.raises(CheckpointingException, match="expects a ShardedTensor"):
        CheckpointableShardedTensor.from_sh_ten(torch.zeros(2))
    wrapped = CheckpointableShardedTensor.from_sh_ten(ShardedTensor.from_rank_offsets("w", torch.zeros(2)))
    with pytest.raises(NotImplementedError, match="no tensor operations"):
        wrapped + 1


def test_validation_integrity_names(tmp_path):
    assert validation.INTEGRITY_FNAME == "integrity.json"
    # one home: validation's names are integrity.py's functions
    assert validation.save_integrity_manifest is integrity.save_integrity_manifest
    assert validation.verify_integrity_manifest is integrity.verify_integrity_manifest
    d = tmp_path / "ckpt"
    d.mkdir()
    assert not validation.check_is_distributed_checkpoint(str(d))
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, str(d))
    assert validation.check_is_distributed_checkpoint(str(d))
    validation.save_integrity_manifest(str(d))
    files = json.loads((d / validation.INTEGRITY_FNAME).read_text())["files"]
    assert ".metadata" in files and "metadata.json" in files
    validation.verify_integrity_manifest(str(d))
    data = next(p for p in d.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointingException, match=data.name):
        validation.verify_integrity_manifest(str(d))
