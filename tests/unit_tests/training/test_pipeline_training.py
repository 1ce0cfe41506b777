"""pretrain_gpt with --pipeline-model-parallel-size 2 x --tensor-model-parallel-size 2 on 4 CPU gloo ranks: each rank
builds its stage (2 of the 4 layers; 1 + 3 with --decoder-first-pipeline-num-layers 1; with
--num-layers-per-virtual-pipeline-stage 1 two chunks of one layer) and
trains; from the same weights and optimizer state (a PP=1 checkpoint) the losses of the same global batches equal the
PP=1 x TP=2 run's (fp32 tolerance, tied embeddings, clipped), and a save at PP=2 resumes at PP=1 (model and DDP
optimizer state) continuing the uninterrupted curve; with --use-distributed-optimizer, PP=2 x DP=2 (1F1B and
interleaved) continues a PP=1 x DP=4 checkpoint on its curve, and its own save resumes at PP=1; with --fp16 (2 ranks)
PP=2 continues a PP=1 x DP=2 checkpoint with its loss scale; MoE with the expert bias (and aux loss) at PP=2 x DP=2
continues a PP=1 x DP=4 checkpoint with the same losses and expert biases."""
import numpy as np
import pytest

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import NO_DROPOUT, TINY, _run, _same_on_all_ranks, _tracker

PP = TINY + NO_DROPOUT + ["--num-layers", 4, "--tensor-model-parallel-size", 2, "--train-iters", 8,
                          "--log-interval", 1]


def _stage(model):
    """(pre_process, post_process, global layer numbers) of each model chunk of this rank."""
    return [(m.module.pre_process, m.module.post_process, [layer.layer_number for layer in m.module.decoder.layers])
            for m in model]


def _body(rank, world_size, ckpt_a, ckpt_b):
    from megatron.core import parallel_state

    # PP=1 x TP=2 x DP=2 (2 micro-batches per iteration), saved at iteration 3: the reference curve
    ref = _run(PP + ["--save", ckpt_a, "--save-interval", 3])
    curve = {i: ref.losses[i] for i in range(1, 9)}
    assert curve[8] < curve[1], curve
    # A fresh PP=2 x TP=2 run (DP=1: 4 micro-batches through 1F1B) trains; its initial weights are not those of PP=1
    # (each stage draws its own layers from the seed, as upstream), so its curve is only checked to fall.
    seen = []
    fresh = _run(PP + ["--pipeline-model-parallel-size", 2, "--train-iters", 4],
                 on_iteration_end=lambda it, model, loss: seen.append(
                     (parallel_state.get_pipeline_model_parallel_rank(), _stage(model))))
    pp_rank, stages = seen[0]
    assert pp_rank == rank // 2  # RankGenerator order tp-cp-ep-dp-pp
    assert stages == [(pp_rank == 0, pp_rank == 1, [2 * pp_rank + 1, 2 * pp_rank + 2])], stages
    got = [fresh.losses[i] for i in range(1, 5)]
    _same_on_all_ranks(got)  # broadcast from the last stage: rank 0 (first stage) logs the same value
    assert got[-1] < got[0], got
    # From the same weights and optimizer state (the PP=1 checkpoint of iteration 3), PP=2 gives the PP=1 losses,
    # then saves at iteration 5
    first = _run(PP + ["--pipeline-model-parallel-size", 2, "--load", ckpt_a, "--ckpt-step", 3, "--save", ckpt_b,
                       "--save-interval", 5, "--exit-interval", 5, "--eval-iters", 2])
    assert sorted(first.losses) == [4, 5] and _tracker(ckpt_b) == "5"
    got = [first.losses[i] for i in (4, 5)]
    _same_on_all_ranks(got)
    np.testing.assert_allclose(got, [curve[4], curve[5]], rtol=1e-5, atol=0)
    # its validation loss (forward-only through the schedule) equals PP=1's on the same weights
    evaluated = _run(PP + ["--load", ckpt_b, "--skip-train", "--eval-iters", 2])
    _same_on_all_ranks([first.final_valid_loss])
    assert first.final_valid_loss == pytest.approx(evaluated.final_valid_loss, rel=1e-5), (
        first.final_valid_loss, evaluated.final_valid_loss)
    # the PP=2 checkpoint (model + DDP optimizer state + scheduler) resumed at PP=1 continues the curve
    second = _run(PP + ["--load", ckpt_b])
    assert sorted(second.losses) == [6, 7, 8]
    resumed = [second.losses[i] for i in (6, 7, 8)]
    _same_on_all_ranks(resumed)
    np.testing.assert_allclose(resumed, [curve[6], curve[7], curve[8]], rtol=1e-5, atol=0)
    # uneven: 1 + 3 layers (--decoder-first-pipeline-num-layers 1)
    seen.clear()
    uneven = _run(PP + ["--pipeline-model-parallel-size", 2, "--decoder-first-pipeline-num-layers", 1,
                        "--load", ckpt_a, "--ckpt-step", 3, "--train-iters", 5],
                  on_iteration_end=lambda it, model, loss: seen.append(_stage(model)))
    assert seen[0] == [(pp_rank == 0, pp_rank == 1, [1] if pp_rank == 0 else [2, 3, 4])], seen[0]
    got = [uneven.losses[i] for i in (4, 5)]
    _same_on_all_ranks(got)
    np.testing.assert_allclose(got, [curve[4], curve[5]], rtol=1e-5, atol=0)
    # interleaved: two virtual stages of one layer per rank (virtual stage c*2 + pp_rank holds layer c*2 + pp_rank + 1)
    seen.clear()
    inter = _run(PP + ["--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", 1,
                       "--load", ckpt_a, "--ckpt-step", 3, "--train-iters", 5],
                 on_iteration_end=lambda it, model, loss: seen.append(_stage(model)))
    assert seen[0] == [(pp_rank == 0, False, [pp_rank + 1]), (False, pp_rank == 1, [pp_rank + 3])], seen[0]
    got = [inter.losses[i] for i in (4, 5)]
    _same_on_all_ranks(got)
    np.testing.assert_allclose(got, [curve[4], curve[5]], rtol=1e-5, atol=0)


