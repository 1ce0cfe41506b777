"""Upstream's ``experimental_attention_variant_module_specs``: layer patterns of models mixing attention variants.

The pattern helpers are upstream's (``get_moe_layer_pattern``, ``get_linear_attention_pattern``,
``is_linear_attention_variant``). The experimental attention variants themselves (gated delta net linear attention,
DeepSeek sparse attention) are not implemented in this fork: their spec builders raise ``NotImplementedError``
naming the feature.
"""
from typing import List, Optional

from megatron.core.extensions.transformer_engine import HAVE_TE  # noqa: F401 (upstream's flag here)

HAVE_KITCHEN = False  # NVIDIA Kitchen layers are never used by this fork

LINEAR_ATTENTION_VARIANTS = ("gated_delta_net",)


def _unsupported(function: str):
    raise NotImplementedError(f"{function}: experimental attention variants (gated delta net, DeepSeek sparse "
                              "attention) are not implemented in this fork")


def get_gated_delta_net_module_spec(config, backend=None):
    """Not implemented (gated delta net linear attention)."""
    _unsupported("get_gated_delta_net_module_spec")


def get_dsa_module_spec_for_backend(config, backend=None):
    """Not implemented (DeepSeek sparse attention)."""
    _unsupported("get_dsa_module_spec_for_backend")


def get_experimental_attention_variant_module_spec(config, backend=None):
    """Not implemented."""
    _unsupported("get_experimental_attention_variant_module_spec")


def get_transformer_layer_with_experimental_attention_variant_spec(config, backend=None):
    """Not implemented."""
    _unsupported("get_transformer_layer_with_experimental_attention_variant_spec")


def get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage: Optional[int] = None,
                                                                   pp_rank: Optional[int] = None):
    """Not implemented."""
    _unsupported("get_transformer_block_with_experimental_attention_variant_spec")


def is_linear_attention_variant(experimental_attention_variant: Optional[str]) -> bool:
    """Whether the variant is a linear attention one (``"gated_delta_net"``)."""
    return experimental_attention_variant in LINEAR_ATTENTION_VARIANTS


def _pattern(config, name: str, every) -> List[int]:
    """``config.<name>`` as a per-layer 0/1 list: an int ``N`` through ``every(i, N)``, a list as it is (one entry
    per layer)."""
    freq = getattr(config, name)
    if isinstance(freq, int):
        return [every(i, freq) for i in range(config.num_layers)]
    if isinstance(freq, list):
        assert len(freq) == config.num_layers, (
            f"Invalid length of {name.replace('_freq', '_pattern')}: {len(freq)}, expected {config.num_layers}, "
            f"current {name.replace('_freq', '').replace('_', ' ')} pattern: {freq}")
        return freq
    raise ValueError(f"Invalid {name}: {type(freq)}, {freq}")


def get_moe_layer_pattern(config) -> List[int]:
    """Per layer 1 (MoE) or 0 (dense) from ``config.moe_layer_freq``: an int ``N`` puts MoE on layers 0, N, 2N...;
    a list is the pattern."""
    return _pattern(config, "moe_layer_freq", lambda i, n: 1 if i % n == 0 else 0)


def get_linear_attention_pattern(config) -> List[int]:
    """Per layer 1 (linear attention) or 0 (softmax attention) from ``config.linear_attention_freq``: an int ``N``
    makes every N-th layer softmax attention; a list is the pattern; None: all softmax attention (an error when
    the config names a linear attention variant)."""
    if getattr(config, "linear_attention_freq", None) is None:
        variant = getattr(config, "experimental_attention_variant", None)
        if is_linear_attention_variant(variant):
            raise ValueError(f"Linear attention type {variant} is specified but linear_attention_freq is None. "
                             "Please set linear_attention_freq to specify the LA/SDPA layer pattern.")
        return [0] * config.num_layers
    return _pattern(config, "linear_attention_freq", lambda i, n: 0 if (i + 1) % n == 0 else 1)
