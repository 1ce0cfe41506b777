"""Upstream's GPT layer specs (``get_gpt_layer_local_spec``, ``get_gpt_layer_with_transformer_engine_spec``,
``get_gpt_decoder_block_spec``, ...), same names and parameters.

A spec here chooses Transformer Engine or local linears and dense or MoE MLPs; the layers themselves are this fork's
(``transformer_layer.layer_submodules`` lists what each spec holds). Options this fork does not build (q/k norms
outside multi-latent attention, Kitchen, TE's op fuser or activation modules, multi-token prediction, inference
layers) are refused with the argument named. ``multi_latent_attention=True`` gives upstream's MLA layer
(``qk_layernorm``: its q/kv norms)."""
import inspect
from typing import Optional

from megatron.core.extensions.transformer_engine import HAVE_TE  # noqa: F401 (upstream's flag here)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    default_layer_specs,
)
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules, layer_submodules


# Upstream's flags of what its specs may build with: apex norms and NVIDIA Kitchen layers are never used here.
HAVE_APEX = False
HAVE_KITCHEN = False


def _refuse(function: str, **options) -> None:
    on = [name for name, value in options.items() if value]
    if on:
        raise ValueError(f"{function}: {', '.join(on)} not supported by this fork (its layers have no such module)")


def get_gpt_layer_with_transformer_engine_submodules(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    use_te_op_fuser: Optional[bool] = False,
    use_kitchen: bool = False,
    use_te_activation_func: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
    mla_down_proj_fusion: bool = False,
    use_grouped_gemm_for_dense_mlp: bool = False,
) -> TransformerLayerSubmodules:
    """Transformer Engine linears (norms fused into ``linear_qkv`` / ``linear_fc1``); MoE when ``num_experts``.
    ``fp8`` is ignored (deprecated upstream too)."""
    _refuse("get_gpt_layer_with_transformer_engine_spec", qk_layernorm=qk_layernorm and not multi_latent_attention,
            qk_l2_norm=qk_l2_norm, use_te_op_fuser=use_te_op_fuser,
            use_kitchen=use_kitchen, use_te_activation_func=use_te_activation_func,
            use_kitchen_attention=use_kitchen_attention, mla_down_proj_fusion=mla_down_proj_fusion,
            use_grouped_gemm_for_dense_mlp=use_grouped_gemm_for_dense_mlp)
    return layer_submodules(True, num_experts is not None, bool(moe_grouped_gemm), bool(multi_latent_attention),
                            bool(qk_layernorm))


def _layer_spec_of(submodules_fn):
    """``get_..._spec(*args, **kwargs)``: a TransformerLayer ModuleSpec of ``submodules_fn``'s submodules, with its
    signature (as upstream's ``copy_signature``)."""

    def spec(*args, **kwargs) -> ModuleSpec:
        return ModuleSpec(module=TransformerLayer, submodules=submodules_fn(*args, **kwargs))

    spec.__signature__ = inspect.signature(submodules_fn).replace(return_annotation=ModuleSpec)
    spec.__doc__ = f"A TransformerLayer ModuleSpec of ``{submodules_fn.__name__}``."
    return spec


get_gpt_layer_with_transformer_engine_spec = _layer_spec_of(get_gpt_layer_with_transformer_engine_submodules)
get_gpt_layer_with_transformer_engine_spec.__name__ = "get_gpt_layer_with_transformer_engine_spec"


def get_gpt_layer_local_submodules(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    use_kitchen: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
) -> TransformerLayerSubmodules:
    """Local (torch) linears and separate norms (``WrappedTorchNorm``: the config's ``normalization`` decides, as
    upstream's torch norm; ``normalization`` here must be None, 'LayerNorm' or 'RMSNorm'); MoE when ``num_experts``."""
    if normalization not in (None, "LayerNorm", "RMSNorm"):
        raise ValueError(f"get_gpt_layer_local_spec: normalization must be None, 'LayerNorm' or 'RMSNorm', "
                         f"got {normalization!r}")
    _refuse("get_gpt_layer_local_spec", qk_layernorm=qk_layernorm and not multi_latent_attention,
            qk_l2_norm=qk_l2_norm, use_kitchen=use_kitchen, use_kitchen_attention=use_kitchen_attention)
    return layer_submodules(False, num_experts is not None, bool(moe_grouped_gemm), bool(multi_latent_attention),
                            bool(qk_layernorm))


get_gpt_layer_local_spec = _layer_spec_of(get_gpt_layer_local_submodules)
get_gpt_layer_local_spec.__name__ = "get_gpt_layer_local_spec"


def get_gpt_layer_with_inference_submodules(
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    qk_l2_norm: Optional[bool] = False,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
) -> TransformerLayerSubmodules:
    """Refused: this fork has no inference-optimized layers."""
    raise ValueError("get_gpt_layer_with_inference_spec: inference-optimized layers (transformer_impl="
                     "'inference_optimized') are not supported by this fork")


