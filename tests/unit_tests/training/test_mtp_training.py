"""pretrain_gpt.py with multi-token prediction + MoE (first layer dense, --moe-layer-freq list form) on CPU (gloo):
trains, logs 'mtp_1 loss', saves and resumes with equal losses; with pipeline parallelism (MTP on the last stage)
the same losses as without; --moe-layer-freq parsing."""
import argparse
import os

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import NO_DROPOUT, TINY, _run, _tracker

MTP_MOE = NO_DROPOUT + ["--mtp-num-layers", 1, "--mtp-loss-scaling-factor", 0.5, "--num-experts", 4,
                        "--moe-router-topk", 2, "--moe-ffn-hidden-size", 32, "--moe-layer-freq", "([0]*1+[1]*1)",
                        "--moe-router-enable-expert-bias", "--log-interval", 1, "--untie-embeddings-and-output-weights"]


def _model_of(result):
    chunk = result.model[-1]
    return chunk.module if hasattr(chunk, "module") else chunk


def _resume_body(rank, world_size, ckpt):
    total, n = 6, 3
    args = TINY + MTP_MOE + ["--train-iters", total]
    full = _run(args)
    model = _model_of(full)
    assert not model.decoder.layers[0].is_moe and model.decoder.layers[1].is_moe  # first layer dense
    assert model.mtp.layers[0].mtp_model_layer.is_moe
    mtp = [full.moe_losses[i]["mtp_1 loss"] for i in range(1, total + 1)]
    assert all(4.0 < v < 5.0 for v in mtp), mtp  # about log(64) at the start: a real cross entropy
    first = _run(args + ["--save", ckpt, "--save-interval", n, "--exit-interval", n])
    assert _tracker(ckpt) == str(n)
    second = _run(args + ["--load", ckpt])
    curve = [full.losses[i] for i in range(1, total + 1)]
    resumed = [first.losses[i] for i in range(1, n + 1)] + [second.losses[i] for i in range(n + 1, total + 1)]
    assert resumed == curve, (resumed, curve)
    assert [second.moe_losses[i]["mtp_1 loss"] for i in range(n + 1, total + 1)] == mtp[n:]
    # the MTP loss trains the MTP block: without it (factor 0) the curve of the main loss differs
    off = _run(TINY + [a if a != 0.5 else 0.0 for a in MTP_MOE] + ["--train-iters", total])
    assert [off.losses[i] for i in range(1, total + 1)] != curve


def test_mtp_moe_first_layer_dense_resumes_exactly(tmp_path):
    run_distributed(_resume_body, 1, str(tmp_path / "ckpt"))


def _pipeline_body(rank, world_size, ckpt):
    """From the same weights (a PP=1 x DP=2 checkpoint of iteration 2), PP=2 gives the PP=1 losses and MTP losses:
    the last stage's MTP block and its copy of the word embeddings load and train as the one-stage model's."""
    # every layer MoE here: a stage without expert parameters cannot load a checkpoint's expert optimizer groups
    args = [a if a != "([0]*1+[1]*1)" else 1 for a in TINY + MTP_MOE] + [
        "--train-iters", 4, "--position-embedding-type", "rope", "--global-batch-size", 4]
    ref = _run(args + ["--save", ckpt, "--save-interval", 2])
    pp = _run(args + ["--pipeline-model-parallel-size", 2, "--load", ckpt, "--ckpt-step", 2])
    model = _model_of(pp)
    assert hasattr(model, "mtp") == (rank == 1) and hasattr(model, "embedding")  # MTP + embedding copy: last stage
    assert sorted(pp.losses) == [3, 4]
    for i in (3, 4):
        assert pp.losses[i] == pytest.approx(ref.losses[i], rel=1e-5, abs=0), (i, pp.losses, ref.losses)
        assert pp.moe_losses[i]["mtp_1 loss"] == pytest.approx(ref.moe_losses[i]["mtp_1 loss"], rel=1e-5, abs=0)
    # the last stage's copy took the same steps as the first stage's word embeddings
    word = model.embedding.word_embeddings.weight.detach().clone()
    other = [torch.empty_like(word) for _ in range(world_size)]
    torch.distributed.all_gather(other, word)
    assert torch.equal(other[0], other[1])


def test_mtp_pipeline_parallel_equals_one_stage(tmp_path):
    run_distributed(_pipeline_body, 2, str(tmp_path / "ckpt"))


