"""initialize_model_parallel on real gloo ranks: group membership equals upstream's layout (hand-computed for the
default order tp-cp-ep-dp-pp), every group is a working process group, getters, refusals, destroy + re-initialise."""
import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from tests.unit_tests.dist_utils import run_distributed


def _mine(groups, rank):
    (group,) = [g for g in groups if rank in g]
    return group


def _check_group(group, expected_ranks, rank):
    """``group`` is a real process group over ``expected_ranks``: its size, this rank's index, and an all-reduce."""
    assert dist.get_world_size(group) == len(expected_ranks)
    assert dist.get_rank(group) == expected_ranks.index(rank)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=group)
    assert t.item() == float(sum(expected_ranks)), (t.item(), expected_ranks)


# (world, tp, ep, expert tp or None) -> hand-computed groups (default order tp-cp-ep-dp-pp)
LAYOUTS = {
    (1, 1, 1, None): dict(tp=[[0]], dp=[[0]], ep=[[0]], etp=[[0]], edp=[[0]], etp_ep=[[0]]),
    (2, 1, 1, None): dict(tp=[[0], [1]], dp=[[0, 1]], ep=[[0], [1]], etp=[[0], [1]], edp=[[0, 1]],
                          etp_ep=[[0], [1]]),
    (4, 2, 1, None): dict(tp=[[0, 1], [2, 3]], dp=[[0, 2], [1, 3]], ep=[[0], [1], [2], [3]], etp=[[0, 1], [2, 3]],
                          edp=[[0, 2], [1, 3]], etp_ep=[[0, 1], [2, 3]]),
    (4, 1, 2, None): dict(tp=[[0], [1], [2], [3]], dp=[[0, 1, 2, 3]], ep=[[0, 1], [2, 3]],
                          etp=[[0], [1], [2], [3]], edp=[[0, 2], [1, 3]], etp_ep=[[0, 1], [2, 3]]),
    (4, 2, 2, 1): dict(tp=[[0, 1], [2, 3]], dp=[[0, 2], [1, 3]], ep=[[0, 1], [2, 3]], etp=[[0], [1], [2], [3]],
                       edp=[[0, 2], [1, 3]], etp_ep=[[0, 1], [2, 3]]),
    (8, 2, 2, None): dict(tp=[[0, 1], [2, 3], [4, 5], [6, 7]], dp=[[0, 2, 4, 6], [1, 3, 5, 7]],
                          ep=[[0, 2], [1, 3], [4, 6], [5, 7]], etp=[[0, 1], [2, 3], [4, 5], [6, 7]],
                          edp=[[0, 4], [1, 5], [2, 6], [3, 7]], etp_ep=[[0, 1, 2, 3], [4, 5, 6, 7]]),
}


