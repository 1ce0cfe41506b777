"""Upstream's fully_parallel replica API: distribute_main_replicas_with_precomputed_distribution and
FullyParallelLoadStrategyWrapper.apply_loading_parallelization (2 gloo ranks)."""
import pytest
import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
    distribute_main_replicas_with_precomputed_distribution,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from tests.unit_tests.dist_utils import run_distributed


def _state(rank):
    """A, B, C replicated on both ranks (replica_id = rank), D sharded (each rank its own, main replica)."""
    sd = {k: ShardedTensor.from_rank_offsets(k, torch.full((4 * (i + 1),), float(i)), replica_id=rank)
          for i, k in enumerate("ABC")}
    sd["D"] = ShardedTensor.from_rank_offsets("D", torch.ones(2), (0, rank, 2), replica_id=0)
    return sd


def _body(rank, world):
    single = dist.new_group([rank], use_local_synchronization=True)
    sd = _state(rank)
    distribute_main_replicas_with_precomputed_distribution(sd, single, None)  # a group of one: unchanged
    assert [v.replica_id for v in sd.values()] == [rank, rank, rank, 0]
    with pytest.raises(ValueError, match="precomputed_distribution must be not None"):
        distribute_main_replicas_with_precomputed_distribution(sd, None, None)

    save = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())
    sd = _state(rank)
    distribution = save.determine_distribution(sd)
    distribute_main_replicas_with_precomputed_distribution(sd, None, distribution)
    ids = {k: v.replica_id for k, v in sd.items()}
    everyone = [None] * world
    dist.all_gather_object(everyone, ids)
    for key in "ABC":  # each replicated tensor saved by exactly one rank
        assert sorted(r[key] for r in everyone) == [0, 1], (key, everyone)
    assert ids["D"] == 0  # each rank saves its own shard of D
    again = _state(rank)
    save.apply_saving_parallelization(again)
    assert {k: v.replica_id for k, v in again.items()} == ids

    load = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())
    sd = _state(rank)
    read = load.apply_loading_parallelization(sd)
    assert read is not None and set(read.main_rank_for_shard) == set(read.shards_in_this_group)
    reads = {k: v.replica_id for k, v in sd.items()}
    dist.all_gather_object(everyone, reads)
    for key in "ABC":
        assert sorted(r[key] for r in everyone) == [0, 1], (key, everyone)
    assert reads["D"] == 0


def test_replica_distribution_api_two_ranks():
    run_distributed(_body, 2)
