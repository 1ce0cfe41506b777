import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.dist_utils import run_distributed


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) / 2


def _fails_on_rank_one(rank, world_size):
    assert rank != 1, "planted failure"


@pytest.mark.parametrize("world_size", [2, 4])
def test_allreduce_runs_on_gloo_ranks(world_size):
    run_distributed(_allreduce, world_size)


def test_failure_on_one_rank_is_reported():
    with pytest.raises(AssertionError, match="planted failure"):
        run_distributed(_fails_on_rank_one, 2)
