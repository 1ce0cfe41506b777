"""The one place that imports Transformer Engine (TE).

TE is optional: without it (CPU machines, CI) everything here is ``None`` and ``HAVE_TE`` is False, and the
rest of megatron.core runs with plain torch. Other modules must import TE only through this module.
"""
import importlib

try:  # pragma: no cover - exercised only where TE is installed
    import transformer_engine as te  # noqa: F401
    import transformer_engine.pytorch as te_pytorch

    HAVE_TE = True
except Exception:  # ImportError, or a broken install (missing CUDA libraries)
    te = None
    te_pytorch = None
    HAVE_TE = False


def _optional(module: str, name: str):
    """``module.name`` from TE, or None when TE (or that class, in this TE version) is absent."""
    if not HAVE_TE:
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def te_version_string() -> str:
    """The installed TE's version ("0.0.0" without TE, as upstream's ``get_te_version``)."""
    if not HAVE_TE:
        return "0.0.0"
    from importlib.metadata import PackageNotFoundError, version

    try:
        return str(getattr(te, "__version__", None) or version("transformer-engine"))
    except PackageNotFoundError:  # pragma: no cover
        return "0.0.0"


def require_te(feature: str) -> None:
    """Raise a clear error when ``feature`` needs TE and TE is not installed."""
    if not HAVE_TE:
        raise RuntimeError(
            f"{feature} needs Transformer Engine, which is not installed "
            "(pip install 'megatron-core-fork[te]' on a CUDA machine)."
        )


# ---- quantized tensors (used by megatron/core/fp8_utils.py) ----------------------------------------------
QuantizedTensor = _optional("transformer_engine.pytorch.tensor", "QuantizedTensor")
Float8Tensor = _optional("transformer_engine.pytorch.tensor.float8_tensor", "Float8Tensor")
Float8Quantizer = _optional("transformer_engine.pytorch.tensor.float8_tensor", "Float8Quantizer")
Float8CurrentScalingQuantizer = _optional(
    "transformer_engine.pytorch.tensor.float8_tensor", "Float8CurrentScalingQuantizer"
)
MXFP8Tensor = _optional("transformer_engine.pytorch.tensor.mxfp8_tensor", "MXFP8Tensor")
Float8BlockwiseQTensor = _optional(
    "transformer_engine.pytorch.tensor.float8_blockwise_tensor", "Float8BlockwiseQTensor"
)
NVFP4Tensor = _optional("transformer_engine.pytorch.tensor.nvfp4_tensor", "NVFP4Tensor")
MXFP8Quantizer = _optional("transformer_engine.pytorch.tensor.mxfp8_tensor", "MXFP8Quantizer")
Float8BlockQuantizer = _optional("transformer_engine.pytorch.tensor.float8_blockwise_tensor", "Float8BlockQuantizer")
NVFP4Quantizer = _optional("transformer_engine.pytorch.tensor.nvfp4_tensor", "NVFP4Quantizer")
te_DType = _optional("transformer_engine.pytorch.constants", "DType")
# Hardware support per recipe: each returns (available, reason) with return_reason=True (None without TE).
te_is_fp8_available = _optional("transformer_engine.pytorch", "is_fp8_available")
te_is_fp8_block_scaling_available = _optional("transformer_engine.pytorch", "is_fp8_block_scaling_available")
te_is_mxfp8_available = _optional("transformer_engine.pytorch", "is_mxfp8_available")
te_is_nvfp4_available = _optional("transformer_engine.pytorch", "is_nvfp4_available")

# ZeRO-1 with quantized weights (the distributed optimizer's param gather): each rank quantizes its shard of the
# fp32 main params into the weights (amax reduced over the group), the caller all-gathers the bytes, then TE
# refreshes the derived buffers (transpose / columnwise copies).
te_quantize_master_weights = _optional("transformer_engine.pytorch.tensor.utils", "quantize_master_weights") or \
    _optional("transformer_engine.pytorch.tensor.utils", "cast_master_weights_to_fp8")
