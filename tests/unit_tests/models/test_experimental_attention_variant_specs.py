"""models.gpt.experimental_attention_variant_module_specs: upstream's layer-pattern helpers; the variant spec
builders refuse (not implemented)."""
from types import SimpleNamespace

import pytest

from megatron.core.models.gpt import experimental_attention_variant_module_specs as eav


def _cfg(**kw):
    base = dict(num_layers=6, moe_layer_freq=1, linear_attention_freq=None, experimental_attention_variant=None)
    return SimpleNamespace(**{**base, **kw})


def test_moe_layer_pattern():
    assert eav.get_moe_layer_pattern(_cfg()) == [1] * 6
    assert eav.get_moe_layer_pattern(_cfg(moe_layer_freq=2)) == [1, 0, 1, 0, 1, 0]
    assert eav.get_moe_layer_pattern(_cfg(moe_layer_freq=[0, 1, 1, 0, 0, 1])) == [0, 1, 1, 0, 0, 1]
    with pytest.raises(AssertionError, match="Invalid length of moe_layer_pattern: 2, expected 6"):
        eav.get_moe_layer_pattern(_cfg(moe_layer_freq=[1, 0]))
    with pytest.raises(ValueError, match="Invalid moe_layer_freq"):
        eav.get_moe_layer_pattern(_cfg(moe_layer_freq="2"))


def test_linear_attention_pattern():
    assert eav.get_linear_attention_pattern(_cfg()) == [0] * 6
    assert eav.get_linear_attention_pattern(_cfg(linear_attention_freq=3)) == [1, 1, 0, 1, 1, 0]
    assert eav.get_linear_attention_pattern(_cfg(linear_attention_freq=[1, 0, 1, 0, 1, 0])) == [1, 0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="Linear attention type gated_delta_net is specified but "
                                         "linear_attention_freq is None"):
        eav.get_linear_attention_pattern(_cfg(experimental_attention_variant="gated_delta_net"))
    assert eav.is_linear_attention_variant("gated_delta_net") and not eav.is_linear_attention_variant("dsa")
    assert not eav.is_linear_attention_variant(None)
    from megatron.core.transformer import TransformerConfig

    real = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4)  # no such fields here: defaults
    assert eav.get_linear_attention_pattern(real) == [0, 0, 0, 0]


@pytest.mark.parametrize("name", ["get_gated_delta_net_module_spec", "get_dsa_module_spec_for_backend",
                                  "get_experimental_attention_variant_module_spec",
                                  "get_transformer_layer_with_experimental_attention_variant_spec",
                                  "get_transformer_block_with_experimental_attention_variant_spec"])
def test_variant_specs_refuse(name):
    with pytest.raises(NotImplementedError, match=f"^{name}: experimental attention variants .* not implemented"):
        getattr(eav, name)(_cfg())
    assert eav.HAVE_KITCHEN is False
