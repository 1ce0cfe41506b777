"""Upstream's ``HybridStack`` / ``HybridStackSubmodules`` names; constructing the stack raises (not implemented)."""
from dataclasses import dataclass
from typing import Optional, Union

from megatron.core.models.hybrid.unsupported import HybridUnsupported
from megatron.core.transformer.spec_utils import ModuleSpec


@dataclass
class HybridStackSubmodules:
    """The layer specs of a hybrid stack, by layer type (upstream's fields)."""

    mamba_layer: Union[ModuleSpec, type, None] = None
    gdn_layer: Union[ModuleSpec, type, None] = None
    attention_layer: Union[ModuleSpec, type, None] = None
    dsa_layer: Union[ModuleSpec, type, None] = None
    mla_layer: Union[ModuleSpec, type, None] = None
    mlp_layer: Union[ModuleSpec, type, None] = None
    moe_layer: Union[ModuleSpec, type, None] = None
    mtp_block_spec: Optional[ModuleSpec] = None


class HybridStack(HybridUnsupported):
    """A hybrid layer stack: not implemented in this fork (constructing one raises ``NotImplementedError``)."""
