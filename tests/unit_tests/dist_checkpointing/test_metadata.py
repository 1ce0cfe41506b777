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
    assert maybe_load_config(d) == CheckpointingConfig("torch_dist", 1)  # upstream 0.19: no common backend

    md = dist_checkpointing.load_tensors_metadata(d)
    assert set(md) == {"w", "h", "f"}
    assert md["w"].global_shape == (8, 4) and md["w"].dtype == torch.float32
    assert md["h"].global_shape == (3,) and md["h"].dtype == torch.bfloat16
    assert md["f"].global_shape == (8, 4), "flattened tensors report their original global shape"
    assert md["w"].data.device.type == "meta"

    smd = dist_checkpointing.load_sharded_metadata(d)
    objs = {k: v for k, v in smd.items() if isinstance(v, ShardedObject)}
    assert set(objs) == {f"opt/state/shard_{r}_{world}" for r in range(world)} | {"common_state/shard_0_1"}
    assert all(o.key == "opt/state" and o.global_shape == (world,) for k, o in objs.items() if k[0] == "o")

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
    if rank == 0:  # not collective, as upstream: one rank rewrites the metadata
        dist_checkpointing.remove_sharded_tensors(d, "h")
    dist.barrier()
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


# ---- interoperability with plain DCP (the format upstream reads and writes) --------------------------------------
def _foreign_write(rank, world, tmp_path):
    """Write a checkpoint the way upstream does, with torch APIs only: torch ShardedTensors with a full regular-grid
    global shard list, objects as BytesIO under their unique keys, DefaultSavePlanner, hand-written metadata.json
    and common.pt."""
    import io
    import json

    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard
    from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
    from torch.distributed.checkpoint import FileSystemWriter, save
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    d = os.path.join(str(tmp_path), "foreign")
    if rank == 0:
        os.makedirs(d)
    dist.barrier()
    full = torch.arange(4.0 * world * 3).reshape(1, 4 * world, 3)  # a prepended singleton axis
    shards_md = [
        ShardMetadata([0, 4 * r, 0], [1, 4, 3], f"rank:{r}/cpu") for r in range(world)
    ]
    local = Shard(full[:, 4 * rank : 4 * rank + 4].clone(), shards_md[rank])
    props = TensorProperties(dtype=torch.float32)
    st = TorchShardedTensor._init_from_local_shards_and_global_metadata(
        [local], ShardedTensorMetadata(shards_md, torch.Size(full.shape), props)
    )
    buf = io.BytesIO()
    torch.save({"obj_rank": rank}, buf)
    state = {"layers.w": st, f"opt/shard_{rank}_{world}": buf}
    save(state, storage_writer=FileSystemWriter(d), planner=DefaultSavePlanner())
    if rank == 0:
        torch.save({"iteration": 9}, os.path.join(d, "common.pt"))
        with open(os.path.join(d, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                       "common_backend": "torch", "common_backend_version": 1}, f)
    dist.barrier()


def _foreign_read_here(rank, world, tmp_path):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    d = os.path.join(str(tmp_path), "foreign")
    full = torch.arange(4.0 * 4 * 3).reshape(16, 3)
    # saved on 4 ranks along axis 1 of (1, 16, 3); read on `world` ranks along the last axis
    dst = torch.zeros(16, 3)
    out = dist_checkpointing.load(
        {
            "w": ShardedTensor.from_rank_offsets("layers.w", dst, prepend_axis_num=1, replica_id=rank),
            "o": ShardedObject("opt", None, (4,), (rank,)),
        },
        d,
        validate_access_integrity=False,
    )
    assert torch.equal(out["w"], full) and out["o"] == {"obj_rank": rank} and out["iteration"] == 9
    md = dist_checkpointing.load_tensors_metadata(d)
    assert md["layers.w"].global_shape == (1, 16, 3)


def test_foreign_dcp_checkpoint_loads(tmp_path):
    run_distributed(_foreign_write, 4, tmp_path)
    run_distributed(_foreign_read_here, 2, tmp_path)


def _save_for_foreign_reader(rank, world, tmp_path):
    d = os.path.join(str(tmp_path), "ours")
    if rank == 0:
        os.makedirs(d)
    dist.barrier()
    full = torch.arange(24.0).reshape(8, 3)
    dist_checkpointing.save(
        {
            "w": ShardedTensor.from_rank_offsets("w", full.chunk(world)[rank].clone(), (0, rank, world)),
            "p": ShardedTensor.from_rank_offsets("p", full[rank].clone(), (0, rank, world), prepend_axis_num=1),
            "o": ShardedObject("opt", [rank], (world,), (rank,)),
        },
        d,
    )


def test_plain_dcp_reads_our_checkpoint(tmp_path):
    """torch's own DCP reader (no MCore code) reads every tensor and object of our checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run_distributed(_save_for_foreign_reader, 2, tmp_path)
    out_path = os.path.join(str(tmp_path), "plain.pt")
    dcp_to_torch_save(os.path.join(str(tmp_path), "ours"), out_path)
    sd = torch.load(out_path, weights_only=False)
    full = torch.arange(24.0).reshape(8, 3)
    assert torch.equal(sd["w"], full)
    assert torch.equal(sd["p"], full[:2])  # layers 0 and 1 of the (2, 3) stack
    # objects are torch.save([obj]) under their unique keys, as upstream 0.19 stores them; the common state is one
    objs = {k: v for k, v in sd.items() if "/" in k}
    assert set(objs) == {"opt/shard_0_2", "opt/shard_1_2", "common_state/shard_0_1"}
    assert objs["opt/shard_0_2"] == [[0]] and objs["opt/shard_1_2"] == [[1]]
    assert isinstance(objs["common_state/shard_0_1"], list) and len(objs["common_state/shard_0_1"]) == 1
