"""--first-last-layers-bf16: which layers stay in high precision (upstream's is_first_last_bf16_layer), the config
checks naming the flags, and (stand-in TE on CPU) those layers run outside the FP8 autocast and are built outside
quantized_model_init while the others are inside; MTP runs under the autocast. Real FP8 on the GPU: marked gpu."""
import contextlib

import pytest
import torch

from megatron.core.fp8_utils import is_first_last_bf16_layer
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.transformer import test_te_layers_fake as fake
from tests.unit_tests.transformer.test_te_layers_fake import fake_te  # noqa: F401 (fixture)


def _cfg(**kw):
    base = dict(num_layers=6, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)
    base.update(kw)
    return TransformerConfig(**base)


@pytest.mark.parametrize("start,end,expected", [(1, 1, [0, 5]), (2, 1, [0, 1, 5]), (0, 2, [4, 5]), (0, 0, [])])
def test_layer_selection(start, end, expected):
    cfg = _cfg(first_last_layers_bf16=True, num_layers_at_start_in_bf16=start, num_layers_at_end_in_bf16=end)
    assert [i for i in range(6) if is_first_last_bf16_layer(cfg, i)] == expected
    assert not is_first_last_bf16_layer(cfg, -1)  # MTP / "any layer": never
    off = _cfg(num_layers_at_start_in_bf16=start, num_layers_at_end_in_bf16=end)
    assert not any(is_first_last_bf16_layer(off, i) for i in range(6))  # only with --first-last-layers-bf16


def test_config_checks_name_the_flags():
    with pytest.raises(ValueError, match=r"--first-last-layers-bf16\) is not supported with delayed scaling"):
        _cfg(first_last_layers_bf16=True, fp8="e4m3", fp8_recipe="delayed", transformer_impl="transformer_engine")
    with pytest.raises(ValueError, match=r"num_layers_at_start_in_bf16 \(--num-layers-at-start-in-bf16=4\) must be "
                                         r"between 0 and the layers per pipeline stage \(3\)"):
        _cfg(first_last_layers_bf16=True, num_layers_at_start_in_bf16=4, pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"--num-layers-at-end-in-bf16=-1"):
        _cfg(first_last_layers_bf16=True, num_layers_at_end_in_bf16=-1)


def test_flags_reach_the_config():
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
    from tests.unit_tests.training.test_training import TINY

    argv = TINY + ["--train-iters", 1, "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", 0,
                   "--num-layers-at-end-in-bf16", 2]
    cfg = core_transformer_config_from_args(validate_args(parse_args(args=[str(a) for a in argv])))
    assert (cfg.first_last_layers_bf16, cfg.num_layers_at_start_in_bf16, cfg.num_layers_at_end_in_bf16) == (
        True, 0, 2)


def test_high_precision_layers_run_outside_the_autocast_and_init(fake_te, monkeypatch):  # noqa: F811
    """Stand-in TE: record, per layer forward, whether the FP8 autocast is active, and per TE linear whether it was
    built inside quantized_model_init."""
    state = {"autocast": 0, "init": 0}
    built = []

    @contextlib.contextmanager
    def autocast(**kw):
        state["autocast"] += 1
        try:
            yield
        finally:
            state["autocast"] -= 1

    @contextlib.contextmanager
    def quantized_init(**kw):
        state["init"] += 1
        try:
            yield
        finally:
            state["init"] -= 1

    monkeypatch.setattr(fake.transformer_engine, "te_autocast", autocast)
    monkeypatch.setattr(fake.transformer_engine, "te_quantized_model_init", quantized_init)
    original = fake.FakeLinear.__init__

    def recording_init(self, *a, **kw):
        built.append(state["init"] > 0)
        original(self, *a, **kw)

    monkeypatch.setattr(fake.FakeLinear, "__init__", recording_init)
    cfg = _cfg(num_layers=4, transformer_impl="transformer_engine", fp8="e4m3", fp8_recipe="tensorwise",
               fp8_param=True, first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
               num_layers_at_end_in_bf16=1)
    torch.manual_seed(0)
    model = GPTModel(cfg, vocab_size=64, max_sequence_length=16)
    seen = {}
    for layer in model.decoder.layers:
        layer.register_forward_pre_hook(lambda m, a: seen.__setitem__(m.layer_number, state["autocast"] > 0))
    ids = torch.randint(0, 64, (1, 4))
    model(ids, None)
    assert seen == {1: False, 2: True, 3: True, 4: False}
    # per layer two FakeLinear (linear_proj, linear_fc2); LayerNormLinears are another class: count FakeLinear only
    per_layer = len(built) // 4
    assert per_layer >= 1 and built == [False] * per_layer + [True] * 2 * per_layer + [False] * per_layer
    # without the flag: one autocast around the block, every layer inside it
    seen.clear()
    plain = GPTModel(_cfg(num_layers=4, transformer_impl="transformer_engine", fp8="e4m3", fp8_recipe="tensorwise"),
                     vocab_size=64, max_sequence_length=16)
    for layer in plain.decoder.layers:
        layer.register_forward_pre_hook(lambda m, a: seen.__setitem__(m.layer_number, state["autocast"] > 0))
    plain(ids, None)
    assert seen == {1: True, 2: True, 3: True, 4: True}


def _te_fp8_available():
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return torch.cuda.is_available() and HAVE_TE


@pytest.mark.gpu
@pytest.mark.skipif(not _te_fp8_available(), reason="needs CUDA and Transformer Engine")
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_real_fp8_weights_only_in_the_middle_layers(recipe):
    from megatron.core.fp8_utils import is_quantized_tensor

    if torch.cuda.get_device_capability()[0] < 9 and recipe == "blockwise":
        pytest.skip("blockwise FP8 needs Hopper or newer")
    cfg = _cfg(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256,
               transformer_impl="transformer_engine", fp8="e4m3", fp8_recipe=recipe, fp8_param=True,
               first_last_layers_bf16=True, bf16=True, params_dtype=torch.bfloat16)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPTModel(cfg, vocab_size=128, max_sequence_length=32).cuda()
    for layer in model.decoder.layers:
        w = layer.self_attention.linear_proj.weight
        assert is_quantized_tensor(w) == (layer.layer_number in (2, 3)), (layer.layer_number, type(w))
    ids = torch.randint(0, 128, (2, 32), device="cuda")
    loss = model(ids, None, labels=ids)
    loss.float().mean().backward()
    assert torch.isfinite(loss).all()
