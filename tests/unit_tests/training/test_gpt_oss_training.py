"""A tiny gpt-oss-shaped ``pretrain_gpt.py`` run on 2 CPU gloo ranks (issue 42): sliding windows on every other
layer (``--window-size "(4,0)" --window-attn-skip-freq 2``), learnable attention sinks, the clamped quick-GeGLU,
MoE with grouped experts, at TP2. It trains, saves, resumes bitwise, and the checkpoint resumes at TP1 x DP2 under
Megatron-FSDP with meta-device init (the same losses up to reduction-order rounding); every flag reaches the
model."""
import numpy as np
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import NO_DROPOUT, TINY, _run, _same_on_all_ranks, _tracker

GPT_OSS = ["--window-size", "(4,0)", "--window-attn-skip-freq", 2, "--softmax-type", "learnable", "--quick-geglu",
           "--glu-linear-offset", 1.0, "--activation-func-clamp-value", 7.0, "--num-experts", 4, "--moe-router-topk",
           2, "--moe-ffn-hidden-size", 32, "--moe-grouped-gemm", "--position-embedding-type", "rope",
           "--normalization", "RMSNorm", "--train-iters", 4, "--log-interval", 1,
           "--make-vocab-size-divisible-by", 64]  # the same padded vocabulary at TP 1 and 2


def _chunk(model):
    return model[0].module if hasattr(model[0], "module") else model[0]


def _body(rank, world_size, ckpt):
    from megatron.core.activations import quick_gelu

    seen = {}

    def record(iteration, model, loss):
        layers = _chunk(model).decoder.layers
        seen["windows"] = [layer.self_attention.core_attention.window_size for layer in layers]
        seen["sink"] = layers[0].self_attention.core_attention.softmax_offset.detach().clone()
        cfg = layers[0].config
        seen["cfg"] = (cfg.activation_func, cfg.gated_linear_unit, cfg.glu_linear_offset,
                       cfg.activation_func_clamp_value, cfg.softmax_type)

    tp2 = TINY + NO_DROPOUT + GPT_OSS + ["--tensor-model-parallel-size", 2]
    full = _run(tp2, on_iteration_end=record)
    curve = [full.losses[i] for i in range(1, 5)]
    assert all(np.isfinite(curve)) and curve[-1] < curve[0], curve
    assert seen["windows"] == [(4, 0), None]  # layer 2 of 2: full attention
    assert seen["cfg"] == (quick_gelu, True, 1.0, 7.0, "learnable")
    assert tuple(seen["sink"].shape) == (2,)  # 4 heads over 2 TP ranks
    first = _run(tp2 + ["--save", ckpt, "--save-interval", 2, "--exit-interval", 2], on_iteration_end=record)
    assert sorted(first.losses) == [1, 2] and _tracker(ckpt) == "2"
    sink_at_2 = seen["sink"]
    second = _run(tp2 + ["--load", ckpt], on_iteration_end=record)
    assert sorted(second.losses) == [3, 4]
    resumed = [first.losses[1], first.losses[2], second.losses[3], second.losses[4]]
    assert resumed == curve, (resumed, curve)  # bitwise
    _same_on_all_ranks(resumed)
    assert not torch.equal(seen["sink"], sink_at_2)  # the sink trains
    # the TP2 checkpoint at TP1 x DP2, Megatron-FSDP with meta-device init: the sink and the rest load
    fsdp = _run(TINY + NO_DROPOUT + GPT_OSS + ["--load", ckpt, "--use-megatron-fsdp", "--init-model-with-meta-device"])
    assert sorted(fsdp.losses) == [3, 4]
    np.testing.assert_allclose([fsdp.losses[3], fsdp.losses[4]], curve[2:], rtol=1e-5, atol=0)


def test_gpt_oss_pretrain_saves_and_resumes(tmp_path):
    run_distributed(_body, 2, str(tmp_path / "ckpt"))


def test_gpt_oss_flags_parse_in_upstreams_formats(capsys):
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    def cfg(*extra):
        return core_transformer_config_from_args(validate_args(parse_args(args=[str(a) for a in TINY + [
            "--train-iters", 1, "--num-layers", 4] + list(extra)])))

    c = cfg("--window-size", "(128,0)", "--window-attn-skip-freq", "([1]*3+[0])", "--softmax-type", "off-by-one")
    assert (c.window_size, c.window_attn_skip_freq, c.softmax_type) == ((128, 0), [1, 1, 1, 0], "off-by-one")
    c = cfg("--window-size", "64,-1", "--window-attn-skip-freq", "4", "--quick-geglu")
    assert (c.window_size, c.window_attn_skip_freq, c.gated_linear_unit) == ((64, -1), 4, True)
    assert c.activation_func(torch.tensor([1.0])).item() == torch.sigmoid(torch.tensor(1.702)).item()
    c = cfg()
    assert (c.window_size, c.softmax_type, c.glu_linear_offset, c.activation_func_clamp_value) == (
        None, "vanilla", 0.0, None)
    import pytest

    for extra, message in ((["--window-attn-skip-freq", "[__import__('os')]"], "may use only digits"),
                           (["--window-size", "(a,0)"], "--window-size"),
                           (["--swiglu", "--quick-geglu"], "--swiglu and --quick-geglu are mutually exclusive"),
                           (["--window-size", "(4,0)", "--window-attn-skip-freq", "[1,0]"], "num_layers=4 entries")):
        with pytest.raises(SystemExit) as e:
            cfg(*extra)
        text = str(e.value) + capsys.readouterr().err  # argparse's type errors go to stderr
        assert message in text, (extra, text)
