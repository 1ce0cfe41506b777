"""Upstream's ``hybrid_stack_spec``: a spec of ``HybridStack``, which this fork does not implement (building it
raises ``NotImplementedError`` naming the feature)."""
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

hybrid_stack_spec = ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules())
