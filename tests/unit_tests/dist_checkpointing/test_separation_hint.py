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


def _rank0_leaves_last(rank, world, tmp_path, use_async):
    # every other rank notes the time it posts its last message of save to rank 0; rank 0 returns from save only
    # after all of them (upstream's test_remove_sharded_tensors has rank 0 delete files right after save while the
    # other ranks still list the directory, with no barrier in between)
    import time

    from megatron.core.dist_checkpointing import serialization

    posted = []
    real_isend = dist.isend

    def isend(tensor, dst, *args, **kwargs):
        posted.append((time.monotonic(), dst))
        return real_isend(tensor, dst, *args, **kwargs)

    serialization.dist.isend = isend
    try:
        ckpt = _shared(tmp_path, f"order_{use_async}")
        for i in range(3):
            sub = os.path.join(ckpt, str(i))
            if rank == 0:
                os.makedirs(sub)
            dist.barrier()
            if use_async:
                queue = AsyncCallsQueue()
                queue.schedule_async_request(dist_checkpointing.save(_state(rank, world), sub,
                                                                     async_sharded_save=True))
                queue.maybe_finalize_async_calls(blocking=True)
                queue.close()
            else:
                dist_checkpointing.save(_state(rank, world), sub)
            returned = time.monotonic()
            times = [None] * world
            dist.all_gather_object(times, (returned, posted[-1] if posted else None))
            if rank == 0:
                assert not posted  # rank 0 receives
                for r in range(1, world):
                    sent = times[r][1]
                    assert sent is not None and sent[1] == 0, (r, times[r])
                    assert sent[0] < returned, (r, sent, returned)
            else:
                assert len(posted) == i + 1
    finally:
        serialization.dist.isend = real_isend


def test_rank0_leaves_save_last(tmp_path):
    run_distributed(_rank0_leaves_last, 3, tmp_path, False)


def test_rank0_leaves_async_save_last(tmp_path):
    run_distributed(_rank0_leaves_last, 3, tmp_path, True)
