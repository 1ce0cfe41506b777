"""Upstream's ``models.gpt.moe_module_specs``: the MoE MLP spec of a layer.

``get_moe_module_spec(use_te, num_experts, moe_grouped_gemm)`` is ``gpt_layer_specs.get_mlp_module_spec``'s MoE
spec (Transformer Engine or local experts, grouped or sequential). Upstream's ``BackendSpecProvider`` builders
(``get_moe_module_spec_for_backend``) and inference-optimized experts are not part of this fork: those functions
raise ``NotImplementedError`` naming the feature."""
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec
from megatron.core.transformer.spec_utils import ModuleSpec


def get_moe_module_spec(use_te: Optional[bool] = True, num_experts: Optional[int] = None,
                        moe_grouped_gemm: Optional[bool] = False) -> ModuleSpec:
    """The MoE spec of a layer with ``num_experts`` experts (required)."""
    assert num_experts is not None
    return get_mlp_module_spec(use_te=use_te, num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm)


def get_moe_module_spec_for_backend(backend, num_experts: Optional[int] = None,
                                    moe_grouped_gemm: Optional[bool] = False,
                                    use_te_activation_func: bool = False) -> ModuleSpec:
    """Not implemented: this fork has no ``BackendSpecProvider`` (use ``get_moe_module_spec``)."""
    raise NotImplementedError("get_moe_module_spec_for_backend: backend spec providers (BackendSpecProvider) are not "
                              "part of this fork; use get_moe_module_spec(use_te, num_experts, moe_grouped_gemm)")


def get_inference_optimized_moe_spec() -> ModuleSpec:
    """Not implemented: this fork has no inference-optimized MoE layers."""
    raise NotImplementedError("get_inference_optimized_moe_spec: inference-optimized MoE layers are not part of this "
                              "fork")
