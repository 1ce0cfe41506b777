"""pretrain_gpt on 2 CPU gloo ranks with --expert-model-parallel-size 2: it trains like EP=1 (the same init, losses
equal up to reduction-order rounding), saves, and resumes at EP=1, under Megatron-FSDP x EP=2 with meta-device
init and under Megatron-FSDP hybrid sharding (2 instances), with the loss continuing."""
import numpy as np

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import NO_DROPOUT, TINY, _run, _same_on_all_ranks, _tracker

MOE = ["--num-experts", 4, "--moe-router-topk", 2, "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
       0.01, "--moe-ffn-hidden-size", 32, "--train-iters", 6, "--log-interval", 1]


def _body(rank, world_size, ckpt):
    from megatron.core import parallel_state

    ref = _run(TINY + NO_DROPOUT + MOE)  # EP=1, 6 iterations
    curve = [ref.losses[i] for i in range(1, 7)]
    assert curve[-1] < curve[0]
    seen = []
    first = _run(TINY + NO_DROPOUT + MOE + ["--expert-model-parallel-size", 2, "--moe-token-dispatcher-type",
                                            "alltoall", "--save", ckpt, "--save-interval", 3, "--exit-interval", 3],
                 on_iteration_end=lambda it, model, loss: seen.append(
                     (parallel_state.get_expert_model_parallel_world_size(),
                      model[0].module.decoder.layers[0].mlp.experts.local_expert_indices)))
    assert seen[0] == (2, [2 * rank, 2 * rank + 1]), seen[0]
    assert sorted(first.losses) == [1, 2, 3] and _tracker(ckpt) == "3"
    second = _run(TINY + NO_DROPOUT + MOE + ["--load", ckpt])  # EP=1 again
    assert sorted(second.losses) == [4, 5, 6]
    resumed = [first.losses[i] for i in (1, 2, 3)] + [second.losses[i] for i in (4, 5, 6)]
    _same_on_all_ranks(resumed)
    np.testing.assert_allclose(resumed, curve, rtol=1e-5, atol=0)
    # the same checkpoint resumed under Megatron-FSDP x EP=2 with meta-device init: the same curve
    fsdp = _run(TINY + NO_DROPOUT + MOE + ["--load", ckpt, "--use-megatron-fsdp", "--init-model-with-meta-device",
                                            "--expert-model-parallel-size", 2, "--moe-token-dispatcher-type",
                                            "alltoall"],
                on_iteration_end=lambda it, model, loss: seen.append(type(model[0]).__name__))
    assert seen[-1] == "FullyShardedDataParallel" and sorted(fsdp.losses) == [4, 5, 6]
    np.testing.assert_allclose([fsdp.losses[i] for i in (4, 5, 6)], curve[3:], rtol=1e-5, atol=0)
    # and under hybrid sharding (2 instances of 1 rank: replicated across, as a multi-node job's outer dimension)
    hybrid = _run(TINY + NO_DROPOUT + MOE + ["--load", ckpt, "--use-megatron-fsdp",
                                              "--num-distributed-optimizer-instances", 2],
                  on_iteration_end=lambda it, model, loss: seen.append(
                      tuple(model[0].module.decoder.layers[0].mlp.router.weight.device_mesh.mesh_dim_names)))
    assert seen[-1] == ("dp_replicate", "dp_shard") and sorted(hybrid.losses) == [4, 5, 6]
    np.testing.assert_allclose([hybrid.losses[i] for i in (4, 5, 6)], curve[3:], rtol=1e-5, atol=0)


def test_pretrain_gpt_ep2_saves_and_resumes_at_ep1(tmp_path):
    run_distributed(_body, 2, str(tmp_path / "ckpt"))


def test_expert_parallel_flags():
    import pytest

    from tests.unit_tests.training.test_arguments import _args

    args = _args("--num-experts", 4, "--expert-model-parallel-size", 2, "--moe-token-dispatcher-type", "alltoall",
                 world_size=2)
    assert (args.expert_model_parallel_size, args.moe_token_dispatcher_type) == (2, "alltoall")
    args = _args("--num-experts", 4, "--expert-model-parallel-size", 2, "--use-megatron-fsdp", world_size=2)
    assert args.use_megatron_fsdp and args.expert_model_parallel_size == 2  # Megatron-FSDP x EP is accepted
    for extra, words in (((("--num-experts", 3, "--expert-model-parallel-size", 2)), ["--expert-model-parallel-size",
                                                                                      "--num-experts (3)"]),):
        with pytest.raises(SystemExit) as exc:
            _args(*extra, world_size=2)
        assert all(w in str(exc.value) for w in words), str(exc.value)
