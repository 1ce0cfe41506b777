"""Models built from megatron.core.transformer."""
