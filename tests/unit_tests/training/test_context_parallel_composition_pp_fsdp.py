"""The DeepSeek-V3-shaped model of ``test_context_parallel_composition.py`` on 4 CPU gloo ranks: CP2 x PP2 (the
pipeline schedule's aux-loss scale) and Megatron-FSDP with meta-device init x CP2 x EP2 train with the same losses
(lm, ``mtp_1``, router losses) and expert biases as without CP."""
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_context_parallel_composition import CP2, DEEPSEEK, _check_equal, _run_recording


def _cp2_pp2_and_fsdp_body(rank, world_size):
    from megatron.core import parallel_state as ps

    # PP2 x DP2 against CP2 x PP2: the pipeline schedule scales the aux-loss gradient by the CP size too (the MTP
    # depth and the MoE layer on the last stage, the dense layer on the first)
    pp = DEEPSEEK + ["--train-iters", 3, "--pipeline-model-parallel-size", 2]
    ref = _run_recording(pp)
    got = _run_recording(pp + CP2)
    assert got[2][1] == 2 and ps.get_pipeline_model_parallel_world_size() == 2
    _check_equal(got, ref, (1, 2, 3), num_biases=2 if ps.is_pipeline_last_stage() else 0)
    # Megatron-FSDP with meta-device init (its expert biases keep their real values) x EP2: CP2 against CP1
    fsdp = DEEPSEEK + ["--train-iters", 3, "--use-megatron-fsdp", "--init-model-with-meta-device",
                       "--expert-model-parallel-size", 2, "--moe-token-dispatcher-type", "alltoall"]
    ref = _run_recording(fsdp)
    got = _run_recording(fsdp + CP2)
    assert got[2][1] == 2 and type(got[0].model[0]).__name__ == "FullyShardedDataParallel"
    _check_equal(got, ref, (1, 2, 3))


def test_deepseek_shaped_cp2_pp2_and_megatron_fsdp_cp2_ep2_equal_cp1():
    run_distributed(_cp2_pp2_and_fsdp_body, 4, timeout=600)
