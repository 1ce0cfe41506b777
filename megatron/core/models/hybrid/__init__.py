"""Hybrid (Mamba / attention / MLP pattern) models: upstream's module names, not implemented in this fork.

Importing works (upstream code and tests import these names next to ``GPTModel``); building a hybrid model raises
``NotImplementedError`` naming the feature. GPT checkpoints and the layer maps between GPT and hybrid layouts are in
``megatron.core.dist_checkpointing.gpt_checkpoint_interop``."""
from megatron.core.models.hybrid.hybrid_model import HybridModel

__all__ = ["HybridModel"]
