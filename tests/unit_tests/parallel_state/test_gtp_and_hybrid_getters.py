"""parallel_state names of upstream 0.19 for features this fork does not have, returning what upstream returns at
their default sizes: GTP weight-rematerialization groups (singletons), the hybrid DP x CP group of full size,
overwrite_nccl_comm_cfgs, RankGenerator.get_gtp_ranks (2 gloo ranks where groups are built)."""
import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.parallel_state import RankGenerator
from tests.unit_tests.dist_utils import run_distributed

GTP = [("gtp_weight_remat", "generalized tensor parallel group"),
       ("expert_gtp_weight_remat", "expert generalized tensor parallel group")]


def _before_init():
    for name, desc in GTP:
        assert getattr(ps, f"get_{name}_world_size")() == 0 and getattr(ps, f"get_{name}_rank")() == 0
        assert getattr(ps, f"get_{name}_group")(check_initialized=False) is None
        assert getattr(ps, f"get_{name}_global_ranks")(check_initialized=False) is None
        with pytest.raises(AssertionError, match=f"^{desc} is not initialized$"):
            getattr(ps, f"get_{name}_group")()
        with pytest.raises(AssertionError, match=f"^{desc} is not initialized$"):
            getattr(ps, f"get_{name}_global_ranks")()


def test_gtp_getters_before_initialize_model_parallel():
    _before_init()


def _body(rank, world):
    _before_init()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        for name, _ in GTP:
            group = getattr(ps, f"get_{name}_group")()
            assert group.size() == 1 and dist.get_process_group_ranks(group) == [rank]
            assert getattr(ps, f"get_{name}_world_size")() == 1 and getattr(ps, f"get_{name}_rank")() == 0
            assert getattr(ps, f"get_{name}_global_ranks")() == [rank]
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, group=ps.get_gtp_weight_remat_group())
        assert t.item() == rank + 1.0  # this rank alone
        assert ps.get_hybrid_data_context_parallel_groups(group_size=1) is ps.get_data_parallel_group(
            with_context_parallel=True)
        with pytest.raises(AssertionError, match="hybrid data x context parallel groups of size 2 are not "
                                                 "initialized"):
            ps.get_hybrid_data_context_parallel_groups(group_size=2)
        assert ps.get_hybrid_data_context_parallel_groups(check_initialized=False, group_size=2) is None
    finally:
        ps.destroy_model_parallel()
    _before_init()
    ps.initialize_model_parallel()  # data parallel 2: the hybrid group of full size is the DP x CP group
    try:
        assert dist.get_process_group_ranks(ps.get_hybrid_data_context_parallel_groups(group_size=2)) == [0, 1]
    finally:
        ps.destroy_model_parallel()


def test_gtp_and_hybrid_getters_two_ranks():
    run_distributed(_body, 2)


def test_rank_generator_gtp_ranks():
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-cp-ep-dp-pp", rank_offset=4)
    assert gen.get_gtp_ranks(1) == [[4], [5], [6], [7]]
    with pytest.raises(AssertionError, match=r"gtp_remat axis size \(1\) != requested gtp_remat_size \(2\)"):
        gen.get_gtp_ranks(2)


def test_overwrite_nccl_comm_cfgs():
    cfgs = {"dp": {"max_ctas": 4}}
    ps.overwrite_nccl_comm_cfgs(cfgs, "dp", ("min_ctas", 2))
    ps.overwrite_nccl_comm_cfgs(cfgs, "tp", ("is_high_priority_stream", True))
    ps.overwrite_nccl_comm_cfgs(cfgs, "dp", ("max_ctas", 8))
    assert cfgs == {"dp": {"max_ctas": 8, "min_ctas": 2}, "tp": {"is_high_priority_stream": True}}
    assert isinstance(ps.HAVE_EINOPS, bool)


def _ranks_of(group):
    return None if group is None else dist.get_process_group_ranks(group)


def _extra_groups_body(rank, world):
    with pytest.raises(RuntimeError, match=r"^create_all_gather_groups\(\) requires parallel state to be initialized"):
        ps.create_all_gather_groups()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=1)
    try:
        dp_ag, expt_ag = ps.create_all_gather_groups(for_expert_parallelism=True)
        assert _ranks_of(dp_ag) == _ranks_of(ps.get_data_parallel_group(with_context_parallel=True))
        assert dp_ag is not ps.get_data_parallel_group(with_context_parallel=True)  # a second communicator
        assert _ranks_of(expt_ag) == _ranks_of(ps.get_expert_data_parallel_group())
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=dp_ag)
        assert t.item() == sum(_ranks_of(dp_ag))
        assert ps.create_all_gather_groups()[1] is None  # expert group only when asked
        groups, gloo = ps.create_hierarchical_groups(rank, [0, 1, 2, 3], [2, 2], create_gloo_process_groups=True,
                                                     group_desc="X")
        assert [_ranks_of(g) for g in groups] == [[rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]]
        assert [_ranks_of(g) for g in gloo] == [_ranks_of(g) for g in groups]
        assert ps.create_hierarchical_groups(rank, [0, 1, 2, 3], [4])[1] == [None]
        hybrid = ps.create_hybrid_dp_cp_groups(rank, [0, 1, 2, 3], None)
        assert list(hybrid) == [2] and _ranks_of(hybrid[2]) == [rank - rank % 2, rank - rank % 2 + 1]
    finally:
        ps.destroy_model_parallel()


def test_extra_groups_four_ranks():
    run_distributed(_extra_groups_body, 4)