def _layout_body(rank, world_size, tp, ep, etp, expected):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    assert ps.is_initialized() and ps.model_parallel_is_initialized()
    tp_ranks, dp_ranks = _mine(expected["tp"], rank), _mine(expected["dp"], rank)
    ep_ranks, etp_ranks = _mine(expected["ep"], rank), _mine(expected["etp"], rank)
    edp_ranks, etp_ep_ranks = _mine(expected["edp"], rank), _mine(expected["etp_ep"], rank)
    checks = [
        (ps.get_tensor_model_parallel_group(), tp_ranks),
        (ps.get_data_parallel_group(), dp_ranks),
        (ps.get_data_parallel_group(with_context_parallel=True), dp_ranks),  # CP is 1
        (ps.get_data_parallel_group_gloo(), dp_ranks),
        (ps.get_model_parallel_group(), tp_ranks),  # tp x pp, PP is 1
        (ps.get_context_parallel_group(), [rank]),
        (ps.get_pipeline_model_parallel_group(), [rank]),
        (ps.get_embedding_group(), [rank]),
        (ps.get_position_embedding_group(), [rank]),
        (ps.get_tensor_and_data_parallel_group(), list(range(world_size))),  # tp x dp = world while PP, CP are 1
        (ps.get_amax_reduction_group(), list(range(world_size))),
        (ps.get_tensor_and_context_parallel_group(), tp_ranks),
        (ps.get_amax_reduction_group(tp_only_amax_red=True), tp_ranks),
        (ps.get_expert_model_parallel_group(), ep_ranks),
        (ps.get_expert_tensor_parallel_group(), etp_ranks),
        (ps.get_expert_tensor_and_model_parallel_group(), etp_ep_ranks),
        (ps.get_expert_tensor_model_pipeline_parallel_group(), etp_ep_ranks),
        (ps.get_expert_data_parallel_group(), edp_ranks),
        (ps.get_expert_data_parallel_group_gloo(), edp_ranks),
        (ps.get_intra_distributed_optimizer_instance_group(), list(range(world_size))),
    ]
    for group, ranks in checks:
        _check_group(group, ranks, rank)
    assert dist.get_backend(ps.get_data_parallel_group_gloo()) == "gloo"
    # sizes and ranks
    assert ps.get_tensor_model_parallel_world_size() == tp
    assert ps.get_tensor_model_parallel_rank() == tp_ranks.index(rank)
    assert ps.get_data_parallel_world_size() == world_size // tp
    assert ps.get_data_parallel_world_size(with_context_parallel=True) == world_size // tp
    assert ps.get_data_parallel_rank() == dp_ranks.index(rank)
    assert ps.get_expert_model_parallel_world_size() == ep
    assert ps.get_expert_model_parallel_rank() == ep_ranks.index(rank)
    assert ps.get_expert_tensor_parallel_world_size() == (tp if etp is None else etp)
    assert ps.get_expert_tensor_parallel_rank() == etp_ranks.index(rank)
    assert ps.get_expert_tensor_and_model_parallel_world_size() == len(etp_ep_ranks)
    assert ps.get_expert_tensor_and_model_parallel_rank() == etp_ep_ranks.index(rank)
    assert ps.get_expert_data_parallel_world_size() == len(edp_ranks)
    assert ps.get_expert_data_parallel_rank() == edp_ranks.index(rank)
    assert ps.get_pipeline_model_parallel_world_size() == 1 and ps.get_pipeline_model_parallel_rank() == 0
    assert ps.get_context_parallel_world_size() == 1 and ps.get_context_parallel_rank() == 0
    assert ps.get_context_parallel_global_ranks() == [rank]
    assert ps.get_tensor_and_context_parallel_world_size() == tp
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert ps.is_rank_in_embedding_group() and ps.is_rank_in_position_embedding_group()
    # source ranks
    assert ps.get_tensor_model_parallel_src_rank() == tp_ranks[0]
    assert ps.get_data_parallel_src_rank() == dp_ranks[0]
    assert ps.get_model_parallel_src_rank() == tp_ranks[0]
    assert ps.get_expert_model_parallel_src_rank() == ep_ranks[0]
    assert ps.get_pipeline_model_parallel_first_rank() == rank == ps.get_pipeline_model_parallel_last_rank()
    assert ps.get_pipeline_model_parallel_next_rank() == rank == ps.get_pipeline_model_parallel_prev_rank()
    assert ps.get_all_ranks() == f"{tp_ranks.index(rank)}_{dp_ranks.index(rank)}_0_0_{ep_ranks.index(rank)}"
    buf = ps.get_global_memory_buffer()
    assert buf.get_tensor((3,), torch.float32, "t").shape == (3,)
    with pytest.raises(AssertionError, match="Inter distributed optimizer instance group is not initialized"):
        ps.get_inter_distributed_optimizer_instance_group()
    ps.destroy_model_parallel()


@pytest.mark.parametrize("world, tp, ep, etp", list(LAYOUTS))
def test_groups_match_upstream_layout(world, tp, ep, etp):
    run_distributed(_layout_body, world, tp, ep, etp, LAYOUTS[(world, tp, ep, etp)])


