"""Upstream's import path for the YaRN rotary embedding. The code lives in
``megatron/core/transformer/yarn_rotary_pos_embedding.py``, beside the multi-latent attention that uses it."""
from megatron.core.transformer.yarn_rotary_pos_embedding import (  # noqa: F401 (re-exported)
    YarnRotaryEmbedding,
    _yarn_find_correction_dim,
    _yarn_find_correction_range,
    _yarn_get_concentration_factor,
    _yarn_get_mscale,
    _yarn_linear_ramp_mask,
)
