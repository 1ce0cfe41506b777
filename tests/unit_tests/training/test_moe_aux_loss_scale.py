"""The MoE aux-loss gradient is scaled like the main loss (upstream's rule): by 1 / micro-batches and, with
``--fp16``, by the loss scale the optimizer divides out of every gradient (without it the load-balancing gradient
ended up divided by the loss scale)."""
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import NO_DROPOUT, TINY, _run


def _body(rank, world_size):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    seen = []

    def grab(iteration, model, loss):
        seen.append(float(MoEAuxLossAutoScaler.main_loss_backward_scale))

    args = list(TINY) + NO_DROPOUT + ["--num-experts", 4, "--moe-router-topk", 2, "--moe-aux-loss-coeff", 0.01,
                                      "--train-iters", 1]
    result = _run(args + ["--fp16", "--loss-scale", 1024], on_iteration_end=grab)
    assert sorted(result.losses) == [1]
    assert seen == [1024 / 4]  # global batch 8 / (micro-batch 2 x DP 1): 4 micro-batches
    seen.clear()
    _run(args, on_iteration_end=grab)
    assert seen == [1 / 4]


def test_aux_loss_gradient_scaled_like_the_main_loss():
    run_distributed(_body, 1)