def _positional_body(rank, world_size):
    # upstream's positional order: tp, pp, virtual pp, pp comm backend, use_sharp, cp, hierarchical cp, hybrid cp, ep
    ps.initialize_model_parallel(2, 1, None, None, False, 1, None, False, 2)
    assert ps.get_tensor_model_parallel_world_size() == 2 and ps.get_expert_model_parallel_world_size() == 2
    assert ps.get_expert_data_parallel_world_size() == 1 and ps.get_data_parallel_world_size() == 2
    ps.destroy_model_parallel()
    # The old fork call initialize_model_parallel(tp, pp, ep) now passes a virtual pipeline size: refused, not
    # silently read as an expert size.
    with pytest.raises(RuntimeError, match="pipeline-model-parallel size should be greater than 1 with interleaved"):
        ps.initialize_model_parallel(1, 1, 2)
    assert not ps.is_initialized()


def test_positional_arguments_in_upstream_order():
    run_distributed(_positional_body, 4)


REFUSALS = [
    (dict(pipeline_model_parallel_size=3), RuntimeError, r"world_size \(2\) is not divisible by 3 .*"
                                                         "--pipeline-model-parallel-size 3"),
    (dict(context_parallel_size=3), RuntimeError, r"world_size \(2\) is not divisible by 3 .*--context-parallel-size 3"),
    (dict(context_parallel_size=0), ValueError, r"context_parallel_size=0 \(--context-parallel-size\)"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=0), ValueError,
     "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank"),
    (dict(virtual_pipeline_model_parallel_size=2), RuntimeError, "--num-layers-per-virtual-pipeline-stage"),
    (dict(hierarchical_context_parallel_sizes=[2, 1]), ValueError, "--hierarchical-context-parallel-sizes"),
    (dict(hybrid_context_parallel=True), ValueError, "hybrid_context_parallel"),
    (dict(num_distributed_optimizer_instances=3), RuntimeError,
     r"num_distributed_optimizer_instances \(3, --num-distributed-optimizer-instances\) must divide the size of the "
     r"world \(2\)"),
    (dict(num_distributed_optimizer_instances=2, tensor_model_parallel_size=2), RuntimeError,
     r"must divide the size of the data-parallel x context-parallel group \(1\)"),
    (dict(gtp_remat_size=2), ValueError, "gtp_remat_size=2"),
    (dict(use_sharp=True), ValueError, "--use-sharp"),
    (dict(sharp_enabled_group="dp"), ValueError, "sharp_enabled_group is only valid when use_sharp is True"),
    (dict(pipeline_model_parallel_comm_backend="mpi"), ValueError, "--pipeline-model-parallel-comm-backend"),
    (dict(tensor_model_parallel_size=0), ValueError, r"tensor_model_parallel_size=0 \(--tensor-model-parallel-size\) "
                                                      "must be a positive integer"),
    (dict(tensor_model_parallel_size=3), RuntimeError, r"world_size \(2\) is not divisible by 3"),
    (dict(expert_model_parallel_size=4), RuntimeError,
     r"world_size \(2\) is not divisible by expert_tensor_model_pipeline_parallel size \(4\)"),
    (dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=2, expert_model_parallel_size=2), RuntimeError,
     r"expert_tensor_model_pipeline_parallel size \(4\)"),
    (dict(expert_model_parallel_size=2, order="tp-cp-dp-pp"), RuntimeError,
     r"The size of \(ep\) is \(2\), but you haven't specified the order"),
    (dict(rank_offset=1), ValueError, r"ranks \[1, 3\) are not within the world of 2"),
]


