"""TransformerConfig: the model hyper-parameters, with upstream megatron-core field names.

Every field of upstream 0.19.2's TransformerConfig and ModelParallelConfig is here with upstream's default, so a
keyword call built for upstream (Megatron-Bridge, NeMo) binds; the fields of features this fork does not build are
accepted only at that default (``NOT_BUILT``), the inert ones at any value (said where they are declared).
``__post_init__`` fills derived defaults (ffn_hidden_size, kv_channels, num_query_groups, moe_ffn_hidden_size, the
init methods, expert_tensor_parallel_size) and rejects bad combinations with an error that names the field (and the
command-line flag where there is one).
"""
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from megatron.core.transformer.enums import AttnBackend

HAVE_PACKAGING = True  # upstream's flag; packaging is a dependency of this fork


def flag_name(name: str) -> str:
    """The command-line flag of a config field or args attribute: ``num_layers`` -> ``--num-layers``."""
    return "--" + name.replace("_", "-")


def _named(name: str, value, flag: Optional[str] = None) -> str:
    """``name (--flag=value)``: a field, its command-line flag (``flag_name(name)`` unless given) and its value, as the
    error messages name them."""
    return f"{name} ({flag or flag_name(name)}={value!r})"


def pipeline_layer_counts(config) -> List[List[int]]:
    """``counts[vp_stage][pp_rank]``: the transformer layers of each model chunk. A pipeline rank holds
    ``num_layers_in_first_pipeline_stage`` (first rank), ``num_layers_in_last_pipeline_stage`` (last rank) or an
    equal share of the rest (the others), split equally over its ``virtual_pipeline_model_parallel_size`` chunks.
    Layers are numbered chunk by chunk in the order (vp_stage 0: ranks 0..p-1), (vp_stage 1: ranks 0..p-1), ..., as
    upstream's ``get_transformer_layer_offset``. Raises naming the flags when the layers do not split."""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size or 1
    first, last = config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage
    flags = (f"--num-layers {config.num_layers}, --pipeline-model-parallel-size {pp}, virtual stages {vpp}, "
             f"--decoder-first-pipeline-num-layers {first}, --decoder-last-pipeline-num-layers {last}")
    per_rank = [None] * pp
    if pp > 1 and first is not None:
        per_rank[0] = first
    if pp > 1 and last is not None:
        per_rank[-1] = last
    if any(n is not None and n < 0 for n in per_rank):
        raise ValueError(f"the first/last pipeline stage layer counts must be >= 0 ({flags})")
    rest = config.num_layers - sum(n for n in per_rank if n is not None)
    middle = per_rank.count(None)
    if rest < 0 or (middle == 0 and rest != 0) or (middle and rest % middle):
        raise ValueError(f"the layers do not split over the pipeline stages: {rest} layer(s) left for {middle} "
                         f"stage(s) ({flags})")
    per_rank = [rest // middle if n is None else n for n in per_rank]
    if any(n % vpp for n in per_rank):
        raise ValueError(f"each pipeline stage's layers {per_rank} must be divisible by the virtual stages ({flags})")
    return [[n // vpp for n in per_rank] for _ in range(vpp)]


# --recompute-modules (upstream's names) this fork recomputes: the attention core (softmax(QK^T)V), the dense MLP,
# the whole MoE layer, the experts' activation, the layer norms
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "moe_act", "layernorm")
# upstream's names this fork does not recompute (and why)
UPSTREAM_ONLY_RECOMPUTE_MODULES = {"mla_up_proj": "the MLA up projections are not recomputed here",
                                   "shared_experts": "recomputing the shared experts is not implemented"}


# ---- upstream 0.19.2 TransformerConfig fields for features this fork does not build -----------------------------
# {field: what it would do}. Each is accepted at upstream's default (the dataclass default); ``__post_init__``
# (``_refuse_not_built``) raises a ValueError naming the field for any other value, so a recipe that sets one gets
# an error instead of silently different training. The one place this rule lives.
NOT_BUILT = {
    "activation_func_fp8_input_store": "keeping the MLP activation's input in FP8 for backward",
    "attention_output_gate": "a gate on the attention output",
    "batch_invariant_mode": "batch-invariant (deterministic across batch sizes) kernels",
    "cpu_offloading": "offloading activations / weights to the CPU",
    **{name: "DeepSeek sparse attention (experimental_attention_variant='dsa')" for name in (
        "dsa_indexer_head_dim", "dsa_indexer_k_norm_epsilon", "dsa_indexer_k_norm_fp32", "dsa_indexer_loss_coeff",
        "dsa_indexer_n_heads", "dsa_indexer_rope_interleaved", "dsa_indexer_rotate_activation",
        "dsa_indexer_scoring_relu", "dsa_indexer_skip_topk_offset", "dsa_indexer_topk", "dsa_indexer_topk_freq",
        "dsa_indexer_use_sparse_loss", "dsa_kernel_backend")},
    "enable_autocast": "running the forward step under torch.autocast",
    "experimental_attention_variant": "the gated delta net / DeepSeek sparse attention layers",
    "fine_grained_activation_offloading": "offloading module inputs to the CPU",
    "flash_decode": "the flash-decoding inference kernel",
    "fp32_residual_connection": "an fp32 residual stream",
    "fp8_multi_head_attention": "FP8 multi-head attention",
    "fp8_output_proj": "an FP8 output layer",
    "hetereogenous_dist_checkpoint": "heterogeneous layers in distributed checkpoints",
    "heterogeneous_block_specs": "heterogeneous (nemotron-nas) block specs",
    "hybrid_context_parallel": "hybrid data x context parallelism",
    "is_hybrid_model": "hybrid Mamba / attention models",
    "linear_attention_freq": "linear-attention (gated delta net) layers",
    "log_max_attention_logit": "logging the max attention logit",
    **{name: "Mamba layers" for name in ("mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "mamba_state_dim",
                                         "mamba_training_ssm_states_dtype")},
    "max_seqlen_per_dp_cp_rank": "the sequence scheduler of hybrid context parallelism",
    "moe_apply_probs_on_input": "applying the routing probabilities on the experts' input",
    "moe_enable_deepep": "the DeepEP (flex) token dispatcher",
    "moe_enable_routing_replay": "MoE routing replay",
    "moe_expert_rank_capacity_factor": "per-expert-rank token capacity",
    "moe_flex_dispatcher_backend": "the flex token dispatcher",
    "moe_input_jitter_eps": "input jitter of the MoE router",
    "moe_latent_size": "MoE latent projections",
    "moe_mlp_glu_interleave_size": "block-interleaved GLU weights of the experts",
    "moe_paged_stash": "the paged stash of expert activations",
    "moe_router_force_biased": "a random router bias",
    "moe_router_padding_for_fp8": "padding the routing map for quantized experts",
    "moe_router_padding_for_quantization": "padding the routing map for quantized experts",
    "moe_shared_expert_glu_interleave_size": "block-interleaved GLU weights of the shared experts",
    "moe_single_grouped_bias": "the experts' biases as one grouped parameter",
    "moe_single_grouped_weight": "the experts' weights as one grouped parameter",
    "moe_token_dropping": "upstream's (unsupported) token dropping switch; use moe_expert_capacity_factor",
    "mrope_section": "multimodal rotary embeddings",
    "mtp_detach_heads": "detaching the MTP heads from the main model",
    "mtp_hybrid_override_pattern": "hybrid MTP layers",
    "mtp_standalone": "MTP in its own pipeline stage (pipeline_model_parallel_layout)",
    "mtp_use_repeated_layer": "one MTP layer used repeatedly",
    "mup_output_mult": "MuP logit scaling",
    "no_rope_freq": "layers without rotary embeddings",
    "num_microbatches_with_partial_activation_checkpoints": "partial activation checkpointing",
    "overlap_moe_expert_parallel_comm": "the combined 1F1B schedule overlapping the MoE all-to-all",
    "pipeline_model_parallel_layout": "custom pipeline layouts",
    "qk_clip": "QK-clip of the query / key weights",
    "qk_l2_norm": "L2 norm of queries and keys",
    "quant_recipe": "per-module quantization recipes",
    "rotary_interleaved": "interleaved (RoFormer-style) rotary embeddings in standard attention",
    "test_mode": "upstream's real-time test hooks",
    "tp_comm_overlap": "TE's tensor-parallel communication overlap (userbuffers)",
    "tp_only_amax_red": "FP8 amax reduction over the TP group only",
    "use_grouped_gemm_for_dense_mlp": "a grouped GEMM for the dense MLP",
    "use_grouped_gemm_for_shared_expert": "a grouped GEMM for the shared experts",
    "use_kitchen": "the kitchen quantization extension",
    "use_kitchen_attention": "the kitchen attention extension",
    "use_mup": "MuP (maximal update parametrization)",
    "use_te_activation_func": "Transformer Engine's activation modules",
    "use_transformer_engine_op_fuser": "Transformer Engine's operation fuser",
}


class _DefaultImpl(str):
    """The ``transformer_impl`` default (upstream's 'transformer_engine'), told apart from the same value given."""


@dataclass
class TransformerConfig:
    # ---- model shape --------------------------------------------------------------------------------------
    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    ffn_hidden_size: Optional[int] = None  # default 4 * hidden_size
    kv_channels: Optional[int] = None  # default hidden_size // num_attention_heads
    num_query_groups: Optional[int] = None  # GQA; default num_attention_heads (plain MHA)

    # ---- regularisation / numerics ------------------------------------------------------------------------
    hidden_dropout: float = 0.0  # upstream: 0.1 (why not here: tools/public_name_diff_accepted.txt); flag: 0.1
    attention_dropout: float = 0.0
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False  # --apply-layernorm-1p: norms scale by 1 + weight (weight init 0)
    normalization: str = "LayerNorm"  # 'LayerNorm' | 'RMSNorm'
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # QKV bias when add_bias_linear is False
    gated_linear_unit: bool = False
    activation_func: Callable = F.gelu
    apply_residual_connection_post_layernorm: bool = False
    rotary_base: int = 10000
    rotary_percent: float = 1.0

    # ---- initialization -----------------------------------------------------------------------------------
    init_method_std: float = 0.02
    perform_initialization: bool = True
    use_cpu_initialization: bool = False

    # ---- precision ------------------------------------------------------------------------------------------
    params_dtype: torch.dtype = torch.float32
    fp16: bool = False
    bf16: bool = False
    fp8: Optional[str] = None  # None | 'e4m3' | 'hybrid'
    fp8_recipe: str = "delayed"  # 'delayed' | 'tensorwise' | 'mxfp8' | 'blockwise'
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    fp8_param: bool = False
    first_last_layers_bf16: bool = False  # the first/last layers below stay in high precision (no FP8/FP4 compute
    num_layers_at_start_in_bf16: int = 1  # nor quantized weights), as upstream
    num_layers_at_end_in_bf16: int = 1
    fp4: Optional[str] = None  # None | 'nvfp4'
    fp4_recipe: str = "nvfp4"
    fp4_param: bool = False

    # ---- implementation -------------------------------------------------------------------------------------
    transformer_impl: str = _DefaultImpl("transformer_engine")  # or 'local'; upstream's default (_resolve_default_impl)

    # ---- parallelism (tensor, sequence, pipeline, expert, context) ---------------------------------------------
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    cp_comm_type: Optional[Union[str, List[str]]] = None  # --cp-comm-type: one, or one per layer (None: p2p)
    virtual_pipeline_model_parallel_size: Optional[int] = None
    num_layers_in_first_pipeline_stage: Optional[int] = None  # --decoder-first-pipeline-num-layers
    num_layers_in_last_pipeline_stage: Optional[int] = None  # --decoder-last-pipeline-num-layers
    account_for_embedding_in_pipeline_split: bool = False  # not supported (must stay False)
    account_for_loss_in_pipeline_split: bool = False  # not supported (must stay False)

    # ---- pipeline schedules (upstream's ModelParallelConfig fields, read by megatron.core.pipeline_parallel) -------
    pipeline_dtype: Optional[torch.dtype] = None  # dtype of the activations sent between stages (None: params_dtype)
    variable_seq_lengths: bool = False  # exchange the shapes before each p2p transfer
    batch_p2p_comm: bool = True  # one batch_isend_irecv per exchange
    batch_p2p_sync: bool = True
    overlap_p2p_comm: bool = False  # not supported (must stay False)
    deallocate_pipeline_outputs: bool = False
    microbatch_group_size_per_vp_stage: Optional[int] = None  # default pipeline_model_parallel_size
    no_sync_func: Optional[Callable] = None  # context manager disabling the DP grad sync (set by the training loop)
    grad_sync_func: Optional[Callable] = None
    param_sync_func: Optional[Callable] = None
    finalize_model_grads_func: Optional[Callable] = None  # called by the schedules after the last backward
    grad_scale_func: Optional[Callable] = None  # fp16: multiplies the loss by the loss scale
    timers: Optional[Callable] = None

    attention_backend: AttnBackend = AttnBackend.auto
    """Upstream's ``AttnBackend`` (its name is accepted too and turned into the member): which kernel of torch's
    ``scaled_dot_product_attention`` computes core attention: auto (torch picks), flash (FLASH_ATTENTION), fused
    (EFFICIENT_ATTENTION), unfused / local (MATH). The same math whichever is picked."""

    bias_activation_fusion: bool = False
    """SwiGLU (``gated_linear_unit`` with silu) runs as one fused autograd function that saves only its input
    (``megatron.core.fusions.fused_bias_swiglu``: Transformer Engine's ``swiglu`` / ``dswiglu`` on CUDA, fp32 torch
    ops else); the same values up to rounding. ``--bias-swiglu-fusion`` (on by default, as upstream) /
    ``--no-bias-swiglu-fusion``. No effect for other activations (no fused GeLU here)."""

    apply_rope_fusion: bool = False
    """Rotary embeddings by Transformer Engine's fused kernel (``megatron.core.models.common.embeddings.
    rotary_pos_embedding``) where TE and CUDA are there, torch ops else; the same rotation up to rounding. On in
    training unless ``--no-rope-fusion``, as upstream."""

    # ---- accepted for upstream compatibility; no effect in this fork ------------------------------------------
    gradient_accumulation_fusion: bool = False
    bias_dropout_fusion: bool = False
    masked_softmax_fusion: bool = False
    persist_layer_norm: bool = False
    attention_softmax_in_fp32: bool = True
    apply_query_key_layer_scaling: bool = False
    deterministic_mode: bool = False
    calculate_per_token_loss: bool = False
    fp8_wgrad: bool = True
    fp8_interval: int = 1
    init_model_with_meta_device: bool = False
    """The model is built under ``torch.device('meta')`` (``--init-model-with-meta-device``); the DDP / FSDP
    wrapper materialises it (any meta tensor triggers that too). The one home of this flag."""

    # ---- activation recompute (upstream's fields and flags) ------------------------------------------------------
    recompute_granularity: Optional[str] = None  # None | 'full' (whole layers) | 'selective' (recompute_modules)
    recompute_method: Optional[str] = None  # full: 'uniform' (chunks of recompute_num_layers) | 'block' (the first N)
    recompute_num_layers: Optional[int] = None
    recompute_modules: Optional[List[str]] = None  # selective; default ['core_attn'] as upstream
    distribute_saved_activations: bool = False

    # ---- gpt-oss: sliding-window attention, attention sinks, clamped GLU (upstream's fields) -----------------------
    window_size: Optional[Tuple[int, int]] = None
    """--window-size "(left,right)": a query at position i attends the keys in [i - left, i + right] (causal: right
    0; -1: unbounded), on the layers ``is_layer_window_attention`` picks. None: full attention everywhere."""
    window_attn_skip_freq: Optional[Union[int, List[int]]] = None
    """--window-attn-skip-freq: an int N makes every N-th layer (layer_number % N == 0) a full-attention layer; a list
    gives each layer (1: sliding window, 0: full). None: every layer has the window."""
    softmax_type: str = "vanilla"
    """--softmax-type: 'vanilla'; 'off-by-one' (an extra logit 0 per head in the softmax's denominator); 'learnable'
    (that logit is the parameter ``core_attention.softmax_offset`` [heads], TP-sharded over heads)."""
    glu_linear_offset: float = 0.0
    """--glu-linear-offset: a gated linear unit computes ``act(x_glu) * (x_linear + offset)``."""
    activation_func_clamp_value: Optional[float] = None
    """--activation-func-clamp-value c: a gated linear unit clamps ``x_glu`` to ``<= c`` and ``x_linear`` to
    ``[-c, c]`` before the activation (gpt-oss)."""

    qk_layernorm: bool = False
    """--qk-layernorm: a norm (``normalization``, over each head's ``kv_channels``) on the queries and the keys before
    rotary embedding (upstream's ``self_attention.q_layernorm`` / ``k_layernorm``)."""

    # ---- CUDA graphs (upstream's fields and defaults; transformer/cuda_graphs.py) ---------------------------------
    cuda_graph_impl: str = "none"
    """--cuda-graph-impl: 'none'; 'local' (torch's make_graphed_callables) or 'transformer_engine' (TE's, FP8-aware):
    per-layer graphs of ``cuda_graph_modules``, captured after ``cuda_graph_warmup_steps`` eager training steps and
    replayed. Upstream's 'full_iteration' is refused (see ``cuda_graph_config.check_cuda_graph_config``)."""
    cuda_graph_modules: Union[str, List] = "full"
    """--cuda-graph-modules: the parts of each layer graphed (``CudaGraphModule``: attn, mlp, moe_router; upstream's
    moe, moe_preprocess, mamba are refused); empty (upstream's default 'full', normalized to []) graphs the whole
    layer."""
    cuda_graph_scope: Optional[Union[str, List]] = None
    """Deprecated upstream (renamed ``cuda_graph_modules``, --cuda-graph-scope); moved there by ``__post_init__``."""
    cuda_graph_warmup_steps: int = 3
    """--cuda-graph-warmup-steps: eager training steps before the capture (upstream's default)."""
    enable_cuda_graph: bool = False  # deprecated upstream: cuda_graph_impl='local'
    external_cuda_graph: bool = False  # deprecated upstream: cuda_graph_impl='transformer_engine'
    cuda_graph_retain_backward_graph: bool = False  # upstream's; only False here
    cuda_graph_use_single_mempool: bool = True  # upstream's, for full_iteration only (not built): no effect

    # ---- not supported: must stay at the default (clear error otherwise) --------------------------------------
    fp8_dot_product_attention: bool = False

    # ---- mixture of experts ---------------------------------------------------------------------------------
    num_moe_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None  # default ffn_hidden_size
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"  # 'softmax' | 'sigmoid'
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_load_balancing_type: str = "aux_loss"  # 'aux_loss' | 'seq_aux_loss' (per sequence) | 'none'
    moe_aux_loss_coeff: float = 0.0
    moe_layer_freq: Union[int, List[int]] = 1  # every n-th layer is MoE (1: all), or a 0/1 list per layer
    moe_router_dtype: Optional[str] = None  # router logits are always computed in float32 here
    moe_grouped_gemm: bool = False
    moe_token_dispatcher_type: str = "allgather"
    moe_permute_fusion: bool = False  # TE's fused token permutation where TE and CUDA are present (torch ops else)
    moe_router_fusion: bool = False  # TE's fused score function + top-k where TE and CUDA are present (torch ops else)
    moe_shared_expert_intermediate_size: Optional[int] = None  # shared experts' total hidden size (None: none)
    moe_shared_expert_gate: bool = False  # the shared experts' output scaled by sigmoid(x . gate_weight)
    moe_shared_expert_overlap: bool = False  # accepted; the shared experts run un-overlapped here (same values)
    moe_z_loss_coeff: Optional[float] = None  # router z-loss: coeff * mean(logsumexp(logits)^2)
    moe_router_force_load_balancing: bool = False  # benchmark only: random routing logits (straight-through grad)
    moe_router_num_groups: Optional[int] = None  # group-limited routing: experts in this many equal groups
    moe_router_group_topk: Optional[int] = None  # ... of which each token may use this many (the best by score)
    moe_expert_capacity_factor: Optional[float] = None  # expert capacity ceil(T * k / E * factor); None: dropless
    moe_pad_expert_input_to_capacity: bool = False  # every expert gets exactly its capacity (zero-weight padding)
    moe_token_drop_policy: str = "probs"  # over capacity, keep the highest-prob tokens ('probs') or the first ones

    # ---- multi-token prediction (upstream's fields; transformer/multi_token_prediction.py) ------------------------
    mtp_num_layers: Optional[int] = None  # MTP depths, on the last pipeline stage (None: no MTP)
    mtp_loss_scaling_factor: Optional[float] = 0.1  # the MTP loss: factor x mean over depths

    # ==== upstream 0.19.2 fields added for drop-in use (keyword use; every one takes upstream's default) =========
    # Three kinds, by what the fork does with a value: (a) honoured; (b) NOT_BUILT (top of this module): only
    # upstream's default is accepted, another value raises naming the field; (c) inert: any value is accepted
    # because this fork never reads it and ignoring it cannot change training results (said per field).

    # ---- (a) honoured -------------------------------------------------------------------------------------------
    init_method: Optional[Callable] = None
    """Draws the weights of the input-side linears (QKV, fc1, the router, MLA's projections, the output layer, MTP's
    eh_proj), the learnable softmax offset and the shared-expert gate. None: normal(0, init_method_std), filled
    by ``__post_init__`` as upstream."""
    output_layer_init_method: Optional[Callable] = None
    """Draws the weights of each layer's output-side linears (attention linear_proj, fc2). None:
    normal(0, init_method_std / sqrt(2 * num_layers)), as upstream."""
    embedding_init_method: Optional[Callable] = None
    """Draws the word / position embeddings. None: ``init_method`` when embedding_init_method_std equals
    init_method_std, else normal(0, embedding_init_method_std), as upstream."""
    embedding_init_method_std: Optional[float] = None  # None: init_method_std (filled by __post_init__, as upstream)
    softmax_scale: Optional[float] = None  # the scale of q k^T in standard core attention (None: 1/sqrt(kv_channels));
    # multi-latent attention keeps its own YaRN scale, as upstream
    expert_tensor_parallel_size: Optional[int] = None  # None: tensor_model_parallel_size (filled, as upstream); the
    # experts are split over the TP ranks here, so another value is refused
    multi_latent_attention: bool = False  # True only on MLATransformerConfig (which builds MLA); refused here
    moe_layer_recompute: bool = False  # upstream's deprecated form of --recompute-modules moe: selective recompute
    # with 'moe' added to recompute_modules, as upstream's __post_init__
    moe_router_topk_limited_devices: Optional[int] = None  # deprecated upstream: group-limited routing with
    # moe_router_num_groups = expert_model_parallel_size and moe_router_group_topk = this, as upstream
    moe_grad_scale_func: Optional[Callable] = None  # () -> the MoE aux losses' gradient scale (None: grad_scale_func)
    mtp_grad_scale_func: Optional[Callable] = None  # () -> the MTP loss's gradient scale (None: grad_scale_func)

    # ---- (c) inert: never read here; ignoring the value cannot change training results --------------------------
    # performance / memory knobs of kernels and communication (the fork's own paths compute the same values)
    barrier_with_L1_time: bool = True  # timer barriers only
    clone_scatter_output_in_embedding: bool = True  # a clone for early garbage collection only
    config_logger_dir: str = ""  # upstream's config dump for debugging; nothing is dumped here
    cross_entropy_loss_fusion: bool = False  # a fused kernel of the same cross entropy
    cross_entropy_fusion_impl: str = "native"  # 'native' | 'te': which fused kernel (with cross_entropy_loss_fusion)
    disable_parameter_transpose_cache: bool = False  # TE's weight-transpose cache (memory only)
    memory_efficient_layer_norm: bool = False  # Apex's memory-efficient LayerNorm kernel (same values)
    fused_residual_rmsnorm: bool = False  # a fused residual + RMSNorm backward kernel (same values)
    fused_single_qkv_rope: bool = False  # skips a QKV split/concat around RoPE (same values)
    use_fused_weighted_squared_relu: bool = False  # a fused kernel of the experts' weighted squared ReLU
    flash_attention_version: Optional[int] = None  # pins the FlashAttention generation (a kernel choice)
    mlp_chunks_for_training: int = 1  # the MLP over sequence chunks (rows are independent: same values, less memory)
    use_mamba_mem_eff_path: bool = True  # Mamba's memory-efficient path (Mamba layers are not built here)
    high_priority_a2a_comm_stream: bool = False  # stream priority of the EP overlap (not built)
    ep_overlap_early_attn_memory_release: bool = False  # memory release of the EP overlap (not built)
    delay_wgrad_compute: bool = False  # weight-gradient scheduling for communication overlap (same gradients)
    overlap_dispatch_backward_with_experts_wgrad: bool = False  # scheduling of the experts' wgrad (same gradients)
    defer_embedding_wgrad_compute: bool = False  # scheduling of the embedding wgrad in the pipeline flush
    wgrad_deferral_limit: int = 0  # (with defer_embedding_wgrad_compute)
    symmetric_ar_type: Optional[str] = None  # symmetric-memory all-reduce kernel (inference)
    use_ring_exchange_p2p: bool = False  # a custom-torch p2p kernel (the same transfers)
    pipeline_model_parallel_comm_backend: Optional[str] = None  # 'nccl' | 'ucc': the transport of the p2p transfers
    disable_bf16_reduced_precision_matmul: bool = False  # as upstream's core: read only by the training setup, from
    # --disable-bf16-reduced-precision-matmul (megatron/training/initialize.py), not from this config
    moe_per_layer_logging: bool = False  # logging only; the training loop logs per layer with --moe-per-layer-logging
    use_te_rng_tracker: bool = False  # upstream's core reads it only in checks; the tracker kind is chosen when
    # seeding (tensor_parallel.model_parallel_cuda_manual_seed(te_rng_tracker=...), --te-rng-tracker)
    # inference only (megatron.core.inference is not part of this fork; training never reads these)
    inference_cuda_graph_scope: Optional[Any] = None
    inference_disable_triton_nvls_kernels: bool = False
    inference_fuse_tp_communication: bool = False
    inference_grouped_gemm_backend: str = "vllm"
    inference_moe_disable_fused_quant_kernels: bool = False
    inference_moe_token_dispatcher_type: str = "nvls"
    inference_rng_tracker: bool = False
    inference_sampling_seed: int = 42
    use_inference_optimized_layers: bool = False
    mlp_chunks_for_prefill: int = 1
    nccl_all_reduce_for_prefill: bool = False
    moe_pad_experts_for_cuda_graph_inference: bool = False
    # read upstream only with a switch that NOT_BUILT refuses (so without effect there too at its default)
    _cpu_offloading_context: Optional[Any] = None  # upstream-internal, with cpu_offloading
    cpu_offloading_activations: bool = True  # with cpu_offloading
    cpu_offloading_weights: bool = False
    cpu_offloading_num_layers: int = 0
    cpu_offloading_double_buffering: bool = False
    cpu_offloading_retain_pinned_cpu_buffers: bool = False
    offload_modules: Optional[List[str]] = field(default_factory=list)  # with fine_grained_activation_offloading
    min_offloaded_tensor_size: int = 1024 * 1024
    activation_offload_fraction: float = 1.0
    delta_offload_bytes_across_pp_ranks: int = 0
    delay_offload_until_cuda_graph: bool = False
    fine_grained_offloading_max_inflight_offloads: Optional[int] = None
    tp_comm_bootstrap_backend: str = "nccl"  # with tp_comm_overlap
    tp_comm_overlap_ag: bool = True
    tp_comm_overlap_rs: bool = True
    tp_comm_overlap_rs_dgrad: bool = False
    tp_comm_bulk_dgrad: bool = True
    tp_comm_bulk_wgrad: bool = True
    tp_comm_split_ag: bool = True
    tp_comm_split_rs: bool = True
    tp_comm_atomic_ag: bool = False
    tp_comm_atomic_rs: bool = False
    tp_comm_overlap_disable_qkv: bool = False
    tp_comm_overlap_disable_fc1: bool = False
    autocast_dtype: Optional[torch.dtype] = None  # with enable_autocast; None: params_dtype (filled, as upstream)
    experimental_attention_variant_loss_scale_func: Optional[Callable] = None  # with experimental_attention_variant
    fp8_quantizer_factory: Optional[str] = None  # with fp8_recipe 'custom' (refused by the fp8_recipe check)
    fp4_quantizer_factory: Optional[str] = None  # with fp4_recipe 'custom'
    kitchen_attention_backend: str = "sdpa"  # with use_kitchen_attention
    linear_conv_kernel_dim: Optional[int] = 4  # the gated delta net's shape (experimental_attention_variant)
    linear_key_head_dim: Optional[int] = 128
    linear_num_key_heads: Optional[int] = 16
    linear_num_value_heads: Optional[int] = 32
    linear_value_head_dim: Optional[int] = 128
    moe_deepep_num_sms: Optional[int] = None  # with the flex token dispatcher (moe_enable_deepep / ..._backend)
    moe_flex_dispatcher_num_sms: Optional[int] = None
    moe_hybridep_num_blocks_permute: Optional[int] = None
    moe_hybridep_num_blocks_unpermute: Optional[int] = None
    moe_hybridep_num_sms: Optional[int] = None
    moe_hybridep_num_sms_preprocessing: int = 108
    moe_hybridep_pad_uneven_dispatch_inputs: bool = False
    moe_permute_fusion_into_hybridep: bool = False
    moe_ncclep_static_shape: bool = False
    moe_ncclep_zero_copy: bool = False
    moe_paged_stash_buffer_size_factor_cpu: float = 0.0  # with moe_paged_stash
    moe_paged_stash_buffer_size_factor_cuda: float = 1.1
    moe_paged_stash_page_size: int = 64
    moe_router_quantile_balancing_ema: float = 0.0  # with moe_router_load_balancing_type 'quantile_balancing'
    mup_attn_scale_power: float = 1.0  # with use_mup
    mup_base_head_dim: Optional[float] = None
    mup_base_hidden_size: Optional[int] = None
    mup_embedding_mult: float = 1.0
    mup_width_mult: float = 1.0
    overlap_p2p_comm_warmup_flush: bool = False  # with overlap_p2p_comm (refused above)
    qk_clip_alpha: float = 0.5  # with qk_clip
    qk_clip_threshold: float = 100

    # ---- (b) not built: upstream's default only (NOT_BUILT says why; hierarchical_context_parallel_sizes,
    # gtp_weight_remat_size and the *_num_weight_shards are checked by _check_parallel_sizes) ----------------------
    hierarchical_context_parallel_sizes: Optional[List[int]] = None
    gtp_weight_remat_size: int = 1
    expert_gtp_weight_remat_size: int = 1
    tensor_parallel_num_weight_shards: Optional[int] = None  # None or tensor_model_parallel_size (no GTP)
    expert_tensor_parallel_num_weight_shards: Optional[int] = None  # None or expert_tensor_parallel_size
    activation_func_fp8_input_store: bool = False
    attention_output_gate: bool = False
    batch_invariant_mode: bool = False
    cpu_offloading: bool = False
    dsa_indexer_head_dim: Optional[int] = None
    dsa_indexer_k_norm_epsilon: Optional[float] = None
    dsa_indexer_k_norm_fp32: bool = False
    dsa_indexer_loss_coeff: Optional[float] = None
    dsa_indexer_n_heads: Optional[int] = None
    dsa_indexer_rope_interleaved: bool = False
    dsa_indexer_rotate_activation: bool = True
    dsa_indexer_scoring_relu: bool = True
    dsa_indexer_skip_topk_offset: int = 0
    dsa_indexer_topk: Optional[int] = None
    dsa_indexer_topk_freq: int = 1
    dsa_indexer_use_sparse_loss: bool = False
    dsa_kernel_backend: str = "none"
    enable_autocast: bool = False
    experimental_attention_variant: Optional[str] = None
    fine_grained_activation_offloading: bool = False
    flash_decode: bool = False
    fp32_residual_connection: bool = False
    fp8_multi_head_attention: bool = False
    fp8_output_proj: bool = False
    hetereogenous_dist_checkpoint: bool = False
    heterogeneous_block_specs: bool = False
    hybrid_context_parallel: bool = False
    is_hybrid_model: bool = False
    linear_attention_freq: Optional[Union[int, List[int]]] = None
    log_max_attention_logit: bool = False
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: Optional[int] = None
    mamba_state_dim: int = 128
    mamba_training_ssm_states_dtype: Optional[torch.dtype] = None
    max_seqlen_per_dp_cp_rank: Optional[int] = None
    moe_apply_probs_on_input: bool = False
    moe_enable_deepep: bool = False
    moe_enable_routing_replay: bool = False
    moe_expert_rank_capacity_factor: Optional[float] = None
    moe_flex_dispatcher_backend: str = "deepep"
    moe_input_jitter_eps: Optional[float] = None
    moe_latent_size: Optional[int] = None
    moe_mlp_glu_interleave_size: Optional[int] = None
    moe_paged_stash: bool = False
    moe_router_force_biased: Optional[float] = None
    moe_router_padding_for_fp8: Optional[bool] = False
    moe_router_padding_for_quantization: Optional[bool] = False
    moe_shared_expert_glu_interleave_size: Optional[int] = None
    moe_single_grouped_bias: bool = False
    moe_single_grouped_weight: bool = False
    moe_token_dropping: bool = False
    mrope_section: Optional[List[int]] = None
    mtp_detach_heads: bool = False
    mtp_hybrid_override_pattern: Optional[str] = None
    mtp_standalone: bool = False
    mtp_use_repeated_layer: bool = False
    mup_output_mult: float = 1.0
    no_rope_freq: Optional[Union[int, List[int]]] = None
    num_microbatches_with_partial_activation_checkpoints: Optional[int] = None
    overlap_moe_expert_parallel_comm: bool = False
    pipeline_model_parallel_layout: Optional[Union[str, list, Any]] = None
    qk_clip: bool = False
    qk_l2_norm: bool = False
    quant_recipe: Optional[Any] = None
    rotary_interleaved: bool = False
    test_mode: bool = False
    tp_comm_overlap: bool = False
    tp_only_amax_red: bool = False
    use_grouped_gemm_for_dense_mlp: bool = False
    use_grouped_gemm_for_shared_expert: bool = False
    use_kitchen: bool = False
    use_kitchen_attention: bool = False
    use_mup: bool = False
    use_te_activation_func: bool = False
    use_transformer_engine_op_fuser: bool = False

    def _refuse_not_built(self) -> None:
        """A NOT_BUILT field away from upstream's default (the dataclass default) raises, naming it and why."""
        for f in fields(self):
            if f.name not in NOT_BUILT:
                continue
            default = f.default_factory() if f.default_factory is not MISSING else f.default
            value = getattr(self, f.name)
            if value is not default and value != default:
                raise ValueError(f"TransformerConfig.{f.name}={value!r}: {NOT_BUILT[f.name]} is not built in this "
                                 f"fork; leave {f.name} at upstream's default {default!r}")

    def _check_upstream_parallel_sizes(self) -> None:
        """Upstream's expert tensor parallel size (None: the TP size, filled as upstream; the experts are split over
        the TP ranks here, so with experts another size is refused; without experts it has no effect) and the
        parallelisms not built here: hierarchical context parallelism and GTP weight rematerialization (their
        neutral values accepted: sizes 1, weight shards None or the (expert) TP size)."""
        tp, etp = self.tensor_model_parallel_size, self.expert_tensor_parallel_size
        if etp is None:
            etp = self.expert_tensor_parallel_size = tp
        if isinstance(etp, bool) or not isinstance(etp, int) or etp < 1:
            raise ValueError(f"{_named('expert_tensor_parallel_size', etp)} must be a positive int or None")
        if self.num_moe_experts is not None and etp != tp:
            raise ValueError(f"{_named('expert_tensor_parallel_size', etp)} is not supported: the experts are split "
                             f"over the tensor-parallel ranks ({_named('tensor_model_parallel_size', tp)}); give "
                             "that value or None")
        hcp = self.hierarchical_context_parallel_sizes
        if hcp and math.prod(hcp) != 1:  # parallel_state.initialize_model_parallel's rule and words
            raise ValueError(f"hierarchical_context_parallel_sizes={hcp} (--hierarchical-context-parallel-sizes) is "
                             "not supported by this fork yet (use the default)")
        for name, shards, size in (("gtp_weight_remat_size", self.tensor_parallel_num_weight_shards, tp),
                                   ("expert_gtp_weight_remat_size", self.expert_tensor_parallel_num_weight_shards,
                                    etp)):
            if getattr(self, name) != 1:
                raise ValueError(f"TransformerConfig.{name}={getattr(self, name)!r}: generalized tensor parallel "
                                 "weight rematerialization is not built in this fork; leave it at 1")
            shards_name = name.replace("gtp_weight_remat_size", "tensor_parallel_num_weight_shards")
            if shards is not None and shards != size:
                raise ValueError(f"TransformerConfig.{shards_name}={shards!r}: only the tensor-parallel split itself "
                                 f"({size} shards, no generalized tensor parallelism) is built in this fork; give "
                                 f"{size} or None")

    def _fill_upstream_defaults(self) -> None:
        """Upstream's derived defaults of its init methods (normal(0, init_method_std); the layers' output
        projections scaled by 1/sqrt(2 * num_layers); the embeddings init_method, or normal(0,
        embedding_init_method_std) where that differs) and of autocast_dtype (params_dtype); MLA only on
        MLATransformerConfig."""
        from megatron.core.transformer.utils import init_method_normal, scaled_init_method_normal

        if self.embedding_init_method_std is None:
            self.embedding_init_method_std = self.init_method_std
        if self.embedding_init_method is None:
            if self.init_method is None or self.embedding_init_method_std != self.init_method_std:
                self.embedding_init_method = init_method_normal(self.embedding_init_method_std)
            else:
                self.embedding_init_method = self.init_method
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(self.init_method_std, self.num_layers)
        for name in ("init_method", "output_layer_init_method", "embedding_init_method"):
            if not callable(getattr(self, name)):
                raise ValueError(f"TransformerConfig.{name} must be a callable (tensor) -> tensor or None, got "
                                 f"{getattr(self, name)!r}")
        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype
        if self.multi_latent_attention and not isinstance(self, MLATransformerConfig):
            raise ValueError("TransformerConfig.multi_latent_attention=True (--multi-latent-attention): build an "
                             "MLATransformerConfig, which holds the MLA fields; TransformerConfig builds standard "
                             "attention")

    def _apply_moe_layer_recompute(self) -> None:
        """Upstream's deprecated moe_layer_recompute: selective recompute with 'moe' in recompute_modules."""
        if not self.moe_layer_recompute:
            return
        if self.recompute_granularity == "full":
            raise ValueError("moe_layer_recompute (--moe-layer-recompute) with recompute_granularity 'full' "
                             "(--recompute-granularity full): give one of them, as upstream")
        self.recompute_granularity = "selective"
        modules = list(self.recompute_modules) if self.recompute_modules is not None else ["core_attn"]
        self.recompute_modules = modules if "moe" in modules else modules + ["moe"]

    def _apply_topk_limited_devices(self) -> None:
        """Upstream's deprecated moe_router_topk_limited_devices: group-limited routing over the EP ranks
        (moe_router_num_groups = expert_model_parallel_size, moe_router_group_topk = it), as upstream."""
        k = self.moe_router_topk_limited_devices
        if not k:
            return
        derived = (self.expert_model_parallel_size, k)
        if self.moe_router_group_topk and (self.moe_router_num_groups, self.moe_router_group_topk) != derived:
            raise ValueError(f"{_named('moe_router_topk_limited_devices', k)} is deprecated and replaced by "
                             "moe_router_num_groups / moe_router_group_topk (--moe-router-num-groups / "
                             "--moe-router-group-topk): give only those")
        self.moe_router_num_groups, self.moe_router_group_topk = derived

    def _check_first_last_bf16(self):
        """Upstream's checks: not with delayed scaling; each count in [0, layers per pipeline stage]."""
        if self.fp8 is not None and self.fp8_recipe == "delayed":
            raise ValueError("first_last_layers_bf16 (--first-last-layers-bf16) is not supported with delayed scaling "
                             "(--fp8-recipe delayed), as upstream: use tensorwise, mxfp8 or blockwise")
        per_stage = self.num_layers // self.pipeline_model_parallel_size
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= per_stage:
                raise ValueError(f"{_named(name, value)} must be between 0 and the layers per pipeline stage "
                                 f"({per_stage})")

    def _check_capacity(self):
        """Token dropping (upstream's checks; a negative factor means none, as upstream)."""
        if self.moe_expert_capacity_factor is not None and self.moe_expert_capacity_factor < 0:
            self.moe_expert_capacity_factor = None
        if self.moe_token_drop_policy not in ("probs", "position"):
            raise ValueError(f"{_named('moe_token_drop_policy', self.moe_token_drop_policy)} must be 'probs' or "
                             "'position'")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity (--moe-pad-expert-input-to-capacity) needs "
                             "moe_expert_capacity_factor (--moe-expert-capacity-factor)")

    def _check_pipeline(self):
        """Pipeline sizes, virtual stages and the uneven first/last stages (their layers must split evenly, as
        upstream's ``get_num_layers_to_build`` requires); see ``transformer_layer.pipeline_layer_counts``."""
        pp, vpp = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
            raise ValueError(f"{_named('pipeline_model_parallel_size', pp)} must be a positive integer")
        if vpp is not None and (isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 1 or pp == 1):
            raise ValueError(f"virtual_pipeline_model_parallel_size={vpp!r} (--num-layers-per-virtual-pipeline-stage"
                             " / --num-virtual-stages-per-pipeline-rank) needs a positive size and "
                             "--pipeline-model-parallel-size > 1")
        for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                     "overlap_p2p_comm"):
            if getattr(self, name):
                raise ValueError(f"{name} ({flag_name(name)}) is not supported by this fork")
        pipeline_layer_counts(self)  # raises naming the flags when the layers do not split
        if self.microbatch_group_size_per_vp_stage is None:
            self.microbatch_group_size_per_vp_stage = pp

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TransformerConfig.{name} must be a positive int ({flag_name(name)}), got {value!r}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"{_named('hidden_size', self.hidden_size)} must be divisible by "
                    f"{_named('num_attention_heads', self.num_attention_heads)} unless kv_channels is given "
                    "(--kv-channels)"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(
                f"{_named('num_attention_heads', self.num_attention_heads)} must be divisible by "
                f"{_named('num_query_groups', self.num_query_groups)}"
            )
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm' (--normalization), got {self.normalization!r}")
        self._refuse_not_built()
        self._check_upstream_parallel_sizes()
        self._fill_upstream_defaults()
        self._resolve_default_impl()
        if self.transformer_impl not in ("local", "transformer_engine"):
            raise ValueError(
                f"transformer_impl must be 'local' or 'transformer_engine' (--transformer-impl), got {self.transformer_impl!r}"
            )
        if self.fp16 and self.bf16:
            raise ValueError("fp16 and bf16 are mutually exclusive (--fp16 / --bf16)")
        if isinstance(self.attention_backend, str) and self.attention_backend in AttnBackend.__members__:
            self.attention_backend = AttnBackend[self.attention_backend]
        if not isinstance(self.attention_backend, AttnBackend):
            raise ValueError(f"TransformerConfig.attention_backend (--attention-backend) must be an AttnBackend or one "
                             f"of {', '.join(AttnBackend.__members__)}; got {self.attention_backend!r}")
        if self.pipeline_dtype is not None and not isinstance(self.pipeline_dtype, torch.dtype):
            raise ValueError(f"pipeline_dtype must be a torch.dtype or None, got {self.pipeline_dtype!r}")
        if self.fp8 is False:  # upstream treats any falsy fp8 as off (its tests pass fp8=False)
            self.fp8 = None
        if self.fp8 not in (None, "e4m3", "hybrid"):
            raise ValueError(f"fp8 must be None, 'e4m3' or 'hybrid' (--fp8-format), got {self.fp8!r}")
        if self.fp8_recipe not in ("delayed", "tensorwise", "mxfp8", "blockwise"):
            raise ValueError(
                f"fp8_recipe must be 'delayed', 'tensorwise', 'mxfp8' or 'blockwise' (--fp8-recipe), got {self.fp8_recipe!r}"
            )
        if self.fp4 not in (None, "nvfp4", "e2m1"):
            raise ValueError(f"fp4 must be None or 'nvfp4' (--fp4-format), got {self.fp4!r}")
        if self.fp8 is not None and self.fp4 is not None:
            raise ValueError("fp8 and fp4 are mutually exclusive (--fp8-format / --fp4-format)")
        if self.first_last_layers_bf16:
            self._check_first_last_bf16()
        if self.fp8_param and self.fp8 is None:
            raise ValueError("fp8_param (--fp8-param-gather) needs fp8 (--fp8-format e4m3 or hybrid)")
        if self.fp4_param and self.fp4 is None:
            raise ValueError("fp4_param (--fp4-param-gather) needs fp4 (--fp4-format e2m1)")
        if (self.fp8 is not None or self.fp4 is not None) and self.transformer_impl != "transformer_engine":
            raise ValueError("fp8/fp4 training (--fp8-format / --fp4-format) needs --transformer-impl transformer_engine")
        self._check_tensor_parallel()
        if self.expert_model_parallel_size < 1 or (
            self.expert_model_parallel_size > 1
            and (self.num_moe_experts is None or self.num_moe_experts % self.expert_model_parallel_size)
        ):
            raise ValueError(f"expert_model_parallel_size={self.expert_model_parallel_size} "
                             "(--expert-model-parallel-size) must be >= 1 and divide num_moe_experts "
                             f"({self.num_moe_experts}, --num-experts)")
        if self.moe_token_dispatcher_type not in ("allgather", "alltoall"):
            raise ValueError("moe_token_dispatcher_type (--moe-token-dispatcher-type) must be 'allgather' or "
                             f"'alltoall', got {self.moe_token_dispatcher_type!r}")
        if isinstance(self.context_parallel_size, bool) or not isinstance(self.context_parallel_size, int) \
                or self.context_parallel_size < 1:
            raise ValueError(f"context_parallel_size={self.context_parallel_size!r} (--context-parallel-size) must be "
                             "a positive integer")
        if self.context_parallel_size > 1:
            from megatron.core.transformer.context_parallel import check_context_parallel_config

            check_context_parallel_config(self)
        self._check_pipeline()
        self._apply_moe_layer_recompute()
        self._check_recompute()
        self._check_gpt_oss()
        if self.mtp_num_layers is not None and (isinstance(self.mtp_num_layers, bool) or self.mtp_num_layers < 1):
            raise ValueError(f"{_named('mtp_num_layers', self.mtp_num_layers)} must be a positive integer or None")
        if self.fp8_dot_product_attention:
            raise ValueError("fp8 attention (--fp8-dot-product-attention) is not supported")
        self._apply_topk_limited_devices()
        if self.num_moe_experts is not None:
            experts = _named("num_moe_experts", self.num_moe_experts, "--num-experts")
            if self.num_moe_experts <= 0:
                raise ValueError(f"{experts} must be positive")
            if not 1 <= self.moe_router_topk <= self.num_moe_experts:
                raise ValueError(f"{_named('moe_router_topk', self.moe_router_topk)} must be in [1, {experts}]")
            if self.moe_ffn_hidden_size is None:
                self.moe_ffn_hidden_size = self.ffn_hidden_size
            if isinstance(self.moe_layer_freq, int):
                if self.moe_layer_freq < 1:
                    raise ValueError(f"moe_layer_freq must be >= 1 (--moe-layer-freq), got {self.moe_layer_freq}")
            elif len(self.moe_layer_freq) != self.num_layers or set(self.moe_layer_freq) - {0, 1}:
                raise ValueError(
                    f"moe_layer_freq as a list needs num_layers={self.num_layers} entries of 0/1 (--moe-layer-freq), "
                    f"got {self.moe_layer_freq}"
                )
            self._check_capacity()
            shared = self.moe_shared_expert_intermediate_size
            if shared is not None:
                if shared <= 0:
                    raise ValueError(f"{_named('moe_shared_expert_intermediate_size', shared)} must be positive "
                                     "(num_shared_experts x each shared expert's hidden size)")
                if self.add_bias_linear:
                    raise ValueError(f"shared experts ({_named('moe_shared_expert_intermediate_size', shared)}) have "
                                     "no biases: give --disable-bias-linear (add_bias_linear=False), as upstream")
                if self.moe_shared_expert_overlap and self.moe_token_dispatcher_type != "alltoall":
                    raise ValueError(f"{_named('moe_shared_expert_overlap', True)} needs moe_token_dispatcher_type "
                                     "'alltoall' (--moe-token-dispatcher-type alltoall), as upstream")
            if self.moe_router_num_groups or self.moe_router_group_topk:
                g, k = self.moe_router_num_groups, self.moe_router_group_topk
                if not (g and k and self.num_moe_experts % g == 0 and 1 <= k <= g and self.moe_router_topk % k == 0):
                    raise ValueError(
                        f"group-limited routing needs moe_router_num_groups (--moe-router-num-groups, {g}) dividing "
                        f"num_moe_experts ({self.num_moe_experts}) and moe_router_group_topk (--moe-router-group-topk, "
                        f"{k}) in [1, groups] dividing moe_router_topk ({self.moe_router_topk})")
            if self.moe_z_loss_coeff is not None and self.moe_z_loss_coeff < 0:
                raise ValueError(f"{_named('moe_z_loss_coeff', self.moe_z_loss_coeff)} must be >= 0")
        elif self.moe_router_enable_expert_bias:
            raise ValueError(f"{_named('moe_router_enable_expert_bias', True)} needs num_moe_experts (--num-experts): "
                             "it is a MoE router option")
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(
                "moe_router_score_function must be 'softmax' or 'sigmoid' (--moe-router-score-function), "
                f"got {self.moe_router_score_function!r}"
            )
        if self.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss", "none"):
            raise ValueError(
                "moe_router_load_balancing_type must be 'aux_loss', 'seq_aux_loss' or 'none' "
                "(--moe-router-load-balancing-type), "
                f"got {self.moe_router_load_balancing_type!r}"
            )
        if self.moe_router_bias_update_rate < 0:
            raise ValueError("moe_router_bias_update_rate (--moe-router-bias-update-rate) must be >= 0")
        from megatron.core.transformer.cuda_graph_config import check_cuda_graph_config

        check_cuda_graph_config(self)

    def _check_gpt_oss(self) -> None:
        """Sliding window, softmax type and the clamped GLU fields (upstream's values), named by their flags."""
        w = self.window_size
        if w is not None:
            if isinstance(w, list):
                w = self.window_size = tuple(w)
            if (not isinstance(w, tuple) or len(w) != 2 or not all(isinstance(x, int) and x >= -1 for x in w)
                    or w == (-1, -1)):
                raise ValueError(f"{_named('window_size', w)} must be a pair (left, right) of ints >= -1 (-1: "
                                 "unbounded), not both -1, e.g. --window-size \"(128,0)\"")
        f = self.window_attn_skip_freq
        if f is not None:
            if w is None:
                raise ValueError(f"{_named('window_attn_skip_freq', f)} needs window_size (--window-size)")
            if isinstance(f, bool) or not (isinstance(f, int) and f >= 1 or isinstance(f, (list, tuple)) and len(f) ==
                                            self.num_layers and set(f) <= {0, 1}):
                raise ValueError(f"{_named('window_attn_skip_freq', f)} must be an int >= 1 or a list of "
                                 f"num_layers={self.num_layers} entries 0/1 (1: sliding window)")
        if self.softmax_type not in ("vanilla", "off-by-one", "learnable"):
            raise ValueError(f"{_named('softmax_type', self.softmax_type)} must be 'vanilla', 'off-by-one' or "
                             "'learnable'")
        if self.attention_backend == AttnBackend.flash and (w is not None or self.softmax_type != "vanilla"):
            raise ValueError("sliding windows / attention sinks (--window-size / --softmax-type) run core attention "
                             "with a mask, which --attention-backend flash has no kernel for: use fused, unfused or "
                             "auto")
        c = self.activation_func_clamp_value
        if c is not None and not c > 0:
            raise ValueError(f"{_named('activation_func_clamp_value', c)} must be positive")
        if (c is not None or self.glu_linear_offset != 0.0) and not self.gated_linear_unit:
            raise ValueError("glu_linear_offset / activation_func_clamp_value (--glu-linear-offset / "
                             "--activation-func-clamp-value) act on a gated linear unit: give --swiglu or "
                             "--quick-geglu (gated_linear_unit=True)")

    def _resolve_default_impl(self) -> None:
        """``transformer_impl`` left at upstream's default 'transformer_engine' on a machine without Transformer
        Engine and without fp8/fp4 becomes 'local' (the ``--transformer-impl`` flag's rule, so CPU models build
        without TE); a value given explicitly is kept. GPTModel's layer spec, when given, decides in the end."""
        if type(self.transformer_impl) is _DefaultImpl:
            self.transformer_impl = str(self.transformer_impl)
            if self.fp8 is None and self.fp4 is None:
                from megatron.core.extensions.transformer_engine import HAVE_TE

                if not HAVE_TE:
                    self.transformer_impl = "local"

    def _check_recompute(self) -> None:
        """Upstream's rules for the recompute fields; module names this fork has no module for are refused by name."""
        g = self.recompute_granularity
        if g not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity (--recompute-granularity) must be 'full' or 'selective', got {g!r}")
        if self.recompute_method not in (None, "uniform", "block"):
            raise ValueError("recompute_method (--recompute-method) must be 'uniform' or 'block', got "
                             f"{self.recompute_method!r}")
        if self.distribute_saved_activations:
            raise ValueError("distribute_saved_activations (--distribute-saved-activations) is not supported")
        if g == "full":
            if self.recompute_method is None:
                raise ValueError("--recompute-granularity full needs --recompute-method uniform|block")
            n = self.recompute_num_layers
            if not isinstance(n, int) or not 1 <= n <= self.num_layers:
                raise ValueError(f"{_named('recompute_num_layers', n)} must be in [1, num_layers={self.num_layers}] "
                                 "with --recompute-granularity full")
        elif self.recompute_method is not None or self.recompute_num_layers is not None:
            raise ValueError("--recompute-method / --recompute-num-layers need --recompute-granularity full "
                             f"(got recompute_granularity={g!r})")
        if g != "selective":
            if self.recompute_modules:
                raise ValueError(f"{_named('recompute_modules', self.recompute_modules)} needs "
                                 "--recompute-granularity selective")
            return
        if self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]
        absent = [m for m in self.recompute_modules if m in UPSTREAM_ONLY_RECOMPUTE_MODULES]
        if absent:
            raise ValueError(f"--recompute-modules {' '.join(absent)}: this fork has no such module "
                             f"({', '.join(UPSTREAM_ONLY_RECOMPUTE_MODULES[m] for m in absent)}); available: "
                             f"{' '.join(RECOMPUTE_MODULES)}")
        unknown = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        if unknown:
            raise ValueError(f"--recompute-modules: unknown module(s) {unknown}; available: {' '.join(RECOMPUTE_MODULES)}")

    def _check_tensor_parallel(self) -> None:
        """Tensor parallel size: heads, query groups and FFN width split evenly; sequence parallelism needs it."""
        tp = self.tensor_model_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"{_named('tensor_model_parallel_size', tp)} must be a positive int")
        if self.sequence_parallel and tp == 1:
            raise ValueError(f"{_named('sequence_parallel', True)} needs "
                             f"{_named('tensor_model_parallel_size', tp)} > 1")
        if tp == 1:
            return
        for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
            value = getattr(self, name)
            if value % tp != 0:
                raise ValueError(f"{_named(name, value)} must be divisible by {_named('tensor_model_parallel_size', tp)}"
                                 ": each tensor-parallel rank holds an equal share")
        if self.num_moe_experts is not None:
            # experts are split over the expert tensor-parallel group (the TP group by default) by their own linears;
            # with sequence parallelism MoELayer gathers the sequence over TP first (every TP rank routes all tokens)
            moe_ffn = self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_hidden_size
            for name, value in (("moe_ffn_hidden_size", moe_ffn),
                                ("moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size)):
                if value is not None and value % tp != 0:
                    raise ValueError(f"{_named(name, value)} must be divisible by "
                                     f"{_named('tensor_model_parallel_size', tp)}")


@dataclass
class MLATransformerConfig(TransformerConfig):
    """Upstream's config for multi-latent attention (DeepSeek-style MLA): ``TransformerConfig`` plus the MLA fields
    and defaults (``--multi-latent-attention``, ``--q-lora-rank``, ``--kv-lora-rank``, ``--qk-head-dim``,
    ``--qk-pos-emb-head-dim``, ``--v-head-dim``, ``--rope-type``, YaRN: ``--rotary-scaling-factor``, ``--mscale``,
    ``--mscale-all-dim``, and ``original_max_position_embeddings`` / ``beta_fast`` / ``beta_slow``, which upstream
    gives no flag). GPTModel builds ``transformer.multi_latent_attention.MLASelfAttention`` layers from it."""

    multi_latent_attention: bool = True
    q_lora_rank: Optional[int] = 512
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    normalization: str = "RMSNorm"
    rope_type: str = "yarn"
    rotary_scaling_factor: float = 40
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32
    beta_slow: float = 1
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    cache_mla_latents: bool = False
    mla_down_proj_fusion: bool = False

    def __post_init__(self):
        if self.kv_channels is None and self.num_attention_heads:  # unused by MLA; upstream's default, unchecked
            self.kv_channels = self.hidden_size // self.num_attention_heads
        super().__post_init__()
        if not self.multi_latent_attention:
            return
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{_named(name, value)} must be a positive int (multi-latent attention)")
        q = self.q_lora_rank
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q <= 0):
            raise ValueError(f"{_named('q_lora_rank', q)} must be a positive int or None (no q-LoRA)")
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"{_named('qk_pos_emb_head_dim', self.qk_pos_emb_head_dim)} must be even (rotary pairs)")
        if self.rope_type not in ("rope", "yarn"):
            raise ValueError(f"{_named('rope_type', self.rope_type)} must be 'rope' or 'yarn'")
        tp = self.tensor_model_parallel_size
        for name, value in (("q_lora_rank", q), ("kv_lora_rank + qk_pos_emb_head_dim",
                                                 self.kv_lora_rank + self.qk_pos_emb_head_dim)):
            if value is not None and value % tp:  # the down projections' outputs are split over TP ranks
                raise ValueError(f"{name} ({value}) must be divisible by "
                                 f"{_named('tensor_model_parallel_size', tp)} (multi-latent attention)")
        for name in ("cache_mla_latents", "mla_down_proj_fusion"):
            if getattr(self, name):
                raise ValueError(f"{name} ({flag_name(name)}) is not supported by this fork")
