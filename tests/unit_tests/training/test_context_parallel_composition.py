"""Context parallelism composed with what long-context jobs train, on CPU gloo ranks: one tiny DeepSeek-V3-shaped
model (multi-latent attention with YaRN, MoE with a sigmoid router, the load-balancing aux loss, the z-loss and
expert bias, shared experts, multi-token prediction) trains at --context-parallel-size 2 with the same losses (lm,
``mtp_1``, load-balancing, z-loss) and expert biases as at CP=1, also with --calculate-per-token-loss; a CP=2
checkpoint resumes at CP=1 on the uninterrupted curve. (With TP, EP, PP and Megatron-FSDP on 4 ranks:
``test_context_parallel_composition_4rank.py`` and ``_pp_fsdp.py``; gpt-oss-shaped:
``test_context_parallel_gpt_oss.py``.)"""
import numpy as np

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_mla_training import MLA
from tests.unit_tests.training.test_mtp_training import MTP_MOE
from tests.unit_tests.training.test_training import TINY, _run, _same_on_all_ranks, _tracker

# MTP_MOE: --mtp-num-layers 1, 4 experts top-2 with expert bias, the first layer dense, no dropout
DEEPSEEK = TINY + MTP_MOE + MLA + [
    "--moe-router-score-function", "sigmoid", "--moe-shared-expert-intermediate-size", 32,
    "--moe-aux-loss-coeff", 0.1, "--moe-z-loss-coeff", 0.01, "--moe-router-bias-update-rate", 0.01,
    "--make-vocab-size-divisible-by", 64]
CP2 = ["--context-parallel-size", 2]


def _biases(model_chunks):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m.expert_bias.detach().clone() for c in model_chunks for m in c.modules() if isinstance(m, TopKRouter)]


def _run_recording(args):
    """(result, {iteration: expert biases of the MoE decoder layer and the MTP layer}, {iteration: CP size})"""
    from megatron.core import parallel_state

    bias, cp = {}, {}

    def record(it, model, loss):
        bias[it] = _biases(model)
        cp[it] = parallel_state.get_context_parallel_world_size()

    return _run(args, on_iteration_end=record), bias, cp


def _check_equal(got, want, iterations, num_biases=2):
    """Losses, MoE/MTP losses and expert biases of ``got`` equal ``want``'s at ``iterations`` (fp32 rounding)."""
    (res, bias, _), (ref, ref_bias, _) = got, want
    losses = [res.losses[i] for i in iterations]
    _same_on_all_ranks(losses)
    np.testing.assert_allclose(losses, [ref.losses[i] for i in iterations], rtol=1e-5, atol=0)
    for i in iterations:
        assert sorted(res.moe_losses[i]) == sorted(ref.moe_losses[i]) and len(ref.moe_losses[i]) == 3
        for name in ref.moe_losses[i]:  # mtp_1 loss, z_loss, (seq_)load_balancing_loss
            np.testing.assert_allclose(res.moe_losses[i][name], ref.moe_losses[i][name], rtol=1e-5, atol=0,
                                       err_msg=f"{name} of iteration {i}")
        assert len(bias[i]) == len(ref_bias[i]) == num_biases
        for b, r in zip(bias[i], ref_bias[i]):
            # sign steps of 0.01: equal, unless a count tie was broken by rounding (then one step differs)
            assert float((b - r).abs().max()) < 1e-6, (i, b, r)


def _cp2_body(rank, world_size, ckpt):
    args = DEEPSEEK + ["--train-iters", 4, "--moe-router-load-balancing-type", "seq_aux_loss"]
    ref = _run_recording(args)  # CP=1 x DP=2
    curve = [ref[0].losses[i] for i in range(1, 5)]
    assert len(set(curve)) == 4, curve  # it trains
    assert all(ref[0].moe_losses[i]["seq_load_balancing_loss"] > 0 for i in range(1, 5))
    cp = _run_recording(args + CP2 + ["--save", ckpt, "--save-interval", 3, "--exit-interval", 3])
    assert cp[2][1] == 2 and sorted(cp[0].losses) == [1, 2, 3] and _tracker(ckpt) == "3"
    _check_equal(cp, ref, (1, 2, 3))
    # the CP=2 checkpoint (MLA, MoE with expert bias, MTP) resumed at CP=1 continues the uninterrupted curve
    resumed = _run_recording(args + ["--load", ckpt])
    assert resumed[2][4] == 1 and sorted(resumed[0].losses) == [4]
    _check_equal(resumed, ref, (4,))
    # --calculate-per-token-loss: the aux losses x this rank's tokens x CP, the MTP ratio from the CP group's tokens
    per_token = DEEPSEEK + ["--train-iters", 2, "--calculate-per-token-loss"]
    _check_equal(_run_recording(per_token + CP2), _run_recording(per_token), (1, 2))


def test_deepseek_shaped_cp2_equals_cp1_and_resumes_at_cp1(tmp_path):
    run_distributed(_cp2_body, 2, str(tmp_path / "ckpt"), timeout=600)

