"""Upstream's import path for the rotary position embedding. The code lives in
``megatron/core/transformer/rotary_pos_embedding.py``: the attention layers rotate q and k with it, and a model
builds its ``RotaryEmbedding`` from there too."""
from megatron.core.transformer.rotary_pos_embedding import (  # noqa: F401 (re-exported)
    RotaryEmbedding,
    _rotate_half,
    apply_rotary_pos_emb,
    llama3_scaled_inv_freq,
    use_fused_rope,
)
