"""parallel_state names of upstream 0.19 added in issue 26's second pass: create_group, update_pg_timeout,
get_nccl_options, get_hierarchical_context_parallel_groups (2 gloo ranks)."""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from tests.unit_tests.dist_utils import run_distributed


def _timeout(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def _body(rank, world, tmp_path):
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tp = ps.get_tensor_model_parallel_group()
        mine = ps.create_group([0, 1], group_desc="MINE")
        single = ps.create_group([rank], use_local_synchronization=True)
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, group=mine)
        assert t.item() == 3.0
        # one group: only that one changes
        ps.update_pg_timeout(timedelta(seconds=77), pg=mine)
        assert _timeout(mine) == timedelta(seconds=77) and _timeout(tp) != timedelta(seconds=77)
        # all groups: the default group, initialize_model_parallel's and create_group's
        ps.update_pg_timeout(timedelta(seconds=123))
        for g in (dist.group.WORLD, tp, ps.get_data_parallel_group(), mine, single):
            assert _timeout(g) == timedelta(seconds=123)
        # without context parallelism upstream has no hierarchical groups: an AssertionError, or None
        with pytest.raises(AssertionError, match="hierarchical context parallel groups are not initialized"):
            ps.get_hierarchical_context_parallel_groups()
        assert ps.get_hierarchical_context_parallel_groups(check_initialized=False) is None
    finally:
        ps.destroy_model_parallel()
    assert ps._USER_GROUPS == []


def test_create_group_and_update_pg_timeout(tmp_path):
    run_distributed(_body, 2, tmp_path)


def test_get_nccl_options():
    assert ps.get_nccl_options("dp", {}) is None
    assert ps.get_nccl_options("dp", {"tp": {"max_ctas": 8}}) is None
    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL: options cannot be built")
    opts = ps.get_nccl_options("dp", {"dp": {"max_ctas": 8, "is_high_priority_stream": True}})
    assert opts.is_high_priority_stream and opts.config.max_ctas == 8
    with pytest.raises(RuntimeError, match="net_name"):
        ps.get_nccl_options("dp", {"dp": {"net_name": "carrier"}})