def test_pretrain_gpt_pp2_tp2_equals_pp1_and_resumes_at_pp1(tmp_path):
    run_distributed(_body, 4, str(tmp_path / "a"), str(tmp_path / "b"), timeout=600)


def _distrib_optimizer_body(rank, world_size, ckpt_a, ckpt_b):
    dist_opt = PP + ["--tensor-model-parallel-size", 1, "--use-distributed-optimizer"]
    ref = _run(dist_opt + ["--save", ckpt_a, "--save-interval", 3])  # PP=1 x DP=4, one micro-batch per iteration
    curve = {i: ref.losses[i] for i in range(1, 9)}
    assert curve[8] < curve[1], curve
    # PP=2 x DP=2 (2 micro-batches), main params and Adam state resharded from DP=4 and over the stages; saved at 5
    pp = _run(dist_opt + ["--pipeline-model-parallel-size", 2, "--load", ckpt_a, "--ckpt-step", 3, "--save", ckpt_b,
                          "--save-interval", 5, "--exit-interval", 5])
    assert type(pp.optimizer).__name__ == "DistributedOptimizer" and sorted(pp.losses) == [4, 5]
    assert [len(m.module.decoder.layers) for m in pp.model] == [2]  # this rank's stage: 2 of the 4 layers
    got = [pp.losses[i] for i in (4, 5)]
    _same_on_all_ranks(got)
    np.testing.assert_allclose(got, [curve[4], curve[5]], rtol=1e-5, atol=0)
    # its PP=2 x DP=2 checkpoint resumed at PP=1 x DP=4 continues the curve
    second = _run(dist_opt + ["--load", ckpt_b])
    got = [second.losses[i] for i in (6, 7, 8)]
    _same_on_all_ranks(got)
    np.testing.assert_allclose(got, [curve[6], curve[7], curve[8]], rtol=1e-5, atol=0)
    # and interleaved (two chunks of one layer per rank, one distributed optimizer over both)
    inter = _run(dist_opt + ["--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", 1,
                             "--load", ckpt_a, "--ckpt-step", 3, "--train-iters", 6])
    assert [len(m.module.decoder.layers) for m in inter.model] == [1, 1]
    got = [inter.losses[i] for i in (4, 5, 6)]
    _same_on_all_ranks(got)
    np.testing.assert_allclose(got, [curve[4], curve[5], curve[6]], rtol=1e-5, atol=0)


def test_pretrain_gpt_distributed_optimizer_pp2_equals_pp1_and_resumes_at_pp1(tmp_path):
    run_distributed(_distrib_optimizer_body, 4, str(tmp_path / "a"), str(tmp_path / "b"), timeout=600)


def _fp16_body(rank, world_size, ckpt):
    fp16 = PP + ["--tensor-model-parallel-size", 1, "--fp16", "--initial-loss-scale", 1024, "--train-iters", 5]
    ref = _run(fp16 + ["--save", ckpt, "--save-interval", 2])  # PP=1 x DP=2
    # PP=2 x DP=1 from the same weights, fp32 main params and loss scaler: the schedule scales each micro-batch's
    # loss by the optimizer's loss scale (config.grad_scale_func)
    pp = _run(fp16 + ["--pipeline-model-parallel-size", 2, "--load", ckpt, "--ckpt-step", 2])
    assert sorted(pp.losses) == [3, 4, 5] and pp.skipped_iterations == 0
    assert [pp.loss_scales[i] for i in (3, 4, 5)] == [ref.loss_scales[i] for i in (3, 4, 5)]
    got = [pp.losses[i] for i in (3, 4, 5)]
    _same_on_all_ranks(got)
    np.testing.assert_allclose(got, [ref.losses[i] for i in (3, 4, 5)], rtol=2e-3, atol=0)