te_post_all_gather_processing = _optional("transformer_engine.pytorch.tensor.utils", "post_all_gather_processing")

# ---- layers and autocast (used by megatron/core/transformer/) --------------------------------------------
TELinear = _optional("transformer_engine.pytorch", "Linear")
TELayerNormLinear = _optional("transformer_engine.pytorch", "LayerNormLinear")
TEGroupedLinear = _optional("transformer_engine.pytorch", "GroupedLinear")
TEDotProductAttention = _optional("transformer_engine.pytorch", "DotProductAttention")  # context parallelism
te_checkpoint = _optional("transformer_engine.pytorch", "checkpoint")
te_autocast = _optional("transformer_engine.pytorch", "autocast") or _optional(
    "transformer_engine.pytorch", "fp8_autocast"
)
te_quantized_model_init = _optional("transformer_engine.pytorch", "quantized_model_init") or _optional(
    "transformer_engine.pytorch", "fp8_model_init"
)
te_recipe = _optional("transformer_engine.common", "recipe")
# FP8GlobalStateManager.is_fp8_enabled(): inside TE's (FP8/FP4) autocast now
te_fp8_global_state = _optional("transformer_engine.pytorch.quantization", "FP8GlobalStateManager") or _optional(
    "transformer_engine.pytorch.fp8", "FP8GlobalStateManager"
)

# ---- MoE token permutation kernels (--moe-permute-fusion; used by megatron/core/transformer/moe/moe_utils.py) -----
te_moe_permute = _optional("transformer_engine.pytorch", "moe_permute")
te_moe_permute_with_probs = _optional("transformer_engine.pytorch", "moe_permute_with_probs")
te_moe_unpermute = _optional("transformer_engine.pytorch", "moe_unpermute")

# ---- fused rotary embedding (--no-rope-fusion turns it off; used by megatron/core/models/common/embeddings/) ------
# apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", ..., fused=True): one kernel forward and one backward,
# freqs float32 [s, 1, 1, d2] with d2 <= t.shape[-1] (the rest of the channels pass through).
te_apply_rotary_pos_emb = _optional("transformer_engine.pytorch.attention.rope", "apply_rotary_pos_emb")

# ---- fused SwiGLU (--bias-swiglu-fusion; used by megatron/core/fusions/fused_bias_swiglu.py) ---------------------
# transformer_engine_torch.swiglu(input, quantizer) -> silu(input[..., :d/2]) * input[..., d/2:] (quantizer None:
# the input's dtype); dswiglu(grad_output, input, quantizer) -> the gradient w.r.t. input, [..., d].
te_swiglu = _optional("transformer_engine_torch", "swiglu")
te_dswiglu = _optional("transformer_engine_torch", "dswiglu")

# ---- fused router score function + top-k (--moe-router-fusion; used by megatron/core/transformer/moe/router.py) ---
# fused_topk_with_score_function(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor,
# score_function, expert_bias, ...) -> (probs [T, E] in logits' dtype, routing_map [T, E] bool); autograd to logits.
te_fused_topk_with_score_function = _optional("transformer_engine.pytorch.router", "fused_topk_with_score_function") \
    or _optional("transformer_engine.pytorch", "fused_topk_with_score_function")

# ---- CUDA graphs (--cuda-graph-impl transformer_engine; used by megatron/core/transformer/cuda_graphs.py) ---------
# make_graphed_callables(modules, sample_args, num_warmup_iters, allow_unused_input, ..., fp8_enabled, fp8_recipe,
# fp8_group, fp8_weight_caching): torch's make_graphed_callables plus TE's FP8 state (amax/scale) kept right under
# replay.
te_make_graphed_callables = _optional("transformer_engine.pytorch", "make_graphed_callables") or _optional(
    "transformer_engine.pytorch.graph", "make_graphed_callables"
)
