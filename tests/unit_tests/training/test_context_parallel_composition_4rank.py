"""The DeepSeek-V3-shaped model of ``test_context_parallel_composition.py`` on 4 CPU gloo ranks: CP2 x TP2 x EP2
(sequence parallel, all-to-all dispatch; the expert-parallel groups take the CP ranks, as upstream's layout) trains
with the same losses (lm, ``mtp_1``, router losses) and expert biases as TP2 x EP2 without CP. (CP2 x PP2 and
Megatron-FSDP x CP2 x EP2: ``test_context_parallel_composition_pp_fsdp.py``.)"""
import torch.distributed as dist

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_context_parallel_composition import CP2, DEEPSEEK, _check_equal, _run_recording


def _cp2_tp2_ep2_body(rank, world_size):
    from megatron.core import parallel_state as ps

    # TP2 x EP2 x DP2 (sequence parallel) against CP2 x TP2 x EP2: the expert-parallel groups take the CP ranks
    # (upstream's layout: the expert layout has no CP axis), so the experts receive tokens of both halves of each
    # sequence through the all-to-all
    args = DEEPSEEK + ["--train-iters", 3, "--expert-model-parallel-size", 2, "--moe-token-dispatcher-type",
                       "alltoall", "--tensor-model-parallel-size", 2, "--sequence-parallel"]
    ref = _run_recording(args)
    got = _run_recording(args + CP2)
    assert got[2][1] == 2 and ps.get_tensor_model_parallel_world_size() == 2
    assert ps.get_expert_model_parallel_world_size() == 2
    assert dist.get_process_group_ranks(ps.get_expert_model_parallel_group()) == \
        dist.get_process_group_ranks(ps.get_context_parallel_group())
    _check_equal(got, ref, (1, 2, 3))


def test_deepseek_shaped_cp2_tp2_ep2_equals_tp2_ep2():
    run_distributed(_cp2_tp2_ep2_body, 4, timeout=600)