def _refusal_body(rank, world_size, tmp_path):
    for kwargs, error, message in REFUSALS:
        with pytest.raises(error, match=message):
            ps.initialize_model_parallel(**kwargs)
        assert not ps.is_initialized(), kwargs
    bad_yaml = tmp_path / f"nccl_{rank}.yaml"
    bad_yaml.write_text("- not\n- a mapping\n")
    with pytest.raises(ValueError, match="--nccl-communicator-config-path"):
        ps.initialize_model_parallel(nccl_communicator_config_path=str(bad_yaml))
    ps.initialize_model_parallel(expert_model_parallel_size=2)  # a refusal left nothing behind
    with pytest.raises(RuntimeError, match="already initialized: call destroy_model_parallel"):
        ps.initialize_model_parallel()
    assert ps.get_expert_model_parallel_world_size() == 2
    ps.destroy_model_parallel()


def test_refusals_name_the_flag(tmp_path):
    run_distributed(_refusal_body, 2, tmp_path)


def _before_and_after_body(rank, world_size):
    # Before initialisation: pure data parallelism over WORLD (megatron/training relies on this).
    assert ps.get_data_parallel_group() is dist.group.WORLD
    assert ps.get_expert_data_parallel_group() is dist.group.WORLD
    assert ps.get_data_parallel_world_size() == world_size and ps.get_data_parallel_rank() == rank
    assert ps.get_tensor_model_parallel_world_size() == 1 and ps.get_tensor_model_parallel_rank() == 0
    assert ps.get_expert_model_parallel_world_size() == 1 and ps.get_expert_tensor_parallel_world_size() == 1
    assert ps.get_data_parallel_src_rank() == 0 and ps.get_tensor_model_parallel_src_rank() == rank
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    with pytest.raises(AssertionError, match="tensor model parallel group is not initialized"):
        ps.get_tensor_model_parallel_group()
    assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    with pytest.raises(AssertionError, match="global memory buffer is not initialized"):
        ps.get_global_memory_buffer()

    # set_* overrides win over the groups, and destroy forgets them
    ps.set_tensor_model_parallel_world_size(8)
    ps.set_tensor_model_parallel_rank(5)
    ps.set_expert_model_parallel_world_size(3)
    ps.set_data_parallel_rank(7)
    assert ps.get_tensor_model_parallel_world_size() == 8 and ps.get_tensor_model_parallel_rank() == 5
    assert ps.get_expert_tensor_parallel_world_size() == 8  # follows TP before initialisation
    assert ps.get_expert_model_parallel_world_size() == 3 and ps.get_data_parallel_rank() == 7
    ps.set_virtual_pipeline_model_parallel_world_size(2)
    assert ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=0)
    assert not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=0)
    assert ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1)
    ps.destroy_model_parallel()
    assert ps.get_tensor_model_parallel_world_size() == 1 and ps.get_data_parallel_rank() == rank
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None

    # initialise, destroy, re-initialise with another layout
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tp_group = ps.get_tensor_model_parallel_group()
    _check_group(tp_group, [0, 1] if rank < 2 else [2, 3], rank)
    ps.destroy_model_parallel()
    assert not ps.is_initialized() and ps.get_data_parallel_group() is dist.group.WORLD
    # forgotten, not destroyed: what was built on a group (an FSDP DeviceMesh) keeps working
    _check_group(tp_group, [0, 1] if rank < 2 else [2, 3], rank)
    ps.initialize_model_parallel(expert_model_parallel_size=4)
    assert ps.get_tensor_model_parallel_world_size() == 1
    _check_group(ps.get_data_parallel_group(), [0, 1, 2, 3], rank)
    _check_group(ps.get_expert_model_parallel_group(), [0, 1, 2, 3], rank)
    _check_group(ps.get_expert_data_parallel_group(), [rank], rank)
    ps.destroy_model_parallel()


def test_before_initialisation_overrides_destroy_and_reinitialise():
    run_distributed(_before_and_after_body, 4)


