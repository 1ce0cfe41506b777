"""Activation functions with upstream's names (``megatron.core.activations``), for ``config.activation_func``.

``quick_gelu(x) = x * sigmoid(1.702 x)``: ``--quick-geglu`` is this in a gated linear unit (gpt-oss), usually with
``--glu-linear-offset`` and ``--activation-func-clamp-value`` (see ``megatron.core.transformer.mlp.apply_activation``).
"""
import torch


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 * x)``, the sigmoid approximation of GeLU."""
    return x * torch.sigmoid(1.702 * x)

