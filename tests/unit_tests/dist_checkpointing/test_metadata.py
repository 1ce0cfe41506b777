"""Metadata-only access: tensors/sharded metadata, plain tensors, common state, content metadata, config, and
removing tensors; plus upstream-format details of the DCP metadata."""
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import (
    CheckpointingConfig,
    check_is_distributed_checkpoint,
    maybe_load_config,
)
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from tests.unit_tests.dist_utils import run_distributed


def _body(rank, world, tmp_path):
    d = os.path.join(str(tmp_path), "ck")
    if rank == 0:
        os.makedirs(d)
    dist.barrier()
    assert not check_is_distributed_checkpoint(d)
    full = torch.arange(32.0).reshape(8, 4)
    flat_shard = full.chunk(2, 1)[0].reshape(-1)  # the (8, 2) left half (a TP=2 grid on axis 1), flattened across ranks
    n = flat_shard.numel()
    lo, hi = rank * n // world, (rank + 1) * n // world
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", full.chunk(world, 0)[rank].clone(), (0, rank, world)),
        "h": ShardedTensor.from_rank_offsets("h", torch.ones(3, dtype=torch.bfloat16), replica_id=rank),
        "f": ShardedTensor.from_rank_offsets_flat(
            "f", flat_shard[lo:hi].clone(), (8, 2), (1, 0, 2), flattened_range=slice(lo, hi)
        ),
        "f2": ShardedTensor.from_rank_offsets_flat(
            "f", full.chunk(2, 1)[1].reshape(-1)[lo:hi].clone(), (8, 2), (1, 1, 2), flattened_range=slice(lo, hi)
        ),
        "o": ShardedObject("opt/state", {"rank": rank}, (world,), (rank,)),
        "step": 11,
    }
    dist_checkpointing.save(sd, d, content_metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    assert check_is_distributed_checkpoint(d)
    assert maybe_load_config(d) == CheckpointingConfig("torch_dist", 1, "torch", 1)

    md = dist_checkpointing.load_tensors_metadata(d)
    assert set(md) == {"w", "h", "f"}
    assert md["w"].global_shape == (8, 4) and md["w"].dtype == torch.float32
    assert md["h"].global_shape == (3,) and md["h"].dtype == torch.bfloat16
    assert md["f"].global_shape == (8, 4), "flattened tensors report their original global shape"
    assert md["w"].data.device.type == "meta"

    smd = dist_checkpointing.load_sharded_metadata(d)
    objs = {k: v for k, v in smd.items() if isinstance(v, ShardedObject)}
    assert set(objs) == {f"opt/state/shard_{r}_{world}" for r in range(world)}
    assert all(o.key == "opt/state" and o.global_shape == (world,) for o in objs.values())

    plain = dist_checkpointing.load_plain_tensors(d)
    assert torch.equal(plain["w"], full) and torch.equal(plain["f"], full)
    assert torch.equal(plain["h"], torch.ones(3, dtype=torch.bfloat16))

    assert dist_checkpointing.load_common_state_dict(d)["step"] == 11
    assert dist_checkpointing.load_content_metadata(d) == {"distrib_optim_sharding_type": "dp_reshardable"}

    # DCP metadata: the N-D flattened tensor is stored as grid + (shard numel,) with the original shape recorded
    dcp_md = FileSystemReader(d).read_metadata()
    assert tuple(dcp_md.state_dict_metadata["f"].size) == (1, 2, 16)
    assert dcp_md.mcore_data["f"]["nd_reformulated_orig_global_shape"] == (8, 4)

    dist.barrier()
    dist_checkpointing.remove_sharded_tensors(d, "h")
    md = dist_checkpointing.load_tensors_metadata(d)
    assert set(md) == {"w", "f"}
    out = dist_checkpointing.load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8 // world, 4), (0, rank, world))}, d
    )
    assert torch.equal(out["w"], full.chunk(world, 0)[rank])


def test_metadata_2_ranks(tmp_path):
    run_distributed(_body, 2, tmp_path)


def test_metadata_4_ranks(tmp_path):
    run_distributed(_body, 4, tmp_path)