def _options_body(rank, world_size):
    seen = []

    def embedding_ranks(pp_ranks):
        seen.append(list(pp_ranks))
        return list(pp_ranks)

    # order with dp fastest: tp groups are strided
    ps.initialize_model_parallel(tensor_model_parallel_size=2, order="dp-tp", create_gloo_process_groups=False,
                                 get_embedding_ranks=embedding_ranks, distributed_timeout_minutes=5)
    assert seen == [[r] for r in range(world_size)]
    _check_group(ps.get_tensor_model_parallel_group(), [0, 2] if rank % 2 == 0 else [1, 3], rank)
    _check_group(ps.get_data_parallel_group(), [0, 1] if rank < 2 else [2, 3], rank)
    ps.destroy_model_parallel()

    # groups over a slice of the world: ranks 2, 3 only
    ps.initialize_model_parallel(tensor_model_parallel_size=2, rank_offset=2, local_world_size=2)
    if rank >= 2:
        assert ps.is_initialized()
        _check_group(ps.get_tensor_model_parallel_group(), [2, 3], rank)
        assert ps.get_data_parallel_world_size() == 1
    else:
        assert not ps.is_initialized()
        with pytest.raises(AssertionError, match="data parallel group is not initialized"):
            ps.get_data_parallel_group()
    ps.destroy_model_parallel()


def test_order_embedding_callback_and_rank_offset():
    run_distributed(_options_body, 4)


def _pipeline_body(rank, world_size):
    # tp=2, pp=2 over 4 ranks (order tp-cp-ep-dp-pp): pipelines [0, 2] and [1, 3], as upstream lays them out
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                 virtual_pipeline_model_parallel_size=2)
    pp_ranks = _mine([[0, 2], [1, 3]], rank)
    stage = pp_ranks.index(rank)
    _check_group(ps.get_pipeline_model_parallel_group(), pp_ranks, rank)
    _check_group(ps.get_embedding_group(), pp_ranks, rank)
    if stage == 0:
        _check_group(ps.get_position_embedding_group(), [rank], rank)
    else:  # the last stage holds no position embedding
        with pytest.raises(AssertionError, match="position embedding group is not initialized"):
            ps.get_position_embedding_group()
    _check_group(ps.get_model_parallel_group(), [0, 1, 2, 3], rank)
    assert ps.get_pipeline_model_parallel_world_size() == 2 and ps.get_pipeline_model_parallel_rank() == stage
    assert ps.get_data_parallel_world_size() == 1
    assert ps.get_pipeline_model_parallel_first_rank() == pp_ranks[0]
    assert ps.get_pipeline_model_parallel_last_rank() == pp_ranks[1]
    assert ps.get_pipeline_model_parallel_next_rank() == pp_ranks[1 - stage]
    assert ps.get_pipeline_model_parallel_prev_rank() == pp_ranks[1 - stage]
    assert ps.get_virtual_pipeline_model_parallel_world_size() == 2
    assert ps.get_virtual_pipeline_model_parallel_rank() == 0
    assert ps.is_pipeline_first_stage() == (stage == 0) and ps.is_pipeline_last_stage() == (stage == 1)
    # virtual stages: stage 0 / chunk 0 is the first of the whole pipeline, stage 1 / chunk 1 the last
    assert ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=0) == (stage == 0)
    assert not ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=1)
    assert ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1) == (stage == 1)
    assert not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=0)
    with pytest.raises(AssertionError, match="vp_stage must be passed"):
        ps.is_pipeline_first_stage(ignore_virtual=False)
    assert ps.is_rank_in_embedding_group()
    assert ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=0) == (stage == 0)
    assert ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=1) == (stage == 1)
    assert ps.is_rank_in_position_embedding_group() == (stage == 0)
    # expert groups span pipeline stages too: expert-tensor x model x pipeline holds everyone
    _check_group(ps.get_expert_tensor_model_pipeline_parallel_group(), [0, 1, 2, 3], rank)
    ps.destroy_model_parallel()
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None


def test_pipeline_groups_and_stages():
    run_distributed(_pipeline_body, 4)
