"""strategies.async_utils.async_process_group: the background writes' gloo group is cached, and made again after
``destroy_process_group`` of it (upstream's unit tests tear subgroups down between tests; the next async save then
failed with "Process group ... is not initialized in the world group map") (2 gloo ranks)."""
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import async_utils
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from tests.unit_tests.dist_utils import run_distributed


def _async_save(rank, world, path):
    sd = {"a": ShardedTensor.from_rank_offsets("a", torch.full((2,), float(rank)), (0, rank, world))}
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dist_checkpointing.save(sd, path, async_sharded_save=True))
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    back = dist_checkpointing.load({"a": ShardedTensor.from_rank_offsets("a", torch.zeros(2), (0, rank, world))},
                                   path)
    assert torch.equal(back["a"], torch.full((2,), float(rank)))


def _body(rank, world, tmp_path):
    g = async_utils.async_process_group()
    assert async_utils.async_process_group() is g  # cached
    dirs = [str(tmp_path / "one"), str(tmp_path / "two")]
    if rank == 0:
        for d in dirs:
            (tmp_path / d).mkdir()
    dist.barrier()
    _async_save(rank, world, dirs[0])
    dist.destroy_process_group(async_utils.async_process_group())
    again = async_utils.async_process_group()
    assert again is not g and again in dist.distributed_c10d._world.pg_map
    t = torch.ones(1)
    dist.all_reduce(t, group=again)
    assert t.item() == world
    _async_save(rank, world, dirs[1])  # an async save after the teardown works


def test_async_group_made_again_after_destroy(tmp_path):
    run_distributed(_body, 2, tmp_path)