def test_pretrain_gpt_fp16_pp2_equals_pp1(tmp_path):
    run_distributed(_fp16_body, 2, str(tmp_path / "ckpt"), timeout=600)


def _moe_body(rank, world_size, ckpt):
    moe = PP + ["--tensor-model-parallel-size", 1, "--num-experts", 4, "--moe-router-topk", 2,
                "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", 0.01, "--moe-ffn-hidden-size", 32,
                "--moe-aux-loss-coeff", 0.01, "--train-iters", 5]
    ref = _run(moe + ["--save", ckpt, "--save-interval", 2])  # PP=1 x DP=4
    pp = _run(moe + ["--pipeline-model-parallel-size", 2, "--load", ckpt, "--ckpt-step", 2])  # PP=2 x DP=2
    assert sorted(pp.losses) == [3, 4, 5]
    got = [pp.losses[i] for i in (3, 4, 5)]
    _same_on_all_ranks(got)
    np.testing.assert_allclose(got, [ref.losses[i] for i in (3, 4, 5)], rtol=1e-5, atol=0)
    # the expert bias of this stage's layers followed the same updates
    offset = 2 * (rank // 2)  # layers 1-2 on the first stage, 3-4 on the last
    for i, layer in enumerate(pp.model[0].module.decoder.layers):
        assert layer.mlp.router.expert_bias.abs().sum() > 0  # updated (it starts at zero)
        np.testing.assert_allclose(layer.mlp.router.expert_bias.numpy(),
                                   ref.model[0].module.decoder.layers[offset + i].mlp.router.expert_bias.numpy(),
                                   rtol=0, atol=1e-6)


def test_pretrain_gpt_moe_expert_bias_pp2_equals_pp1(tmp_path):
    run_distributed(_moe_body, 4, str(tmp_path / "ckpt"), timeout=600)


def test_pipeline_flags():
    from tests.unit_tests.training.test_arguments import _args

    args = _args("--pipeline-model-parallel-size", 2, "--num-layers", 4, "--num-layers-per-virtual-pipeline-stage", 1,
                 "--tensor-model-parallel-size", 2, "--global-batch-size", 8, world_size=8)
    assert (args.data_parallel_size, args.virtual_pipeline_model_parallel_size, args.num_microbatches) == (2, 2, 2)
    args = _args("--pipeline-model-parallel-size", 2, "--num-layers", 3, "--decoder-first-pipeline-num-layers", 1,
                 world_size=2)
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (1, None)
    for extra, words in (
        (("--pipeline-model-parallel-size", 3), ["--pipeline-model-parallel-size (3)", "WORLD_SIZE (4)"]),
        (("--pipeline-model-parallel-size", 2, "--num-layers", 3), ["--num-layers (3)", "divisible"]),
        (("--pipeline-model-parallel-size", 2, "--num-layers", 4, "--num-layers-per-virtual-pipeline-stage", 3),
         ["--num-layers-per-virtual-pipeline-stage (3)"]),
        (("--num-layers-per-virtual-pipeline-stage", 1), ["needs --pipeline-model-parallel-size"]),
        (("--pipeline-model-parallel-size", 2, "--use-megatron-fsdp"), ["--use-megatron-fsdp", "pipeline"]),
        (("--pipeline-model-parallel-size", 2, "--calculate-per-token-loss"), ["--calculate-per-token-loss",
                                                                              "--pipeline-model-parallel-size 2"]),
        (("--decoder-first-pipeline-num-layers", 1), ["--decoder-first-pipeline-num-layers",
                                                      "needs --pipeline-model-parallel-size"]),
        (("--pipeline-model-parallel-size", 2, "--num-layers", 4, "--decoder-first-pipeline-num-layers", 5),
         ["do not split", "--decoder-first-pipeline-num-layers 5"]),
        (("--pipeline-model-parallel-size", 2, "--num-layers", 4, "--decoder-last-pipeline-num-layers", 3,
          "--num-layers-per-virtual-pipeline-stage", 1), ["--num-layers-per-virtual-pipeline-stage",
                                                         "--decoder-last-pipeline-num-layers"]),
        (("--pipeline-model-parallel-size", 2, "--context-parallel-size", 4), ["--context-parallel-size (4)",
                                                                               "must divide WORLD_SIZE (4)"]),
    ):
        with pytest.raises(SystemExit) as exc:
            _args(*extra, world_size=4)
        assert all(w in str(exc.value) for w in words), (extra, str(exc.value))
