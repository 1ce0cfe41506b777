"""separation_hint (upstream's): keys with the prefix go to files of their own ('<prefix>__<rank>_<n>.distcp');
remove_sharded_tensors drops those keys and deletes those files; the rest loads unchanged (2 gloo ranks, sync and
async saves)."""
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from tests.unit_tests.dist_utils import run_distributed


def _state(rank, world, fill=1.0):
    return {
        "a": ShardedTensor.from_rank_offsets("keyA", torch.full((2, 4), fill + rank), (0, rank, world)),
        "p": ShardedTensor.from_rank_offsets("prefix_to_remove", torch.full((3, 5), fill), (0, rank, world)),
        "q": ShardedTensor.from_rank_offsets("prefix_other", torch.full((2,), fill), (0, rank, world)),
    }


def _shared(tmp_path, name):
    path = [str(tmp_path / name)]
    dist.broadcast_object_list(path, src=0)
    if dist.get_rank() == 0:
        os.makedirs(path[0])
    dist.barrier()
    return path[0]


def _body(rank, world, tmp_path, use_async):
    ckpt = _shared(tmp_path, f"ckpt_{use_async}")
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, separation_hint="prefix")
    if use_async:
        queue = AsyncCallsQueue()
        queue.schedule_async_request(dist_checkpointing.save(_state(rank, world), ckpt, strategy,
                                                             async_sharded_save=True))
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    else:
        dist_checkpointing.save(_state(rank, world), ckpt, strategy)
    files = sorted(f for f in os.listdir(ckpt) if f.endswith(".distcp"))
    assert [f for f in files if f.startswith("prefix")] == [f"prefix__{r}_1.distcp" for r in range(world)], files
    assert [f for f in files if f.startswith("__")] == [f"__{r}_0.distcp" for r in range(world)], files
    keys = set(FileSystemReader(ckpt).read_metadata().state_dict_metadata)
    assert {"keyA", "prefix_to_remove", "prefix_other"} <= keys
    back = dist_checkpointing.load(_state(rank, world, fill=0.0), ckpt)
    assert torch.equal(back["a"], torch.full((2, 4), 1.0 + rank)) and torch.equal(back["p"], torch.ones(3, 5))

    dist.barrier()  # every rank has read the files before one rank removes some (not collective, as upstream)
    if rank == 0:
        dist_checkpointing.remove_sharded_tensors(ckpt, key_prefix="prefix")
    dist.barrier()
    assert not [f for f in os.listdir(ckpt) if f.startswith("prefix")]
    keys = set(FileSystemReader(ckpt).read_metadata().state_dict_metadata)
    assert "keyA" in keys and not {k for k in keys if k.startswith("prefix")}
    again = dist_checkpointing.load({"a": _state(rank, world, fill=0.0)["a"]}, ckpt)
    assert torch.equal(again["a"], torch.full((2, 4), 1.0 + rank))


def test_separation_hint_sync(tmp_path):
    run_distributed(_body, 2, tmp_path, False)


def test_separation_hint_async(tmp_path):
    run_distributed(_body, 2, tmp_path, True)