get_gpt_layer_with_inference_spec = _layer_spec_of(get_gpt_layer_with_inference_submodules)
get_gpt_layer_with_inference_spec.__name__ = "get_gpt_layer_with_inference_spec"


def get_mlp_module_spec(
    use_te: Optional[bool] = True,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    fp8: Optional[str] = None,
    use_te_op_fuser: Optional[bool] = False,
) -> ModuleSpec:
    """The MLP (or MoE, with ``num_experts``) spec of a layer."""
    _refuse("get_mlp_module_spec", use_te_op_fuser=use_te_op_fuser)
    return layer_submodules(bool(use_te), num_experts is not None, bool(moe_grouped_gemm)).mlp


def get_mlp_module_spec_for_backend(backend, num_experts: Optional[int] = None,
                                    moe_grouped_gemm: Optional[bool] = False, use_te_op_fuser: Optional[bool] = False,
                                    use_te_activation_func: bool = False,
                                    use_grouped_gemm_for_dense_mlp: bool = False) -> ModuleSpec:
    """Not implemented: this fork has no ``BackendSpecProvider`` (use ``get_mlp_module_spec``)."""
    raise NotImplementedError("get_mlp_module_spec_for_backend: backend spec providers (BackendSpecProvider) are not "
                              "part of this fork; use get_mlp_module_spec(use_te, num_experts, moe_grouped_gemm)")


def get_gpt_decoder_layer_specs(config, use_transformer_engine: bool, normalization: Optional[str] = None,
                                qk_l2_norm: Optional[bool] = False, vp_stage: Optional[int] = None,
                                pp_rank: Optional[int] = None) -> list:
    """One layer spec per layer: MoE where ``config.moe_layer_freq`` puts one, dense elsewhere (the whole model's;
    ``vp_stage`` / ``pp_rank`` are accepted and change nothing, as upstream's)."""
    _refuse("get_gpt_decoder_layer_specs", qk_l2_norm=qk_l2_norm)
    return default_layer_specs(config, bool(use_transformer_engine))


def get_gpt_decoder_block_spec(config, use_transformer_engine: bool, normalization: Optional[str] = None,
                               qk_l2_norm: Optional[bool] = False, vp_stage: Optional[int] = None,
                               pp_rank: Optional[int] = None) -> TransformerBlockSubmodules:
    """The block spec: every layer's spec and the final norm. ``vp_stage`` / ``pp_rank`` (upstream's, for a
    pipeline stage) are accepted: the spec holds the whole model's layers and ``TransformerBlock`` takes its stage's
    (a stage-local list, as upstream's, is accepted there too)."""
    return TransformerBlockSubmodules(
        layer_specs=get_gpt_decoder_layer_specs(config, use_transformer_engine, normalization, qk_l2_norm, vp_stage,
                                                pp_rank),
        layer_norm=WrappedTorchNorm,
    )


def get_gpt_mtp_block_spec(config, spec, use_transformer_engine: bool, vp_stage: Optional[int] = None,
                           pp_rank: Optional[int] = None):
    """The multi-token prediction block spec (``MultiTokenPredictionBlockSubmodules``, one MTP layer spec per depth
    around the decoder's last layer spec), or None without ``config.mtp_num_layers`` or off the last pipeline stage
    (``pp_rank`` / ``vp_stage``; default the current rank), as upstream."""
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules,
        get_mtp_layer_spec,
    )

    if not getattr(config, "mtp_num_layers", None):
        return None
    pp = config.pipeline_model_parallel_size
    if pp > 1:
        from megatron.core.transformer.transformer_layer import _chunk_position

        vp_stage, pp_rank = _chunk_position(config, vp_stage, pp_rank)
        last_vp = (config.virtual_pipeline_model_parallel_size or 1) - 1
        if pp_rank != pp - 1 or vp_stage != last_vp:
            return None
    if isinstance(spec, TransformerBlockSubmodules):
        layer_spec = spec.layer_specs[-1]
    elif isinstance(spec, ModuleSpec) and spec.module is TransformerLayer:
        layer_spec = spec
    else:
        raise ValueError(f"get_gpt_mtp_block_spec: spec must be a TransformerLayer ModuleSpec or a block spec, got "
                         f"{type(spec).__name__}")
    mtp_layer = get_mtp_layer_spec(layer_spec, bool(use_transformer_engine))
    return MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer] * config.mtp_num_layers)


def get_gpt_mtp_block_spec_for_backend(config, spec, backend, vp_stage: Optional[int] = None,
                                       pp_rank: Optional[int] = None):
    """None without multi-token prediction, as upstream; with it, not implemented: this fork has no
    ``BackendSpecProvider`` (use ``get_gpt_mtp_block_spec(config, spec, use_transformer_engine)``)."""
    if not getattr(config, "mtp_num_layers", None):
        return None
    raise NotImplementedError("get_gpt_mtp_block_spec_for_backend: backend spec providers (BackendSpecProvider) are "
                              "not part of this fork; use get_gpt_mtp_block_spec(config, spec, use_transformer_engine)")
