"""``TransformerConfig(fp8=False)`` means FP8 off, as in upstream (whose MoE tests pass it): stored as None; other
values outside None / 'e4m3' / 'hybrid' are still refused naming --fp8-format."""
import pytest

from megatron.core.transformer.transformer_config import TransformerConfig


def _cfg(**kw):
    return TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, **kw)


def test_fp8_false_is_off():
    assert _cfg(fp8=False).fp8 is None


def test_other_fp8_values_refused():
    with pytest.raises(ValueError, match="--fp8-format"):
        _cfg(fp8="e5m2")
    with pytest.raises(ValueError, match="--fp8-format"):
        _cfg(fp8=True)
