"""parallel_state behaviours that upstream 0.19's own tests/unit_tests/test_parallel_state.py relies on (its PP tests
run against this fork): initialising before torch.distributed is an AssertionError, and upstream's module globals of
the main groups (``_MODEL_PARALLEL_GROUP``, ``_PIPELINE_MODEL_PARALLEL_GROUP``, ...) read the live groups, None
before initialisation and after destroy_model_parallel."""
import pytest
import torch.distributed as dist

from megatron.core import parallel_state as ps
from tests.unit_tests.dist_utils import run_distributed


def test_initialize_before_torch_distributed_is_an_assertion_error():
    if dist.is_initialized():
        pytest.skip("torch.distributed is initialised in this process")
    with pytest.raises(AssertionError, match="torch.distributed"):
        ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    assert ps._MODEL_PARALLEL_GROUP is None and ps._PIPELINE_MODEL_PARALLEL_GROUP is None
    with pytest.raises(AttributeError):
        ps._NO_SUCH_GROUP


def _globals_body(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert ps._PIPELINE_MODEL_PARALLEL_GROUP is ps.get_pipeline_model_parallel_group()
    assert dist.get_process_group_ranks(ps._PIPELINE_MODEL_PARALLEL_GROUP) == [rank % 2, rank % 2 + 2]
    assert dist.get_process_group_ranks(ps._MODEL_PARALLEL_GROUP) == [0, 1, 2, 3]
    assert dist.get_process_group_ranks(ps._EMBEDDING_GROUP) == [rank % 2, rank % 2 + 2]
    assert dist.get_process_group_ranks(ps._TENSOR_MODEL_PARALLEL_GROUP) == [rank // 2 * 2, rank // 2 * 2 + 1]
    ps.destroy_model_parallel()
    assert ps._MODEL_PARALLEL_GROUP is None and ps._PIPELINE_MODEL_PARALLEL_GROUP is None


def test_upstream_group_globals_follow_the_groups():
    run_distributed(_globals_body, 4)