def test_moe_layer_freq_parsing():
    from megatron.training.arguments import moe_freq_type, parse_args

    assert moe_freq_type("2") == 2
    assert moe_freq_type("([0]*3+[1]*5)") == [0, 0, 0, 1, 1, 1, 1, 1]
    assert moe_freq_type("[1, 0]*2") == [1, 0, 1, 0]
    assert moe_freq_type("([1]*2+[0])*2") == [1, 1, 0, 1, 1, 0]
    for bad, why in (('__import__("os").getcwd()', "is not an int or a list expression"),
                     ("[0]*10**9", "is not an int or a list expression"), ("[0]*99999999999", "is not an int"),
                     ("[0, 2]", "one 0 (dense) or 1 (MoE) per layer"), ("[[0], 1]", "list items must be integers"), ("[0.5, 1]", "is not an int"),
                     ("([0]*3", "cannot parse"), ("[]", "one 0 (dense) or 1 (MoE)")):
        with pytest.raises(argparse.ArgumentTypeError, match="--moe-layer-freq") as e:
            moe_freq_type(bad)
        assert why in str(e.value), (bad, str(e.value))
    args = parse_args(args=[str(a) for a in TINY + ["--moe-layer-freq", "([0]*1+[1]*1)"]])
    assert args.moe_layer_freq == [0, 1]


def test_moe_layer_freq_list_length_is_checked_by_name():
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args(args=[str(a) for a in TINY + ["--train-iters", 1, "--num-experts", 2, "--moe-layer-freq",
                                                    "[0]*3"]])
    with pytest.raises(SystemExit) as exc:
        validate_args(args)
    assert "--moe-layer-freq" in str(exc.value) and "num_layers=2" in str(exc.value)


def test_mtp_flags_reach_the_config():
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    args = validate_args(parse_args(args=[str(a) for a in TINY + ["--train-iters", 1, "--mtp-num-layers", 2]]))
    cfg = core_transformer_config_from_args(args)
    assert (cfg.mtp_num_layers, cfg.mtp_loss_scaling_factor) == (2, 0.1)  # upstream's default factor
    args = parse_args(args=[str(a) for a in TINY + ["--train-iters", 1, "--mtp-num-layers", 0]])
    with pytest.raises(SystemExit) as exc:
        validate_args(args)
    assert "--mtp-num-layers" in str(exc.value)


def _fsdp_meta_body(rank, world_size):
    """Megatron-FSDP with meta-device init: the MTP depth's router keeps a real expert bias (never NaN/garbage),
    updated like the decoder's; the same on both ranks; MTP loss logged."""
    res = _run(TINY + MTP_MOE + ["--train-iters", 3, "--use-megatron-fsdp", "--init-model-with-meta-device"])
    model = _model_of(res)
    bias = model.mtp.layers[0].mtp_model_layer.mlp.router.expert_bias
    assert torch.isfinite(bias).all() and float(bias.abs().max()) > 0 and float(bias.abs().max()) < 0.1, bias
    other = [torch.empty_like(bias) for _ in range(world_size)]
    torch.distributed.all_gather(other, bias.detach().contiguous())
    assert torch.equal(other[0], other[1])
    assert all(4.0 < res.moe_losses[i]["mtp_1 loss"] < 5.0 for i in range(1, 4))


def test_mtp_megatron_fsdp_meta_init(tmp_path):
    run_distributed(_fsdp_meta_body, 2)


def _tp_body(rank, world_size, ckpt):
    """From the same checkpoint, TP=2 with sequence parallelism (eh_proj column-parallel, gathered over TP, the
    depth's input scattered over the sequence) gives the TP=1 losses and MTP losses."""
    base = TINY + MTP_MOE + ["--position-embedding-type", "rope", "--make-vocab-size-divisible-by", 64,
                             "--train-iters", 3]
    ref = _run(base + ["--save", ckpt, "--save-interval", 1])
    tp = _run(base + ["--load", ckpt, "--ckpt-step", 1, "--tensor-model-parallel-size", 2, "--sequence-parallel"])
    for i in (2, 3):
        assert tp.losses[i] == pytest.approx(ref.losses[i], rel=2e-5, abs=0), (i, tp.losses, ref.losses)
        assert tp.moe_losses[i]["mtp_1 loss"] == pytest.approx(ref.moe_losses[i]["mtp_1 loss"], rel=2e-5, abs=0)


def test_mtp_tensor_parallel_sequence_parallel_equals_tp1(tmp_path):
    run_distributed(_tp_body, 2, str(tmp_path / "ckpt"))
