"""Transformer building blocks: config, module base, attention, MLP, layers, block, MoE."""
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

__all__ = ["MegatronModule", "MLATransformerConfig", "TransformerConfig"]
