"""Upstream's transformer enums (same names and values)."""
import enum

from megatron.core.enums import ModelType  # noqa: F401 (defined in upstream's home, megatron.core.enums)


class LayerType(enum.Enum):
    embedding = 1
    loss = 2
    encoder = 3
    decoder = 4
    mtp = 5


class AttnType(enum.Enum):
    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5
    causal_bottom_right = 6


class AttnBackend(enum.Enum):
    """``TransformerConfig.attention_backend`` (``--attention-backend``). This fork's attention is torch's
    ``scaled_dot_product_attention`` whichever is chosen (see ``TransformerConfig``)."""

    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5


# CUDA-graph scopes: names and values as upstream (checkpoints written by upstream may hold them); what this fork
# graphs of them: transformer/cuda_graphs.py.
class CudaGraphModule(enum.Enum):
    attn = 1
    mlp = 2
    moe = 3
    moe_router = 4
    moe_preprocess = 5
    mamba = 6


class CudaGraphScope(enum.Enum):
    full_iteration = 1
    attn = 2
    mlp = 3
    moe = 4
    moe_router = 5
    moe_preprocess = 6
    mamba = 7
    full_iteration_inference = 8


class InferenceCudaGraphScope(enum.Enum):
    none = 1
    layer = 2
    block = 3
