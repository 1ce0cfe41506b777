"""Command-line arguments with upstream Megatron-LM's flag names and groups, their validation, and the builders
args -> ``TransformerConfig`` / ``OptimizerConfig`` / ``DistributedDataParallelConfig``.

``parse_args(extra_args_provider=None, ignore_unknown_args=False, args=None)`` parses (``args``: a list, default
``sys.argv[1:]``); ``validate_args(args, defaults={})`` derives defaults and exits (``SystemExit`` with a message
naming the flags) on incompatible combinations.
"""
import argparse
import difflib
import math
import os
import warnings

import torch

from megatron.core.dist_utils import get_rank, get_world_size, is_distributed
from megatron.core.transformer.transformer_config import flag_name
from megatron.training.utils import get_rank_safe, print_rank_0

# Rank-0-once guard of the param-gather / checkpoint-load warning (reset by tests).
_PARAM_GATHER_WARNED = False

PARAM_GATHER_LOAD_WARNING = (
    "{flag} is set and a checkpoint is loaded (--load) without --stream-ckpt-dequant: every quantized weight "
    "is dequantized upfront while loading, a transient 2 bytes x params of extra memory. Add --stream-ckpt-dequant "
    "to stream the load through one high-precision scratch at a time."
)


def window_size_type(text: str):
    """``--window-size``: "(left,right)" or "left,right" -> a tuple of ints (upstream's ``tuple_type``)."""
    try:
        return tuple(int(part) for part in str(text).strip().strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f'--window-size {text!r}: expected "(left,right)", e.g. "(128,0)"')


def layer_freq_type(text: str):
    """A per-layer frequency flag (upstream's ``moe_freq_type``): an int N, or a Python list expression of 0/1 per
    layer such as "([1]*3+[0])*2" (only digits, brackets, parentheses, commas, * and + are evaluated)."""
    text = str(text).strip()
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an int or a list expression like \"([1]*3+[0])\"")
    import re

    if not re.fullmatch(r"[0-9\[\]()*+,\s]+", text):
        raise argparse.ArgumentTypeError(f"{text!r}: a list expression may use only digits, [], (), *, + and ,")
    try:
        value = eval(text, {"__builtins__": {}}, {})  # noqa: S307 (the characters are checked above)
    except Exception as e:
        raise argparse.ArgumentTypeError(f"{text!r}: not a list expression ({e})")
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(f"{text!r}: evaluates to {type(value).__name__}, not a list")
    return value


def _add_network_size_args(parser):
    g = parser.add_argument_group(title="network size")
    g.add_argument("--num-layers", type=int, default=None, help="Number of transformer layers.")
    g.add_argument("--hidden-size", type=int, default=None, help="Transformer hidden size.")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP hidden size (default 4 x hidden size).")
    g.add_argument("--num-attention-heads", type=int, default=None, help="Number of attention heads.")
    g.add_argument("--kv-channels", type=int, default=None, help="Projection size per head (default hidden/heads).")
    g.add_argument("--group-query-attention", action="store_true", help="Use grouped-query attention.")
    g.add_argument("--num-query-groups", type=int, default=1, help="Query groups with --group-query-attention.")
    g.add_argument("--max-position-embeddings", type=int, default=None, help="Max sequence length of the model.")
    g.add_argument(
        "--position-embedding-type", type=str, default="learned_absolute",
        choices=["learned_absolute", "rope", "yarn", "none"], help="Position embedding type.",
    )
    g.add_argument("--rotary-base", type=int, default=10000, help="Base of rotary position embeddings.")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="Fraction of each head's channels rotated.")
    g.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion",
                   help="Rotary embeddings by torch ops (default: Transformer Engine's fused kernel where TE and "
                        "CUDA are there, as upstream; torch ops else).")
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"], help="Norm layer.")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of the norm layers.")
    g.add_argument("--swiglu", action="store_true", help="Use gated linear units with SiLU (SwiGLU).")
    g.add_argument("--bias-swiglu-fusion", action="store_true", dest="bias_swiglu_fusion", default=True,
                   help="SwiGLU as one fused function saving only its input (Transformer Engine's swiglu/dswiglu "
                        "on CUDA, fp32 torch ops else). On by default, as upstream.")
    g.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion",
                   help="SwiGLU as the unfused torch ops (chunk, silu, mul).")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="No bias in the linear layers.")
    g.add_argument("--add-qkv-bias", action="store_true", help="Bias in the QKV projection only.")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Separate embedding and output-layer weights.")
    # -- model options (upstream's flags; computed where the thing is: attention, norms) --
    g.add_argument("--qk-layernorm", action="store_true",
                   help="Normalize each head's queries and keys (--normalization, before rotary embedding).")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="Zero-centered norm weights: the norms scale by 1 + weight (weight initialized to 0).")
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="No learned absolute position embedding (with the default --position-embedding-type "
                        "learned_absolute: none; rotary embeddings are unaffected).")
    # -- gpt-oss: sliding windows, attention sinks, clamped GLU (upstream's flags and formats) --
    g.add_argument("--window-size", type=window_size_type, default=None,
                   help='Sliding-window attention "(left,right)": query i attends keys i-left..i+right (-1: '
                        'unbounded; causal: right 0), e.g. "(128,0)". Default: full attention.')
    g.add_argument("--window-attn-skip-freq", type=layer_freq_type, default=None,
                   help='Full-attention layers among the sliding-window ones: N makes every N-th layer full; a '
                        'Python list expression gives each layer (1 window, 0 full), e.g. "([1]+[0])*12".')
    g.add_argument("--softmax-type", type=str, default="vanilla", choices=["vanilla", "off-by-one", "learnable"],
                   help="Attention softmax: off-by-one adds a logit 0 per head to the denominator (attention "
                        "sink), learnable a learned per-head logit (core_attention.softmax_offset).")
    g.add_argument("--quick-geglu", action="store_true",
                   help="Gated linear unit with quick GeLU, x * sigmoid(1.702 x) (gpt-oss).")
    g.add_argument("--glu-linear-offset", type=float, default=0.0,
                   help="Gated linear unit act(x_glu) * (x_linear + offset).")
    g.add_argument("--activation-func-clamp-value", type=float, default=None,
                   help="Gated linear unit: clamp x_glu to <= value and x_linear to [-value, value].")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="Size of the vocabulary without the end-of-document token (NullTokenizer; its eod id is "
                        "this value, its vocabulary one larger).")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the tokenizer's vocabulary with dummy tokens to a multiple of this (the model's "
                        "embedding and output layer get the padded size).")


def _add_mla_args(parser):
    """Multi-latent attention and rotary scaling (upstream's flags and defaults; MLATransformerConfig's fields)."""
    g = parser.add_argument_group(title="mla and rotary scaling")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="Multi-latent attention (DeepSeek-V3 MLA; --qk-layernorm gives its q/kv latent norms).")
    g.add_argument("--q-lora-rank", type=int, default=None, help="Rank of the query latent (default: no q-LoRA).")
    g.add_argument("--kv-lora-rank", type=int, default=32, help="Rank of the key/value latent.")
    g.add_argument("--qk-head-dim", type=int, default=128, help="Per-head query/key size without the RoPE part.")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64, help="Per-head size of the RoPE part of q/k.")
    g.add_argument("--v-head-dim", type=int, default=128, help="Per-head value size.")
    g.add_argument("--rope-type", type=str, default=None, choices=["rope", "yarn"],
                   help="Rotary embedding of multi-latent attention (default yarn; other attention: rope only).")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="YaRN scaling factor (MLA).")
    g.add_argument("--mscale", type=float, default=1.0, help="YaRN mscale (MLA).")
    g.add_argument("--mscale-all-dim", type=float, default=0.0, help="YaRN mscale_all_dim (MLA).")
    g.add_argument("--yarn-original-max-position-embeddings", type=int, default=None,
                   help="YaRN's original context (--position-embedding-type yarn; default 4096).")
    g.add_argument("--yarn-beta-fast", type=float, default=None, help="YaRN beta_fast (default 32).")
    g.add_argument("--yarn-beta-slow", type=float, default=None, help="YaRN beta_slow (default 1).")
    g.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=None,
                   help="Round YaRN's ramp ends to whole dimensions (the default).")
    g.add_argument("--no-yarn-correction-range-round-to-int", action="store_false",
                   dest="yarn_correction_range_round_to_int", help="Keep YaRN's ramp ends fractional.")
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama 3.x rotary frequency scaling.")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="Llama 3.x rope scaling factor.")


def _validate_mla_args(args):
    if args.multi_latent_attention and args.group_query_attention:
        _fail("--group-query-attention is mutually exclusive with --multi-latent-attention")
    if args.rope_type not in (None, "rope") and not args.multi_latent_attention:
        _fail(f"--rope-type {args.rope_type} needs --multi-latent-attention (other attention supports rope only)")
    if args.position_embedding_type == "yarn" and args.multi_latent_attention:
        _fail("--position-embedding-type yarn is for standard attention; with --multi-latent-attention use "
              "--rope-type yarn")
    if args.use_rope_scaling and (args.position_embedding_type != "rope" or args.multi_latent_attention):
        _fail("--use-rope-scaling needs --position-embedding-type rope without --multi-latent-attention")


def moe_freq_type(text):
    """``--moe-layer-freq``: an int, or upstream's list expression (``[0,1,1]``, ``"([0]*3+[1]*5)"``,
    ``"([1]*2+[0])*2"``) read with ``ast`` (int and list literals, ``+``, ``*``, parentheses; nothing is executed)."""
    import ast

    if isinstance(text, int):
        return text
    flag = "--moe-layer-freq"

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [value(e) for e in node.elts]
            if not all(isinstance(i, int) for i in items):
                raise argparse.ArgumentTypeError(f"{flag}: list items must be integers, got {text!r}")
            return items
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and type(left) is type(right):
                return left + right
            if isinstance(node.op, ast.Mult) and (isinstance(left, int) or isinstance(right, int)):
                times = min(x for x in (left, right) if isinstance(x, int))
                size = len(left if isinstance(left, list) else right) if isinstance(left, list) or isinstance(
                    right, list) else 1
                if 0 <= times and size * times <= 1 << 20:  # a layer list, not a memory bomb
                    return left * right
        raise argparse.ArgumentTypeError(f"{flag}: {text!r} is not an int or a list expression of int literals "
                                         f"with + and * (e.g. \"([0]*3+[1]*5)\")")

    try:
        tree = ast.parse(str(text).strip(), mode="eval")
    except SyntaxError as e:
        raise argparse.ArgumentTypeError(f"{flag}: cannot parse {text!r}: {e.msg}") from None
    out = value(tree.body)
    if isinstance(out, list) and (not out or set(out) - {0, 1}):
        raise argparse.ArgumentTypeError(f"{flag}: the list must hold one 0 (dense) or 1 (MoE) per layer, got {out}")
    return out


def _add_moe_args(parser):
    g = parser.add_argument_group(title="moe")
    g.add_argument("--num-experts", type=int, default=None, help="Number of experts (MoE when set).")
    g.add_argument("--moe-layer-freq", type=moe_freq_type, default=1,
                   help="MoE layer pattern: an int N (every N-th layer, from the first) or a per-layer 0/1 list "
                        "as upstream writes it, e.g. \"([0]*3+[1]*5)\" (first 3 dense; list literals, + and * "
                        "only, never evaluated as Python).")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="Multi-token prediction depths (DeepSeek-V3's MTP), on the last pipeline stage.")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="The MTP loss: this factor x the mean of the depths' losses (logged as 'mtp_<k> loss').")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="Expert capacity ceil(tokens x topk / experts x factor) per layer and rank; tokens over it "
                        "are dropped (None: dropless).")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="Pad every expert's input to its capacity (needs --moe-expert-capacity-factor).")
    g.add_argument("--moe-token-drop-policy", type=str, default="probs", choices=["probs", "position"],
                   help="Over capacity, keep an expert's highest-prob tokens (probs) or its first ones (position).")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="Expert MLP hidden size.")
    g.add_argument("--moe-router-topk", type=int, default=2, help="Experts per token.")
    g.add_argument("--moe-router-score-function", type=str, default="softmax", choices=["softmax", "sigmoid"],
                   help="Router score function.")
    g.add_argument("--moe-router-pre-softmax", action="store_true", help="Softmax before the top-k.")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None, help="Scale of top-k probs.")
    g.add_argument("--moe-router-load-balancing-type", type=str, default="aux_loss", choices=["aux_loss", "seq_aux_loss", "none"],
                   help="Load balancing loss.")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="Aux loss coefficient.")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="Aux-loss-free load balancing with a per-expert selection bias.")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3, help="Expert-bias update rate.")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="Expert model parallel size: experts are split over this many ranks (must divide "
                        "--num-experts and the world size).")
    g.add_argument("--moe-token-dispatcher-type", type=str, default="allgather", choices=["allgather", "alltoall"],
                   help="How tokens reach the ranks of their experts under expert parallelism.")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None,
                   help="Router z-loss coefficient: coeff x mean(logsumexp(logits)^2) trains the router (logged as "
                        "z_loss, without the coefficient).")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="Shared experts' total hidden size (num shared experts x each one's): a dense MLP every "
                        "token goes through, added to the routed experts' output (needs --disable-bias-linear).")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="Scale the shared experts' output by sigmoid(x . gate_weight) per token.")
    g.add_argument("--moe-shared-expert-overlap", action="store_true",
                   help="Accepted (needs --moe-token-dispatcher-type alltoall, as upstream); the shared experts run "
                        "un-overlapped here, with the same values.")
    g.add_argument("--moe-per-layer-logging", action="store_true",
                   help="Also write each layer's MoE auxiliary losses to TensorBoard (moe/<name>_layer_<i>).")
    g.add_argument("--moe-router-force-load-balancing", action="store_true",
                   help="Benchmark only: route by random normal logits (balanced on average); the router's "
                        "gradient passes straight through them.")
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="Group-limited routing: the experts form this many equal groups (e.g. the EP size).")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="Group-limited routing: each token uses experts of its best this-many groups only.")
    g.add_argument("--moe-router-topk-limited-devices", type=int, default=None,
                   help="Deprecated upstream: --moe-router-num-groups EP size --moe-router-group-topk this value.")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="The experts' tensor-parallel size: --tensor-model-parallel-size (the default) only.")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="All local experts in one grouped GEMM per projection (Transformer Engine's GroupedLinear "
                        "with --transformer-impl transformer_engine, else torch's grouped matmul or a loop); "
                        "checkpoints interchange with the sequential experts.")
    g.add_argument("--moe-permute-fusion", action="store_true",
                   help="Permute tokens to their experts and back with Transformer Engine's fused kernels where TE "
                        "is installed and the model runs on CUDA (torch ops otherwise: the same rows, same order).")
    g.add_argument("--moe-router-fusion", action="store_true",
                   help="The router's score function (softmax / sigmoid), top-k, expert bias and scaling in one "
                        "Transformer Engine kernel (fused_topk_with_score_function) where TE is installed and the "
                        "model runs on CUDA; the torch ops otherwise and for the cases TE computes differently "
                        "(softmax with --moe-router-enable-expert-bias; softmax group-limited routing without "
                        "--moe-router-pre-softmax). The same routing either way.")


# Upstream flags that select a kernel for the same math, which this fork does not have: accepted, and what they do
# here said (flag, argparse kwargs, what it does here)
KERNEL_FLAGS = (
    ("--no-masked-softmax-fusion", dict(action="store_false", dest="masked_softmax_fusion"),
     "this fork has no fused scale-mask-softmax kernel (attention is torch's SDPA)"),
    ("--no-bias-gelu-fusion", dict(action="store_false", dest="bias_gelu_fusion"),
     "this fork has no fused bias-GeLU kernel"),
    ("--no-bias-dropout-fusion", dict(action="store_false", dest="bias_dropout_fusion"),
     "this fork has no fused bias-dropout-add kernel"),
    ("--cross-entropy-loss-fusion", dict(action="store_true"),
     "the loss is torch's cross entropy (vocab-parallel under TP) either way"),
    ("--cross-entropy-fusion-impl", dict(type=str, default="native", choices=["native", "te"]),
     "with --cross-entropy-loss-fusion (no fused kernel here)"),
    ("--no-gradient-accumulation-fusion", dict(action="store_false", dest="gradient_accumulation_fusion"),
     "weight gradients are accumulated by autograd here (no fused wgrad kernel)"),
    ("--use-mcore-models", dict(action="store_true"),
     "deprecated upstream (megatron-core models are the only ones)"),
    ("--attention-softmax-in-fp32", dict(action="store_true"), "SDPA's kernels accumulate the softmax in fp32"),
)

# Upstream flags of its launch scripts that need what this fork lacks: parsed (so the run stops with the reason
# instead of "unrecognized argument") and refused in validate_args when given. (flags, argparse kwargs, reason)
REFUSED_FLAGS = (
    (("--moe-flex-dispatcher-backend",), dict(type=str, default=None),
     "the flex token dispatcher (DeepEP / HybridEP) is not implemented: use alltoall or allgather"),
    (("--fsdp-double-buffer", "--fsdp-manual-registration", "--use-nccl-ub",
      "--fsdp-db-use-persist-buf-on-alloc-fail"), dict(action="store_true"),
     "Megatron-FSDP's NCCL buffer options: this fork's Megatron-FSDP runs on FSDP2, which has no such buffers"),
    (("--megatron-fsdp-main-params-dtype", "--megatron-fsdp-main-grads-dtype", "--megatron-fsdp-grad-comm-dtype"),
     dict(type=str, default=None), "Megatron-FSDP's buffer dtypes: this fork's Megatron-FSDP runs on FSDP2 (fp32 "
     "main params; gradients reduced in fp32, --grad-reduce-in-bf16 for bf16)"),
    (("--step-batch-size-schedule",), dict(type=str, default=None),
     "batch-size schedules are not supported (as --rampup-batch-size): the global batch size is fixed"),
    (("--hierarchical-context-parallel-sizes",), dict(type=int, nargs="+", default=None),
     "hierarchical context parallelism (the a2a+p2p groups) is not implemented: use --context-parallel-size with "
     "--cp-comm-type p2p or allgather"),
)
# Given with these values they select what the fork does anyway; other values are refused (flag, kwargs, accepted
# value, reason)
ACCEPTED_VALUE_FLAGS = (
    ("--moe-router-dtype", dict(type=str, default=None, choices=["fp32", "fp64"]), "fp32",
     "the router computes its logits, scores and top-k in float32 (what fp32 asks for); fp64 is not implemented"),
)


def _add_refused_args(parser):
    g = parser.add_argument_group(title="upstream flags refused with a reason (see REFUSED_FLAGS)")
    for flags, kwargs, reason in REFUSED_FLAGS:
        for flag in flags:
            g.add_argument(flag, help=f"Refused: {reason}.", **kwargs)
    for flag, kwargs, value, reason in ACCEPTED_VALUE_FLAGS:
        g.add_argument(flag, help=f"{value} (what this fork does); other values are refused: {reason}.", **kwargs)


def _map_precision_aware_dtypes(args):
    """``--main-grads-dtype`` ... as torch dtypes (upstream's mapping: fp8 is ``torch.uint8``)."""
    from megatron.core.optimizer.precision_aware import as_state_dtype

    for dest in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        setattr(args, dest, as_state_dtype(getattr(args, dest), flag_name(dest)))


def _validate_refused_args(args):
    for flags, _, reason in REFUSED_FLAGS:
        for flag in flags:
            value = getattr(args, flag[2:].replace("-", "_"))
            if value not in (None, False):
                _fail(f"{flag} is not supported: {reason}; remove the flag")
    for flag, kwargs, value, reason in ACCEPTED_VALUE_FLAGS:
        given = getattr(args, flag[2:].replace("-", "_"))
        if given not in (None, kwargs.get("default"), value):
            _fail(f"{flag} {given} is not supported: {reason}; use {value} or remove the flag")


def _cuda_graph_module_arg(value):
    from megatron.core.transformer.cuda_graph_config import parse_cuda_graph_module

    try:
        return parse_cuda_graph_module(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_cuda_graph_args(parser):
    """Per-layer CUDA graphs, upstream 0.19's flags (``megatron/core/transformer/cuda_graphs.py``)."""
    from megatron.core.transformer.cuda_graph_config import CUDA_GRAPH_IMPLS

    g = parser.add_argument_group(title="CUDA graphs")
    g.add_argument("--cuda-graph-impl", type=str, default="none", choices=list(CUDA_GRAPH_IMPLS),
                   help="none; local (torch's make_graphed_callables) or transformer_engine (TE's, FP8-aware): "
                        "per-layer graphs captured after --cuda-graph-warmup-steps eager steps and replayed. "
                        "full_iteration is refused (not built).")
    g.add_argument("--cuda-graph-modules", nargs="+", type=_cuda_graph_module_arg, default=[],
                   help="The parts of each layer graphed: attn, mlp (dense layers), moe_router (an MoE layer's norm "
                        "and router); none given: the whole layer (dense models). Upstream's moe, moe_preprocess "
                        "and mamba are refused; full (deprecated) means the whole layer.")
    g.add_argument("--cuda-graph-scope", nargs="+", type=_cuda_graph_module_arg, default=None,
                   dest="cuda_graph_scope_deprecated",
                   help="Deprecated upstream: the same as --cuda-graph-modules.")
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=3,
                   help="Eager training steps before the graphs are captured (upstream's default 3).")
    g.add_argument("--enable-cuda-graph", action="store_true",
                   help="Deprecated upstream: --cuda-graph-impl local.")
    g.add_argument("--external-cuda-graph", action="store_true",
                   help="Deprecated upstream: --cuda-graph-impl transformer_engine.")


def _validate_cuda_graph_args(args):
    """Upstream's deprecations (--enable-cuda-graph, --external-cuda-graph, --cuda-graph-scope), then what the
    training loop does not compose with graphs yet; TransformerConfig checks the rest (``check_cuda_graph_config``)."""
    if args.enable_cuda_graph or args.external_cuda_graph:
        if args.cuda_graph_impl != "none":
            _fail("do not use --enable-cuda-graph or --external-cuda-graph with --cuda-graph-impl")
        if args.enable_cuda_graph and args.external_cuda_graph:
            _fail("--enable-cuda-graph and --external-cuda-graph cannot be enabled at the same time")
        new = "local" if args.enable_cuda_graph else "transformer_engine"
        print_rank_0(f"--{'enable' if args.enable_cuda_graph else 'external'}-cuda-graph is deprecated, use "
                     f"--cuda-graph-impl={new} instead.")
        args.cuda_graph_impl = new
    args.enable_cuda_graph = args.external_cuda_graph = False
    scope = getattr(args, "cuda_graph_scope_deprecated", None)
    if scope is not None:
        if args.cuda_graph_modules:
            _fail("--cuda-graph-scope and --cuda-graph-modules cannot be used together")
        print_rank_0("--cuda-graph-scope is deprecated, use --cuda-graph-modules instead.")
        args.cuda_graph_modules = scope
    if hasattr(args, "cuda_graph_scope_deprecated"):
        del args.cuda_graph_scope_deprecated
    from megatron.core.transformer.cuda_graph_config import normalize_cuda_graph_modules

    try:
        modules, deprecated = normalize_cuda_graph_modules(args.cuda_graph_modules)
    except ValueError as e:
        _fail(str(e))
    if deprecated == "full_iteration":
        if args.cuda_graph_impl not in ("none", "local", "full_iteration"):
            _fail(f"--cuda-graph-modules full_iteration cannot be combined with --cuda-graph-impl "
                  f"{args.cuda_graph_impl}")
        args.cuda_graph_impl = "full_iteration"
    elif deprecated:
        _fail(f"--cuda-graph-modules {deprecated} (inference CUDA graphs) is not supported: this fork graphs "
              "training only")
    args.cuda_graph_modules = modules
    if args.cuda_graph_impl == "none":
        return
    for flag, on, why in (
            ("--use-megatron-fsdp", args.use_megatron_fsdp, "FSDP2 gathers each layer's weights into new memory "
             "at every forward, which a graph (fixed addresses) cannot follow"),
            ("--overlap-param-gather", args.overlap_param_gather, "its per-module forward pre-hooks (waiting for "
             "the gathered weights) do not run inside a graph replay")):
        if on:
            _fail(f"{flag} with --cuda-graph-impl {args.cuda_graph_impl} is not supported: {why}")


def _add_recompute_args(parser):
    """Activation recompute, upstream's flags (TransformerConfig checks the combinations)."""
    from megatron.core.transformer.transformer_config import RECOMPUTE_MODULES

    g = parser.add_argument_group(title="activation recompute")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Selective recompute (the same as --recompute-granularity selective).")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="full: recompute whole transformer layers in backward (--recompute-method, "
                        "--recompute-num-layers); selective: the modules of --recompute-modules.")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                   help="full: uniform keeps the input of every chunk of --recompute-num-layers layers; block "
                        "recomputes each of the first --recompute-num-layers layers.")
    g.add_argument("--recompute-num-layers", type=int, default=None, help="Layers per chunk (uniform) or "
                   "recomputed layers (block).")
    g.add_argument("--recompute-modules", nargs="*", default=None,
                   help=f"Selective recompute: modules to recompute, of {' '.join(RECOMPUTE_MODULES)} (default "
                        "core_attn).")
    g.add_argument("--distribute-saved-activations", action="store_true",
                   help="Accepted for upstream compatibility; refused (not supported).")


def _add_regularization_args(parser):
    g = parser.add_argument_group(title="regularization")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="Attention dropout.")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="Hidden dropout.")
    g.add_argument("--weight-decay", type=float, default=0.01, help="Weight decay (start and end).")
    g.add_argument("--start-weight-decay", type=float, default=None, help="Initial weight decay.")
    g.add_argument("--end-weight-decay", type=float, default=None, help="Final weight decay.")
    g.add_argument("--weight-decay-incr-style", type=str, default="constant",
                   choices=["constant", "linear", "cosine"], help="Weight decay schedule.")
    g.add_argument("--clip-grad", type=float, default=1.0, help="Gradient clipping by global norm (0: off).")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum.")


def _add_training_args(parser):
    g = parser.add_argument_group(title="training")
    g.add_argument("--micro-batch-size", type=int, default=None, help="Samples per micro-batch per DP rank.")
    g.add_argument("--rampup-batch-size", nargs="*", default=None,
                   help="Not supported yet (batch-size ramp-up): refused; use a fixed --global-batch-size.")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Samples per iteration (default micro-batch x DP); gradients accumulate over "
                        "global / (micro x DP) micro-batches.")
    g.add_argument("--train-iters", type=int, default=None,
                   help="Iterations to train in total (or give --train-samples).")
    g.add_argument("--train-samples", type=int, default=None,
                   help="Samples to train in total: --train-samples / --global-batch-size iterations (instead of "
                        "--train-iters); the learning-rate schedule is then counted in samples.")
    g.add_argument("--log-interval", type=int, default=100, help="Iterations between log lines.")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="The loss of an iteration is the sum over all its unmasked tokens divided by their count "
                        "(over micro-batches and data-parallel ranks), not the mean of per-micro-batch means.")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false", dest="check_for_nan_in_loss_and_grad",
                   help="Do not stop when the lm loss is not finite (default: stop with an error after that "
                        "iteration, whose update is skipped: its gradient norm is not finite either); the log then "
                        "counts such iterations.")
    g.add_argument("--exit-interval", type=int, default=None, help="Exit after an iteration divisible by this.")
    # -- run control and housekeeping (upstream's flags; megatron/training/run_control.py) --
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true", default=True,
                   dest="check_for_nan_in_loss_and_grad", help="Stop when the lm loss is not finite (the default).")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On SIGTERM (what a scheduler sends before a preemption): finish the iteration, save a "
                        "checkpoint (with --save) and exit with code 0, on every rank together.")
    g.add_argument("--exit-duration-in-mins", type=int, default=None,
                   help="Exit (saving a checkpoint with --save) after the first iteration that ends more than this "
                        "many minutes after the start.")
    g.add_argument("--manual-gc", action="store_true",
                   help="Disable Python's automatic garbage collection; collect every --manual-gc-interval "
                        "iterations (and before each evaluation with --manual-gc-eval) on every rank together.")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="With --manual-gc: iterations between collections (0: only at the start).")
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="With --manual-gc: do not collect before and after each evaluation.")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="Release the CUDA caching allocator's unused blocks: 1 after each optimizer step, 2 also "
                        "after each evaluation (nothing to release on CPU).")
    g.add_argument("--optimizer", type=str, default="adam", choices=["adam", "sgd"], help="Optimizer.")
    g.add_argument("--seed", type=int, default=1234, help="Random seed (python, numpy, torch).")
    g.add_argument("--init-method-std", type=float, default=0.02, help="Std of the normal weight init.")
    g.add_argument("--attention-backend", type=str, default="auto",
                   choices=["auto", "flash", "fused", "unfused", "local"],
                   help="The kernel of torch's scaled_dot_product_attention that computes core attention: auto "
                        "(torch picks), flash, fused (memory-efficient; both CUDA), unfused/local (math, with "
                        "--transformer-impl local). The same math.")
    # -- kernel selection (upstream's flags): each picks a kernel for the same math (see docs/training.md) --
    g.add_argument("--use-flash-attn", action="store_true", help="The same as --attention-backend flash.")
    for flag, kwargs, what in KERNEL_FLAGS:
        g.add_argument(flag, help=f"Accepted: {what}.", **kwargs)
    g.add_argument("--disable-bf16-reduced-precision-matmul", action="store_true",
                   help="Forbid reduced-precision reductions in bf16 matmuls (torch.backends.cuda.matmul."
                        "allow_bf16_reduced_precision_reduction = False).")
    g.add_argument("--transformer-impl", default=None, choices=["local", "transformer_engine"],
                   help="Layer implementation (default: transformer_engine if installed, else local).")
    g.add_argument("--use-cpu-initialization", action="store_true", default=None, help="Initialize on CPU.")


def _add_learning_rate_args(parser):
    g = parser.add_argument_group(title="learning rate")
    g.add_argument("--lr", type=float, default=None, help="Peak learning rate.")
    g.add_argument("--lr-decay-style", type=str, default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root"], help="LR decay.")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="Iterations to decay over (default train-iters).")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="Samples to decay over with --train-samples (default --train-samples).")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="Warmup over this fraction of the decay iterations / samples (instead of "
                        "--lr-warmup-iters / --lr-warmup-samples).")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="Linear warmup iterations.")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="Linear warmup samples (with --train-samples).")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="LR at the start of the warmup.")
    g.add_argument("--min-lr", type=float, default=0.0, help="Minimum learning rate.")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="Peak learning rate of the input embedding and output layer (their own schedule with the "
                        "same warmup and decay).")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="Minimum learning rate of the input embedding and output layer (default --min-lr).")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="Use the arguments' scheduler values, not the checkpoint's.")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="Use the checkpoint's scheduler values.")


def _add_checkpointing_args(parser):
    g = parser.add_argument_group(title="checkpointing")
    g.add_argument("--save", type=str, default=None, help="Directory to save checkpoints to.")
    g.add_argument("--save-interval", type=int, default=None, help="Iterations between checkpoint saves.")
    g.add_argument("--no-save-optim", action="store_true", default=None, help="Do not save the optimizer.")
    g.add_argument("--no-save-rng", action="store_true", default=None, help="Do not save RNG states.")
    g.add_argument("--load", type=str, default=None, help="Directory to load a checkpoint from.")
    g.add_argument("--no-load-optim", action="store_true", default=None, help="Do not load the optimizer.")
    g.add_argument("--no-load-rng", action="store_true", default=None, help="Do not load RNG states.")
    g.add_argument("--finetune", action="store_true",
                   help="Load the model only (no optimizer, RNG, iteration); start at iteration 0.")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="Exit with an error when --load has no checkpoint (default: start from scratch).")
    g.add_argument("--ckpt-step", type=int, default=None, help="Iteration to load instead of the latest.")
    g.add_argument("--ckpt-format", default="torch_dist",
                   choices=["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"],
                   help="Checkpoint format (this fork: torch_dist only).")
    g.add_argument("--ckpt-fully-parallel-save", action="store_true", default=True,
                   help="Spread the writing of replicated tensors over the data-parallel ranks (the default).")
    g.add_argument("--no-ckpt-fully-parallel-save", action="store_false", dest="ckpt_fully_parallel_save",
                   default=True, help="Every rank writes its replicated tensors' first copy (no spreading).")
    # -- asynchronous save (upstream's flags) --
    g.add_argument("--async-save", action="store_true", default=None,
                   help="Write torch_dist checkpoints in the background (PyTorch DCP async_save from a CPU copy "
                        "taken when the save is scheduled); the tracker advances when every rank finished.")
    g.add_argument("--async-strategy", default="nvrx", choices=["nvrx", "mcore"],
                   help="Async save backend; this fork always uses its built-in one (mcore), said once in the log.")
    g.add_argument("--use-persistent-ckpt-worker", action="store_true",
                   help="With --async-save: one long-lived background worker instead of one per save.")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true",
                   help="Spread the reading of replicated tensors over the data-parallel ranks.")
    g.add_argument("--stream-ckpt-dequant", action="store_true",
                   help="Load quantized (FP8/FP4 param-gather) weights through one high-precision scratch at a "
                        "time instead of dequantizing every weight upfront.")
    g.add_argument("--stream-ckpt-dequant-chunk-mb", type=float, default=64.0,
                   help="With --stream-ckpt-dequant: the most high-precision scratch (MiB) a quantized weight gets at "
                        "once; larger weights are quantized chunk by chunk (exact for every recipe but NVFP4). "
                        "0: one scratch of the whole weight.")
    g.add_argument("--dist-ckpt-strictness", type=str, default="assume_ok_unexpected",
                   choices=["assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                            "return_unexpected", "return_all", "ignore_all"],
                   help="Handling of key mismatches on a dist checkpoint load.")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="Distributed optimizer: save its state in upstream's fully_reshardable layout (whole fp32 "
                        "states per parameter; loads at any TP/PP/DP). This fork writes that layout in any case "
                        "(upstream's default without the flag, dp_reshardable, is loaded); a load follows the "
                        "checkpoint's own layout whatever this flag says.")
    g.add_argument("--check-weights-finite", action="store_true",
                   help="Right after a checkpoint load, stop with an error naming the first model tensor that "
                        "holds NaN or Inf.")
    # -- checkpoint safety (this fork's flags: upstream 0.19 has none for these) --
    g.add_argument("--ckpt-verify", default="auto", choices=["auto", "require", "off"],
                   help="Item checksums on load: auto (default) verifies those present, loads checkpoints without "
                        "them (upstream's) unverified, said once; require refuses a checkpoint or item without a "
                        "checksum this installation can verify; off verifies nothing.")
    g.add_argument("--ckpt-overwrite", action="store_true", help="Let saves replace complete checkpoints in --save "
                   "and move its tracker back (default: such a run is refused before training).")
    g.add_argument("--ckpt-fresh-start", action="store_true", help="Train from random initialization although --load "
                   "holds iter_N checkpoints but no tracker (default: refused; --ckpt-step N resumes from one).")
    # -- run control on clusters (upstream's flags) --
    g.add_argument("--save-retain-interval", type=int, default=None,
                   help="Keep only the checkpoints whose iteration is a multiple of this (and the latest): a save "
                        "deletes the previous checkpoint unless its iteration is such a multiple. A multiple of "
                        "--save-interval.")
    g.add_argument("--non-persistent-save-interval", type=int, default=None,
                   help="Iterations between non-persistent saves (--non-persistent-ckpt-type global: into "
                        "--non-persistent-global-ckpt-dir, default <save>/non_persistent, only the latest kept); a "
                        "load takes the newer of it and --load's latest.")
    g.add_argument("--non-persistent-ckpt-type", type=str, default=None, choices=["global", "local", "in_memory"],
                   help="global (torch_dist on the shared file system); local and in_memory are refused.")
    g.add_argument("--non-persistent-global-ckpt-dir", type=str, default=None,
                   help="Directory of the global non-persistent checkpoints (default <save>/non_persistent).")
    g.add_argument("--pretrained-checkpoint", type=str, default=None,
                   help="When --load has no checkpoint (or is not given): load the model from this checkpoint as "
                        "with --finetune (no optimizer, RNG or iteration), e.g. to start a fine-tune that later "
                        "resumes from --load.")
    g.add_argument("--use-checkpoint-args", action="store_true", help="Take the model-shape arguments (sizes, "
                   "heads, norms, position embedding, ...) from the checkpoint in --load (or --pretrained-checkpoint).")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="Detect the format of the checkpoint a load reads (torch_dist is loaded; another format "
                        "is refused with its name).")
    g.add_argument("--use-dist-ckpt", action="store_true", dest="use_dist_ckpt_deprecated",
                   help="Deprecated (upstream): the same as --ckpt-format torch_dist, the only format here.")
    g.add_argument("--ckpt-assume-constant-structure", action="store_true",
                   help="The state's structure is the same at every save of the run: skip the cross-rank sharding "
                        "validation of the saves after the first (the same files are written).")


def _add_mixed_precision_args(parser):
    g = parser.add_argument_group(title="mixed precision")
    g.add_argument("--fp16", action="store_true",
                   help="Train in fp16 with fp32 main params and loss scaling (dynamic unless --loss-scale).")
    g.add_argument("--bf16", action="store_true", help="Train in bf16.")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="Static fp16 loss scale (a positive power of 2 helps); without it the scale is dynamic.")
    g.add_argument("--initial-loss-scale", type=float, default=2**32, help="Initial dynamic fp16 loss scale.")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="Minimum dynamic fp16 loss scale.")
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="Iterations without inf/nan gradients before the dynamic loss scale doubles.")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="Iterations with inf/nan gradients before the dynamic loss scale halves.")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="Accumulate (over micro-batches) and reduce grads in fp32, in persistent fp32 main_grad "
                        "buffers (on by default with --bf16, as upstream).")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="With --bf16: reduce grads in bf16 instead of fp32.")
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="Keep Adam's moments (--exp-avg-dtype, --exp-avg-sq-dtype) and the main grads "
                        "(--main-grads-dtype) in lower precision; the update is computed in fp32. Needs "
                        "--use-distributed-optimizer or --use-megatron-fsdp (as upstream; torch, no Transformer "
                        "Engine needed).")
    g.add_argument("--main-grads-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="Main grads' dtype with --use-precision-aware-optimizer (bf16: with --bf16, gradients are "
                        "then reduced in bf16 and stepped from directly).")
    g.add_argument("--main-params-dtype", default="fp32", choices=["fp32", "fp16"],
                   help="Main params' dtype with --use-precision-aware-optimizer (fp16 is refused: not built here).")
    g.add_argument("--exp-avg-dtype", default="fp32", choices=["fp32", "fp16", "bf16", "fp8"],
                   help="Storage dtype of Adam's first moment with --use-precision-aware-optimizer (fp16 / fp8 "
                        "scaled per tensor); the update is computed in fp32.")
    g.add_argument("--exp-avg-sq-dtype", default="fp32", choices=["fp32", "fp16", "bf16", "fp8"],
                   help="Storage dtype of Adam's second moment with --use-precision-aware-optimizer (as "
                        "--exp-avg-dtype).")


def _add_transformer_engine_args(parser):
    g = parser.add_argument_group(title="transformer-engine")
    g.add_argument("--fp8-format", default=None, choices=["e4m3", "hybrid"], dest="fp8", help="FP8 format.")
    g.add_argument("--fp8-recipe", default="delayed", choices=["delayed", "tensorwise", "mxfp8", "blockwise"],
                   help="FP8 scaling recipe.")
    g.add_argument("--fp8-margin", type=int, default=0, help="FP8 scaling margin.")
    g.add_argument("--fp8-amax-history-len", type=int, default=1, help="Delayed-scaling amax history length.")
    g.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"],
                   help="Delayed-scaling amax algorithm.")
    g.add_argument("--fp8-param-gather", action="store_true", help="Keep parameters in FP8 (quantized weights).")
    g.add_argument("--first-last-layers-bf16", action="store_true",
                   help="Keep the first/last layers (counts below) in high precision: neither FP8/FP4-computed nor "
                        "quantized weights (not with --fp8-recipe delayed).")
    g.add_argument("--num-layers-at-start-in-bf16", type=int, default=1,
                   help="With --first-last-layers-bf16: high-precision layers at the start.")
    g.add_argument("--num-layers-at-end-in-bf16", type=int, default=1,
                   help="With --first-last-layers-bf16: high-precision layers at the end.")
    g.add_argument("--fp4-format", default=None, choices=["e2m1"], dest="fp4", help="FP4 format.")
    g.add_argument("--fp4-recipe", default="nvfp4", choices=["nvfp4"], help="FP4 recipe.")
    g.add_argument("--fp4-param-gather", action="store_true", help="Keep parameters in FP4 (quantized weights).")


def _add_distributed_args(parser):
    g = parser.add_argument_group(title="distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="Tensor-parallel size: heads, query groups, FFN and vocabulary split over this many ranks.")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="Pipeline stages: the layers split evenly over this many ranks (1F1B schedule).")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="Layers per virtual stage (model chunk) with pipeline parallelism: interleaved schedule.")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="Layers of the first pipeline stage (uneven split; the others share the rest equally).")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="Layers of the last pipeline stage (uneven split; the others share the rest equally).")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="Context-parallel size: each sequence split over this many ranks (2 x size load-balanced "
                        "chunks; ring attention, or TE's with --transformer-impl transformer_engine).")
    g.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"],
                   help="Context-parallel communication: p2p or allgather (a2a with Transformer Engine); one type, "
                        "or one per layer.")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Split norms/dropout regions on the sequence over the tensor-parallel ranks (needs TP > 1).")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="torch.distributed backend (default nccl with CUDA, gloo without).")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10, help="Collective timeout.")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Shard the fp32 main params and optimizer state over the data-parallel ranks "
                        "(reduce-scatter grads, all-gather params); with --use-megatron-fsdp its own sharding.")
    g.add_argument("--use-megatron-fsdp", action="store_true", help="Megatron-FSDP (FSDP2 per transformer layer).")
    g.add_argument("--init-model-with-meta-device", action="store_true",
                   help="Build the model on the meta device; Megatron-FSDP materializes it shard by shard.")
    g.add_argument("--data-parallel-sharding-strategy", type=str, default=None,
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
                   help="What Megatron-FSDP shards over data-parallel ranks (with --use-megatron-fsdp; default "
                        "optim_grads_params): optim_grads_params (ZeRO-3), optim_grads (ZeRO-2), optim (ZeRO-1, "
                        "optimizer state only), no_shard (nothing).")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="Hybrid sharding with --use-megatron-fsdp: the data-parallel ranks form this many instances "
                        "(contiguous pieces); parameters, gradients and optimizer state are sharded within an "
                        "instance and replicated across instances (gradients all-reduced across them).")
    g.add_argument("--outer-dp-sharding-strategy", type=str, default="no_shard", choices=["no_shard", "optim"],
                   help="Across the instances of --num-distributed-optimizer-instances: no_shard (replicate, HSDP); "
                        "optim (HFSDP) is refused.")
    g.add_argument("--suggested-communication-unit-size", type=int, default=None,
                   help="Megatron-FSDP: consecutive transformer layers whose parameters total at most this many "
                        "elements are gathered and reduced together as one FSDP2 unit (fewer, larger collectives "
                        "and less per-unit host work; more memory unsharded at once). Default: one layer per unit, "
                        "2**29 elements with one data-parallel rank. Upstream's flag sizes Megatron-FSDP's buckets; "
                        "here it sizes FSDP2 units.")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="Overlap the gradient reduction with the backward pass: DDP all-reduces (the distributed "
                        "optimizer reduce-scatters) each bucket of gradients asynchronously as its last gradient "
                        "arrives; with gradient accumulation only the last micro-batch communicates. Megatron-FSDP: "
                        "FSDP2 reduce-scatters each unit's gradients during backward.")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="Overlap the parameter all-gather with the forward pass (distributed optimizer, with "
                        "--overlap-grad-reduce): each bucket's updated parameters are gathered asynchronously after "
                        "the optimizer step and waited for by the first module that uses them. Megatron-FSDP: "
                        "FSDP2 prefetches the next unit's parameters.")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="Elements per gradient bucket with --overlap-grad-reduce (default max(4e7, 1e6 x "
                        "data-parallel size); no bucketing past the first pipeline stage or the first model chunk).")
    g.add_argument("--ddp-num-buckets", type=int, default=None,
                   help="Instead of --ddp-bucket-size: this rank's parameters / N elements per bucket.")
    g.add_argument("--ddp-pad-buckets-for-high-nccl-busbw", action="store_true",
                   help="Pad each bucket to a multiple of 2**16 elements (NCCL bus bandwidth at large DP sizes).")
    g.add_argument("--ddp-average-in-collective", action="store_true",
                   help="Average gradients in the collective (NCCL's AVG; on gloo the sum is divided, the same "
                        "values) instead of dividing by the data-parallel size.")
    g.add_argument("--no-align-param-gather", action="store_false", dest="align_param_gather",
                   help="With --overlap-param-gather and an interleaved pipeline: each model chunk starts its "
                        "parameter all-gathers at its own first forward instead of all chunks together at the start "
                        "of the step.")
    g.add_argument("--local-rank", type=int, default=None, help="Set by the launcher (or LOCAL_RANK).")


def _add_validation_args(parser):
    g = parser.add_argument_group(title="validation")
    g.add_argument("--eval-iters", type=int, default=100, help="Iterations per evaluation.")
    g.add_argument("--eval-interval", type=int, default=1000, help="Iterations between evaluations.")
    g.add_argument("--skip-train", action="store_true",
                   help="Skip the training loop: evaluate on the validation and test sets (--eval-iters) and exit.")


def _add_data_args(parser):
    g = parser.add_argument_group(title="data and dataloader")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="Path prefix of an indexed dataset (<prefix>.bin/.idx), or a weighted blend: "
                        "'0.3 <prefix-a> 0.7 <prefix-b>'.")
    g.add_argument("--mock-data", action="store_true", help="Synthetic data, no files.")
    g.add_argument("--split", type=str, default=None, help="Train/valid/test split weights (default 969,30,1).")
    g.add_argument("--seq-length", type=int, default=None, help="Sequence length.")
    g.add_argument("--num-workers", type=int, default=2,
                   help="Data loader workers (accepted, no effect: samples are read by index in the training "
                        "process, the same samples in the same order for any value).")
    # -- upstream's data flags (megatron/core/datasets/gpt_dataset.py) --
    g.add_argument("--train-data-path", nargs="*", default=None,
                   help="The training split's own prefix or weighted blend, used whole (with --valid-data-path and "
                        "--test-data-path instead of --data-path and --split).")
    g.add_argument("--valid-data-path", nargs="*", default=None, help="The validation split's prefix or blend.")
    g.add_argument("--test-data-path", nargs="*", default=None, help="The test split's prefix or blend.")
    g.add_argument("--data-args-path", type=str, default=None,
                   help="A file holding the value of --data-path (weights and prefixes separated by spaces).")
    g.add_argument("--per-split-data-args-path", type=str, default=None,
                   help="A JSON file {train: [...], valid: [...], test: [...]} of the --*-data-path values.")
    g.add_argument("--data-cache-path", type=str, default=None,
                   help="Save each dataset's sample index arrays here (.npy) and read them back in later runs.")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                   help="Read the .bin files into memory instead of memory-mapping them (the same samples).")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="Position ids restart at 0 after each end-of-document token.")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="Tokens attend only to earlier tokens of their own document (a per-sample attention mask "
                        "made by the dataloader).")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader",
                   help="Do not make the attention mask in the dataloader: the causal mask is applied inside "
                        "attention (what this fork does anyway without --reset-attention-mask; refused with it).")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="Mask the loss where the input token is the tokenizer's end-of-document token.")


def _add_tokenizer_args(parser):
    g = parser.add_argument_group(title="tokenizer")
    g.add_argument("--tokenizer-type", type=str, default=None,
                   choices=["NullTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "TikTokenizer"],
                   help="NullTokenizer (ids are tokens; --vocab-size), GPT2BPETokenizer (--vocab-file, "
                        "--merge-file), HuggingFaceTokenizer (--tokenizer-model: a local directory or tokenizer.json).")
    g.add_argument("--vocab-file", type=str, default=None, help="GPT-2 BPE vocabulary (vocab.json).")
    g.add_argument("--merge-file", type=str, default=None, help="GPT-2 BPE merges (merges.txt).")
    g.add_argument("--tokenizer-model", type=str, default=None,
                   help="HuggingFaceTokenizer: a local tokenizer directory (tokenizer.json and its config) or a "
                        "tokenizer.json file. Nothing is downloaded and no remote code runs.")
    g.add_argument("--tiktoken-pattern", type=str, default=None, choices=["v1", "v2"],
                   help="TikTokenizer's split pattern; TikTokenizer is refused (the tiktoken package is not a "
                        "dependency of this fork).")


def _add_logging_args(parser):
    g = parser.add_argument_group(title="logging")
    g.add_argument("--log-throughput", action="store_true",
                   help="Log the model FLOP throughput per GPU (TFLOP/s/GPU) on each log line.")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="Timer verbosity: 0 (the iteration time, always logged); 1 and 2 are not supported.")
    g.add_argument("--tensorboard-dir", type=str, default=None,
                   help="Write TensorBoard event files here (last rank): lm loss, learning rate, grad norm, "
                        "tokens/s, memory, checkpoint load/save seconds, validation loss.")
    g.add_argument("--tensorboard-log-interval", type=int, default=1, help="Iterations between TensorBoard writes.")
    g.add_argument("--wandb-project", type=str, default="",
                   help="Also log the TensorBoard scalars to this Weights & Biases project (needs the wandb package).")
    g.add_argument("--wandb-exp-name", type=str, default="", help="wandb run name.")
    g.add_argument("--wandb-save-dir", type=str, default="", help="Local directory of the wandb run.")
    g.add_argument("--wandb-entity", type=str, default="", help="wandb entity (user or team).")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="Events the TensorBoard writer queues before flushing to disk.")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="Write the iteration time to TensorBoard (checkpoint load/save seconds are always written).")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="Write memory figures to TensorBoard (written with --tensorboard-dir in any case).")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="Also write the validation perplexity to TensorBoard.")
    # profiling (upstream's names and defaults; megatron/training/profiling.py)
    g.add_argument("--profile", action="store_true",
                   help="Profile iterations [--profile-step-start, --profile-step-end) on --profile-ranks: the CUDA "
                        "profiler API (nsys profile --capture-range=cudaProfilerApi), or torch.profiler with "
                        "--use-pytorch-profiler.")
    g.add_argument("--profile-step-start", type=int, default=10, help="First profiled iteration (iterations done).")
    g.add_argument("--profile-step-end", type=int, default=12, help="Profiling stops when this many iterations are done.")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="With --profile: torch.profiler; the trace goes to --tensorboard-dir (else <--save>/"
                        "torch_profile, else the current directory) and the top-ops table is printed.")
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[0], help="Global ranks that profile.")
    # -- logging and checks (upstream's flags; megatron/training/run_control.py) --
    g.add_argument("--log-params-norm", action="store_true",
                   help="Log the L2 norm of the parameters (each value counted once) on each log line.")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="Log the number of zero gradient values (after the data-parallel reduction) on each log line.")
    g.add_argument("--logging-level", type=int, default=None,
                   help="Level of Python's logging for the megatron loggers (e.g. 10 DEBUG, 20 INFO, 30 WARNING).")
    g.add_argument("--record-memory-history", action="store_true",
                   help="Record CUDA allocator history and dump a snapshot to --memory-snapshot-path at the end "
                        "of training (CUDA only: refused without a GPU).")
    g.add_argument("--memory-snapshot-path", type=str, default="snapshot.pickle",
                   help="With --record-memory-history: where the snapshot is written.")


class _Parser(argparse.ArgumentParser):
    """argparse with short errors: one line naming the flag (exit code 2, as argparse), not the whole usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def known_flags(parser: argparse.ArgumentParser):
    """Every option string ``parser`` accepts (``--foo``, ``-h``)."""
    return sorted({o for action in parser._actions for o in action.option_strings})


def unknown_flag_messages(unknown, parser: argparse.ArgumentParser):
    """One line per unknown flag in ``unknown`` (what ``parse_known_args`` left), with the closest known flag."""
    known = known_flags(parser)
    lines = []
    for item in unknown:
        if not item.startswith("-") or _is_number(item):
            continue  # the value of an unknown flag
        flag = item.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        lines.append(f"unrecognized argument: {flag}{hint}")
    return lines


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def get_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    parser = _Parser(description="Megatron-LM arguments (megatron-core fork)", allow_abbrev=False)
    for add in (
        _add_network_size_args, _add_mla_args, _add_moe_args, _add_recompute_args, _add_regularization_args,
        _add_training_args, _add_learning_rate_args, _add_checkpointing_args, _add_mixed_precision_args,
        _add_transformer_engine_args, _add_distributed_args, _add_validation_args, _add_data_args,
        _add_tokenizer_args, _add_logging_args, _add_cuda_graph_args, _add_refused_args,
    ):
        add(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def parse_args(extra_args_provider=None, ignore_unknown_args=False, args=None):
    """Parse ``args`` (default ``sys.argv[1:]``); unknown flags are an error unless ``ignore_unknown_args``."""
    parser = get_parser(extra_args_provider)
    parsed, unknown = parser.parse_known_args(args)
    if unknown and not ignore_unknown_args:
        lines = unknown_flag_messages(unknown, parser) or [f"unrecognized arguments: {' '.join(unknown)}"]
        parser.exit(2, "".join(f"{parser.prog}: error: {line}\n" for line in lines))
    if is_distributed():
        parsed.rank, parsed.world_size = get_rank(), get_world_size()
    else:
        parsed.rank = int(os.getenv("RANK", "0"))
        parsed.world_size = int(os.getenv("WORLD_SIZE", "1"))
    if parsed.local_rank is None:
        parsed.local_rank = int(os.getenv("LOCAL_RANK", "0"))
    return parsed


# Optimizer hyperparameters become float32 scalars inside the optimizer's kernels: a value outside float32's range
# (say --lr 1e39) would stop the first step with torch's "value cannot be converted ... without overflow".
OPTIMIZER_FLOAT_FLAGS = ("lr", "min_lr", "decoupled_lr", "decoupled_min_lr", "weight_decay", "start_weight_decay",
                         "end_weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum", "clip_grad")


def _check_optimizer_floats(args):
    limit = torch.finfo(torch.float32).max
    for name in OPTIMIZER_FLOAT_FLAGS:
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and abs(value) <= limit):
            _fail(f"--{name.replace('_', '-')} {value} is not a finite float32 value (|value| <= {limit:.4g})")
        if value is not None and value < 0:
            _fail(f"--{name.replace('_', '-')} must not be negative (got {value})")


def _fail(message: str):
    """Exit with a clear message (a ``SystemExit`` whose text names the flags)."""
    raise SystemExit(f"megatron argument error: {message}")


def warn_param_gather_load(args) -> bool:
    """Warn (rank 0, once per process) when quantized param-gather is used with ``--load`` but without
    ``--stream-ckpt-dequant``. Returns whether it warned now."""
    global _PARAM_GATHER_WARNED
    if _PARAM_GATHER_WARNED or not args.load or args.stream_ckpt_dequant:
        return False
    flags = [f for f, on in (("--fp8-param-gather", args.fp8_param_gather),
                             ("--fp4-param-gather", args.fp4_param_gather)) if on]
    if not flags or get_rank_safe() != 0:
        return False
    _PARAM_GATHER_WARNED = True
    warnings.warn(PARAM_GATHER_LOAD_WARNING.format(flag=" / ".join(flags)), UserWarning, stacklevel=2)
    return True


TOKENIZER_FILE_FLAGS = {
    "NullTokenizer": (),
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "HuggingFaceTokenizer": ("tokenizer_model",),
}


def _validate_tokenizer_args(args):
    if args.tokenizer_type is None:  # upstream's GPT example gives only --vocab-file and --merge-file
        args.tokenizer_type = "GPT2BPETokenizer" if args.vocab_file and args.merge_file else "NullTokenizer"
    if args.tokenizer_type == "NullTokenizer" and (args.vocab_size is None or args.vocab_size < 1):
        _fail(f"--vocab-size is required (>= 1) with --tokenizer-type NullTokenizer (got {args.vocab_size})")
    if args.tokenizer_type == "TikTokenizer":
        _fail("--tokenizer-type TikTokenizer is not supported: the tiktoken package is not a dependency of this fork; "
              "use HuggingFaceTokenizer with a tokenizer.json of the same vocabulary")
    if args.tiktoken_pattern is not None:
        _fail("--tiktoken-pattern goes with --tokenizer-type TikTokenizer, which this fork does not support")
    for dest in TOKENIZER_FILE_FLAGS[args.tokenizer_type]:
        path = getattr(args, dest)
        if not path:
            _fail(f"{flag_name(dest)} is required with --tokenizer-type {args.tokenizer_type}")
        if not os.path.exists(path):
            _fail(f"{flag_name(dest)} {path}: no such file or directory")
    if args.make_vocab_size_divisible_by is None or args.make_vocab_size_divisible_by < 1:
        _fail(f"--make-vocab-size-divisible-by must be >= 1 (got {args.make_vocab_size_divisible_by})")


def _validate_sample_based_args(args):
    """``--train-samples`` (upstream's sample-based training): the iteration count follows from the global batch
    size; the schedule flags in samples only go with it."""
    if args.train_samples is None:
        for dest in ("lr_decay_samples", "lr_warmup_samples"):
            if getattr(args, dest):
                _fail(f"{flag_name(dest)} needs --train-samples (iteration-based training uses --lr-decay-iters / "
                      "--lr-warmup-iters)")
        return
    if args.train_iters is not None:
        _fail("--train-iters and --train-samples are mutually exclusive")
    if args.train_samples <= 0:
        _fail(f"--train-samples must be positive (got {args.train_samples})")
    if args.lr_decay_iters is not None or args.lr_warmup_iters:
        _fail("--lr-decay-iters / --lr-warmup-iters go with --train-iters; with --train-samples use "
              "--lr-decay-samples / --lr-warmup-samples (or --lr-warmup-fraction)")
    if args.lr_decay_samples is None:
        args.lr_decay_samples = args.train_samples
    if args.lr_decay_samples <= 0:
        _fail(f"--lr-decay-samples must be positive (got {args.lr_decay_samples})")
    if args.lr_warmup_samples < 0 or (args.lr_warmup_samples and args.lr_decay_style != "constant"
                                      and args.lr_warmup_samples >= args.lr_decay_samples):
        _fail(f"--lr-warmup-samples ({args.lr_warmup_samples}) must be in [0, --lr-decay-samples "
              f"({args.lr_decay_samples}))")
    args.train_iters = args.train_samples // args.global_batch_size
    # The iteration-based equivalents, for code that reads them (the scheduler counts samples).
    args.lr_decay_iters = max(1, args.lr_decay_samples // args.global_batch_size)


def _validate_run_control_args(args):
    """Run control on clusters, housekeeping and logging checks (upstream's flags; what they do:
    ``megatron/training/run_control.py`` and ``checkpointing.py``)."""
    if args.use_dist_ckpt_deprecated:
        print_rank_0("WARNING: --use-dist-ckpt is deprecated (upstream): torch_dist is the only format here")
    for dest in ("exit_duration_in_mins", "save_retain_interval", "non_persistent_save_interval"):
        value = getattr(args, dest)
        if value is not None and value <= 0:
            _fail(f"{flag_name(dest)} must be positive (got {value})")
    if args.save_retain_interval is not None:
        if not (args.save and args.save_interval):
            _fail("--save-retain-interval needs --save <dir> and --save-interval")
        if args.save_retain_interval % args.save_interval:
            _fail(f"--save-retain-interval ({args.save_retain_interval}) must be a multiple of --save-interval "
                  f"({args.save_interval})")
    if args.non_persistent_ckpt_type in ("local", "in_memory"):
        _fail(f"--non-persistent-ckpt-type {args.non_persistent_ckpt_type} is not supported: this fork has no "
              "node-local or in-memory checkpointing; use global (a torch_dist checkpoint in <save>/non_persistent)")
    if args.non_persistent_save_interval is not None:
        if args.non_persistent_ckpt_type != "global":
            _fail("--non-persistent-save-interval needs --non-persistent-ckpt-type global")
        if not (args.save or args.non_persistent_global_ckpt_dir):
            _fail("--non-persistent-save-interval needs --save <dir> (or --non-persistent-global-ckpt-dir)")
    if args.manual_gc_interval < 0:
        _fail(f"--manual-gc-interval must be >= 0 (got {args.manual_gc_interval})")
    if args.record_memory_history and not torch.cuda.is_available():
        _fail("--record-memory-history records the CUDA allocator's history: there is no CUDA device here")
    if args.logging_level is not None:
        import logging

        if not 0 <= args.logging_level <= 50:
            _fail(f"--logging-level must be in [0, 50] (got {args.logging_level})")
        logging.getLogger("megatron").setLevel(args.logging_level)
        logging.getLogger().setLevel(args.logging_level)


def _validate_hybrid_sharding_args(args):
    """``--num-distributed-optimizer-instances N`` / ``--outer-dp-sharding-strategy``: hybrid sharding exists under
    Megatron-FSDP's FSDP2 strategies only (a 2-D mesh: replicate across the N instances, shard within one)."""
    n, outer = args.num_distributed_optimizer_instances, args.outer_dp_sharding_strategy
    if outer == "optim":
        _fail("--outer-dp-sharding-strategy optim (HFSDP: optimizer state also sharded across the instances) is not "
              "supported: FSDP2's 2-D mesh replicates across instances; use no_shard")
    if n is None or n < 1:
        _fail(f"--num-distributed-optimizer-instances ({n}) must be a positive integer")
    if n == 1:
        return
    if not args.use_megatron_fsdp:
        _fail(f"--num-distributed-optimizer-instances {n} needs --use-megatron-fsdp (hybrid sharding); without it "
              "the distributed optimizer shards over the whole data-parallel group (use 1)")
    if (args.data_parallel_sharding_strategy or "optim_grads_params") not in ("optim_grads", "optim_grads_params"):
        _fail(f"--num-distributed-optimizer-instances {n} needs --data-parallel-sharding-strategy optim_grads or "
              f"optim_grads_params (got {args.data_parallel_sharding_strategy}: a DDP wrapper)")
    if args.data_parallel_size % n:
        _fail(f"--num-distributed-optimizer-instances ({n}) must divide the data-parallel size "
              f"({args.data_parallel_size})")
    ep_tp = args.expert_model_parallel_size * args.tensor_model_parallel_size
    if args.num_experts is not None and (args.world_size // ep_tp) % n:
        _fail(f"--num-distributed-optimizer-instances ({n}) must divide the expert-data-parallel size "
              f"({args.world_size // ep_tp} = world / (--expert-model-parallel-size x --tensor-model-parallel-size))")


def _validate_data_parallel_args(args):
    """The data-parallel flags that this fork supports only under ``--use-megatron-fsdp``; refused with a message
    otherwise. Under it ``--data-parallel-sharding-strategy`` (upstream's default ``optim_grads_params``) decides
    what is sharded (``megatron/core/distributed/data_parallel_wrapper.py``), so it also sets
    ``use_distributed_optimizer``: optimizer state is sharded by every strategy but ``no_shard``."""
    strategy = args.data_parallel_sharding_strategy
    _validate_hybrid_sharding_args(args)
    if args.use_megatron_fsdp:
        strategy = args.data_parallel_sharding_strategy = strategy or "optim_grads_params"
        args.use_distributed_optimizer = strategy != "no_shard"
        if strategy in ("no_shard", "optim"):  # DDP wrapper: FSDP2's FP8 gather and units do not apply (DDP
            # overlaps the reduction itself, and with 'optim' the parameter gather)
            refused = ("fp8_param_gather", "fp4_param_gather", "suggested_communication_unit_size") + (
                ("overlap_param_gather",) if strategy == "no_shard" else ())
            for dest in refused:
                if getattr(args, dest, False):
                    _fail(f"{flag_name(dest)} is not supported with --data-parallel-sharding-strategy {strategy} "
                          "(parameters and gradients are not sharded: a DDP wrapper); use optim_grads or "
                          "optim_grads_params, or remove the flag")
        _validate_overlap_args(args)  # as upstream under Megatron-FSDP too
        return
    _validate_overlap_args(args)
    if strategy not in (None, "no_shard"):
        _fail(f"--data-parallel-sharding-strategy {strategy} needs --use-megatron-fsdp (without it nothing is "
              "sharded: no_shard)")
    args.data_parallel_sharding_strategy = "no_shard"
    if args.use_distributed_optimizer and args.fp4_param_gather:
        _fail("--use-distributed-optimizer without --use-megatron-fsdp does not support --fp4-param-gather (NVFP4 "
              "weights hold half a byte per element: the distributed optimizer gathers FP8 bytes); add "
              "--use-megatron-fsdp")
    if args.use_distributed_optimizer and args.fp8_param_gather and args.fp8_recipe == "mxfp8":
        _fail("--use-distributed-optimizer without --use-megatron-fsdp does not support --fp8-param-gather with "
              "--fp8-recipe mxfp8 (per-rank 1x32 block scales; Transformer Engine cannot re-point MXFP8 data); use "
              "delayed, tensorwise or blockwise, or add --use-megatron-fsdp")
    if args.suggested_communication_unit_size:
        _fail("--suggested-communication-unit-size is not supported without --use-megatron-fsdp: it sizes "
              "Megatron-FSDP's units; remove the flag, or add --use-megatron-fsdp")


def _validate_overlap_args(args):
    """Upstream's checks of the overlap flags (``megatron/core/distributed/distributed_data_parallel.py``)."""
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        _fail("--overlap-param-gather needs --use-distributed-optimizer (or --use-megatron-fsdp): without it "
              "parameters are replicated, there is nothing to gather")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        _fail("--overlap-param-gather needs --overlap-grad-reduce (as upstream)")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size <= 0:
        _fail(f"--ddp-bucket-size must be a positive number of elements, got {args.ddp_bucket_size}")
    if args.ddp_average_in_collective and getattr(args, "calculate_per_token_loss", False):
        _fail("--ddp-average-in-collective cannot be used with --calculate-per-token-loss (the gradients are "
              "divided by the global token count instead), as upstream")
    if getattr(args, "virtual_pipeline_model_parallel_size", None) is None:
        args.align_param_gather = False  # as upstream: only the interleaved schedule aligns the gathers


def _validate_data_path_args(args):
    """``--data-args-path`` / ``--per-split-data-args-path`` (files holding the path flags' values) and the
    per-split paths: sets ``args.data_blend_per_split`` (``[(prefix, weight)]`` or None for train, valid, test)."""
    import json

    if args.data_args_path:
        if args.data_path:
            _fail("--data-args-path and --data-path are mutually exclusive")
        try:
            with open(args.data_args_path) as f:
                args.data_path = f.read().split()
        except OSError as e:
            _fail(f"--data-args-path {args.data_args_path}: {e.strerror or e}")
    splits = ("train", "valid", "test")
    if args.per_split_data_args_path:
        if any(getattr(args, f"{n}_data_path") for n in splits):
            _fail("--per-split-data-args-path and --train-data-path / --valid-data-path / --test-data-path are "
                  "mutually exclusive")
        try:
            with open(args.per_split_data_args_path) as f:
                spec = json.load(f)
        except (OSError, ValueError) as e:
            _fail(f"--per-split-data-args-path {args.per_split_data_args_path}: {e}")
        if not isinstance(spec, dict) or set(spec) - set(splits):
            _fail(f"--per-split-data-args-path {args.per_split_data_args_path}: expected a JSON object with keys "
                  f"of {list(splits)}, got {list(spec) if isinstance(spec, dict) else type(spec).__name__}")
        for n in splits:
            value = spec.get(n)
            setattr(args, f"{n}_data_path", value.split() if isinstance(value, str) else value)
    per_split = [getattr(args, f"{n}_data_path") for n in splits]
    args.data_blend_per_split = None
    if any(per_split):
        if args.data_path:
            _fail("--data-path and --train-data-path / --valid-data-path / --test-data-path are mutually exclusive")
        if not args.train_data_path:
            _fail("--valid-data-path / --test-data-path need --train-data-path")
        if args.split is not None:
            _fail("--split applies to --data-path; with --train-data-path ... each split's data is used whole")
        args.data_blend_per_split = [parse_data_path(p) if p else None for p in per_split]


def parse_data_path(data_path):
    """``--data-path`` values -> ``[(prefix, weight)]`` with weights normalized to sum 1: one prefix (weight 1),
    or a blend ``w1 p1 w2 p2 ...`` (upstream's form; ``1.0 p`` is a blend of one)."""
    items = list(data_path)
    if len(items) == 1:
        return [(items[0], 1.0)]
    if len(items) % 2 != 0:
        _fail(f"--data-path: give one prefix or weight/prefix pairs ('0.3 a 0.7 b'), got {items}")
    pairs = []
    for weight, prefix in zip(items[0::2], items[1::2]):
        try:
            w = float(weight)
        except ValueError:
            _fail(f"--data-path: {weight!r} is not a weight; give weight/prefix pairs ('0.3 a 0.7 b'), got {items}")
        if not w > 0 or w != w or w == float("inf"):
            _fail(f"--data-path: weight {weight} of {prefix} must be a positive number")
        pairs.append((prefix, w))
    total = sum(w for _, w in pairs)
    return [(p, w / total) for p, w in pairs]


def _validate_tensor_parallel_model_args(args):
    """With --tensor-model-parallel-size N and --sequence-parallel every TP rank holds an equal share of the
    sequence. (The heads, query groups and FFN shares, and --sequence-parallel needing N > 1, are TransformerConfig's
    checks, reported by _validate_configs; the vocabulary is padded to a multiple of --make-vocab-size-divisible-by
    x N.)"""
    tp = args.tensor_model_parallel_size
    if tp > 1 and args.sequence_parallel and args.seq_length % tp != 0:
        _fail(f"--seq-length ({args.seq_length}) must be divisible by --tensor-model-parallel-size ({tp}) "
              "with --sequence-parallel")


def _validate_pipeline_args(args):
    """--pipeline-model-parallel-size P: P divides WORLD_SIZE / TP and --num-layers (even split);
    --num-layers-per-virtual-pipeline-stage L: L divides the layers of a stage (``virtual_pipeline_model_parallel_size``
    = layers / (P x L) chunks per rank). Refused by name where it does not compose: Megatron-FSDP."""
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    args.virtual_pipeline_model_parallel_size = None
    if pp < 1 or args.world_size % (tp * pp) != 0:
        _fail(f"--pipeline-model-parallel-size ({pp}) x --tensor-model-parallel-size ({tp}) must divide WORLD_SIZE "
              f"({args.world_size})")
    uneven = [flag_name(d) for d in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
              if getattr(args, d) is not None]
    if pp == 1:
        for flag in (["--num-layers-per-virtual-pipeline-stage"]
                     if args.num_layers_per_virtual_pipeline_stage is not None else []) + uneven:
            _fail(f"{flag} needs --pipeline-model-parallel-size > 1")
        return
    if uneven:  # the first/last stages' counts, the rest split equally (pipeline_layer_counts names the flags)
        from types import SimpleNamespace

        from megatron.core.transformer.transformer_config import pipeline_layer_counts

        if args.num_layers_per_virtual_pipeline_stage is not None:
            _fail(f"--num-layers-per-virtual-pipeline-stage is not supported with {' and '.join(uneven)}")
        try:
            pipeline_layer_counts(SimpleNamespace(
                num_layers=args.num_layers or 0, pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=None,
                num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
                num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers))
        except ValueError as e:
            _fail(str(e))
        return
    if args.num_layers is None or args.num_layers % pp != 0:
        _fail(f"--num-layers ({args.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp})")
    per_stage = args.num_layers // pp
    lv = args.num_layers_per_virtual_pipeline_stage
    if lv is not None:
        if lv <= 0 or per_stage % lv != 0:
            _fail(f"--num-layers-per-virtual-pipeline-stage ({lv}) must divide the layers per pipeline stage "
                  f"(--num-layers / --pipeline-model-parallel-size = {per_stage})")
        if per_stage // lv > 1:
            args.virtual_pipeline_model_parallel_size = per_stage // lv
    if args.use_megatron_fsdp:
        _fail(f"--use-megatron-fsdp is not supported with --pipeline-model-parallel-size {pp} (its FSDP2 units are "
              "not built per pipeline stage); use --pipeline-model-parallel-size 1, or DDP (optionally with "
              "--use-distributed-optimizer)")
    if getattr(args, "calculate_per_token_loss", False):
        _fail(f"--calculate-per-token-loss is not supported with --pipeline-model-parallel-size {pp} yet (the "
              "pipeline schedules here average per-micro-batch losses)")


def _validate_context_parallel_args(args):
    """--context-parallel-size C: C x TP x PP divides WORLD_SIZE, 2 x C divides --seq-length (the load-balanced
    chunks); --cp-comm-type: one type or one per layer (a single type is passed on as a string). Refused by name
    where it does not compose yet."""
    cp = args.context_parallel_size
    model = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if cp < 1 or args.world_size % (model * cp) != 0:
        _fail(f"--context-parallel-size ({cp}) x --tensor-model-parallel-size x --pipeline-model-parallel-size "
              f"({model}) must divide WORLD_SIZE ({args.world_size})")
    kinds = args.cp_comm_type
    args.cp_comm_type = kinds[0] if isinstance(kinds, (list, tuple)) and len(kinds) == 1 else kinds
    if cp == 1:
        return
    if args.seq_length is not None and args.seq_length % (2 * cp):
        _fail(f"--seq-length ({args.seq_length}) must be a multiple of 2 x --context-parallel-size ({2 * cp})")
    refused = (
        (args.use_megatron_fsdp and args.num_distributed_optimizer_instances > 1,
         "--use-megatron-fsdp with --num-distributed-optimizer-instances > 1 (hybrid sharding)"),
        (args.reset_attention_mask, "--reset-attention-mask (context-parallel attention is causal only)"),
    )
    for bad, what in refused:
        if bad:
            _fail(f"{what} is not supported with --context-parallel-size {cp} yet")


def validate_args(args, defaults={}):
    """Fill derived defaults and exit with a message naming the flags on bad combinations."""
    for key, value in defaults.items():  # args_defaults of pretrain(): used where the flag was not given
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.use_checkpoint_args:  # before anything is derived from the model-shape arguments
        if not (args.load or args.pretrained_checkpoint):
            _fail("--use-checkpoint-args needs --load <dir> or --pretrained-checkpoint <dir>")
        from megatron.training.checkpointing import load_args_from_checkpoint

        load_args_from_checkpoint(args)

    # ---- parallelism ------------------------------------------------------------------------------------
    if args.world_size <= 0:
        _fail(f"WORLD_SIZE={args.world_size} must be positive")
    tp = args.tensor_model_parallel_size
    if tp < 1 or args.world_size % tp != 0:
        _fail(f"--tensor-model-parallel-size ({tp}) must be a positive divisor of WORLD_SIZE ({args.world_size})")
    _validate_pipeline_args(args)
    _validate_context_parallel_args(args)
    args.data_parallel_size = args.world_size // (tp * args.pipeline_model_parallel_size * args.context_parallel_size)
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    if args.distributed_backend == "nccl" and not torch.cuda.is_available():
        _fail("--distributed-backend nccl needs CUDA; there is no CUDA device here (use --distributed-backend gloo)")

    # ---- model ------------------------------------------------------------------------------------------
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        value = getattr(args, flag)
        if value is None or value <= 0:
            _fail(f"--{flag.replace('_', '-')} is required and must be positive (got {value})")
    if not args.add_position_embedding and args.position_embedding_type == "learned_absolute":
        args.position_embedding_type = "none"  # --no-position-embedding (upstream: add_position_embedding False)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings and args.position_embedding_type == "learned_absolute":
        _fail(f"--seq-length ({args.seq_length}) must be <= --max-position-embeddings "
              f"({args.max_position_embeddings}) with --position-embedding-type learned_absolute")
    if args.swiglu and args.quick_geglu:
        _fail("--swiglu and --quick-geglu are mutually exclusive (two gated activations)")
    if args.ffn_hidden_size is None:
        if args.swiglu:  # keep the MLP parameter count of a 4h GELU MLP, rounded to a multiple of 64
            args.ffn_hidden_size = max(64, int((4 * args.hidden_size * 2 / 3) / 64) * 64)
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    # --hidden-size / --num-attention-heads / --num-query-groups divisibility: TransformerConfig's checks
    # (_validate_configs)
    _validate_tensor_parallel_model_args(args)
    _validate_tokenizer_args(args)
    if args.transformer_impl is None:
        from megatron.core.extensions.transformer_engine import HAVE_TE

        args.transformer_impl = "transformer_engine" if HAVE_TE else "local"

    if args.use_flash_attn:  # upstream: the same as --attention-backend flash
        args.attention_backend = "flash"
    if args.attention_backend in ("flash", "fused") and not torch.cuda.is_available():
        _fail(f"--attention-backend {args.attention_backend} (or --use-flash-attn) selects a CUDA kernel of torch's "
              "scaled_dot_product_attention; there is no CUDA device here: use auto")
    if args.attention_backend in ("local", "unfused") and args.transformer_impl != "local":
        _fail(f"--attention-backend {args.attention_backend} needs --transformer-impl local (the unfused "
              "attention of this fork); with Transformer Engine use auto")
    if args.rampup_batch_size is not None:
        _fail("--rampup-batch-size is not supported yet: the global batch size is fixed; remove the flag")

    # ---- MoE --------------------------------------------------------------------------------------------
    # a positive --num-experts, --moe-router-topk in [1, --num-experts] and --moe-router-enable-expert-bias
    # needing --num-experts: TransformerConfig's checks (_validate_configs)
    etp = args.expert_tensor_parallel_size
    if etp is not None and etp != args.tensor_model_parallel_size:
        _fail(f"--expert-tensor-parallel-size {etp} is not supported: the experts are split over the "
              f"tensor-parallel ranks (--tensor-model-parallel-size {args.tensor_model_parallel_size}); give that "
              "value or remove the flag")
    if args.moe_router_topk_limited_devices:  # upstream's deprecated form of device-limited routing
        args.moe_router_num_groups = args.expert_model_parallel_size
        args.moe_router_group_topk = args.moe_router_topk_limited_devices
    if args.num_experts is not None:
        if args.moe_ffn_hidden_size is None:
            args.moe_ffn_hidden_size = args.ffn_hidden_size
        ep = args.expert_model_parallel_size
        if ep < 1 or args.num_experts % ep or args.world_size % ep:
            _fail(f"--expert-model-parallel-size ({ep}) must be >= 1 and divide --num-experts ({args.num_experts}) "
                  f"and the world size ({args.world_size})")
        if args.world_size % (ep * args.tensor_model_parallel_size):  # expert TP = TP: the experts span tp x ep
            _fail(f"--tensor-model-parallel-size ({args.tensor_model_parallel_size}) x --expert-model-parallel-size "
                  f"({ep}) must divide the world size ({args.world_size})")
    else:
        if args.expert_model_parallel_size != 1:
            _fail(f"--expert-model-parallel-size ({args.expert_model_parallel_size}) needs --num-experts")
        for dest in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_z_loss_coeff",
                     "moe_router_num_groups", "moe_router_group_topk", "moe_expert_capacity_factor"):
            if getattr(args, dest) is not None:
                _fail(f"{flag_name(dest)} needs --num-experts")
    for dest in ("moe_shared_expert_gate", "moe_shared_expert_overlap"):  # upstream ignores them without the size
        if getattr(args, dest) and args.moe_shared_expert_intermediate_size is None:
            _fail(f"{flag_name(dest)} needs --moe-shared-expert-intermediate-size (shared experts)")

    # ---- batch sizes ------------------------------------------------------------------------------------
    if args.micro_batch_size is None or args.micro_batch_size <= 0:
        _fail(f"--micro-batch-size is required and must be positive (got {args.micro_batch_size})")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size <= 0 or args.global_batch_size % per_step != 0:
        _fail(f"--global-batch-size ({args.global_batch_size}) must be a positive multiple of --micro-batch-size "
              f"({args.micro_batch_size}) x data-parallel size ({args.data_parallel_size}) = {per_step}")
    args.num_microbatches = args.global_batch_size // per_step

    # ---- training / lr ------------------------------------------------------------------------------------
    _validate_sample_based_args(args)
    if args.train_iters is None or args.train_iters < 0:
        _fail(f"--train-iters (or --train-samples) is required and must be >= 0 (got {args.train_iters})")
    if args.lr is None:
        _fail("--lr is required")
    _check_optimizer_floats(args)
    if args.min_lr > args.lr:
        _fail(f"--min-lr ({args.min_lr}) must be <= --lr ({args.lr})")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        _fail("--decoupled-min-lr needs --decoupled-lr")
    if args.decoupled_lr is not None and not 0 <= (args.decoupled_min_lr or 0.0) <= args.decoupled_lr:
        _fail(f"--decoupled-min-lr ({args.decoupled_min_lr}) must be in [0, --decoupled-lr ({args.decoupled_lr})]")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = max(args.train_iters, 1)
    if args.lr_decay_iters <= 0:
        _fail(f"--lr-decay-iters must be positive (got {args.lr_decay_iters})")
    if args.lr_warmup_iters < 0 or (args.lr_decay_style != "constant" and args.lr_warmup_iters >= args.lr_decay_iters
                                    and args.lr_warmup_iters > 0):
        _fail(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be in [0, --lr-decay-iters ({args.lr_decay_iters}))")
    if args.lr_warmup_fraction is not None:
        if not 0.0 <= args.lr_warmup_fraction < 1.0:
            _fail(f"--lr-warmup-fraction must be in [0, 1) (got {args.lr_warmup_fraction})")
        if args.lr_warmup_iters or args.lr_warmup_samples:
            _fail("--lr-warmup-fraction and --lr-warmup-iters / --lr-warmup-samples are mutually exclusive")
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay
    if args.log_interval <= 0:
        _fail(f"--log-interval must be positive (got {args.log_interval})")
    if args.timing_log_level > 0:
        _fail(f"--timing-log-level {args.timing_log_level} is not supported: this fork has no per-phase timers "
              "(the iteration time is always logged); use 0 or remove the flag")
    if args.wandb_project:
        try:
            import wandb  # noqa: F401
        except ImportError:
            _fail("--wandb-project needs the wandb package, which is not installed: "
                  "pip install 'megatron-core-fork[wandb]'")
    if args.tensorboard_log_interval <= 0:
        _fail(f"--tensorboard-log-interval must be positive (got {args.tensorboard_log_interval})")
    if args.profile and not 0 <= args.profile_step_start < args.profile_step_end:
        _fail(f"--profile-step-start ({args.profile_step_start}) and --profile-step-end ({args.profile_step_end}) "
              "must satisfy 0 <= start < end")
    if args.use_pytorch_profiler and not args.profile:
        print("WARNING: --use-pytorch-profiler does nothing without --profile (as upstream)", flush=True)
    if args.eval_interval is not None and args.eval_interval <= 0:
        _fail(f"--eval-interval must be positive (got {args.eval_interval})")
    if args.eval_iters < 0:
        _fail(f"--eval-iters must be >= 0 (got {args.eval_iters})")

    # ---- precision ----------------------------------------------------------------------------------------
    # the loss-scale flags (--loss-scale needing --fp16, positive scales, window, hysteresis): OptimizerConfig's
    # checks (_validate_configs)
    if args.fp16 and args.use_megatron_fsdp:
        _fail("--fp16 with --use-megatron-fsdp is not supported yet (no loss scaler on FSDP2's sharded grads); "
              "use --bf16, or --fp16 without --use-megatron-fsdp")
    if args.fp16 and (args.fp8 is not None or args.fp4 is not None):
        _fail("--fp16 with --fp8-format / --fp4-format is not supported: use --bf16 as the high precision")
    args.params_dtype = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else torch.float32)
    _map_precision_aware_dtypes(args)
    if args.bf16 and args.accumulate_allreduce_grads_in_fp32 and args.main_grads_dtype != torch.float32:
        _fail("--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32 is set (as upstream)")
    if args.bf16:  # as upstream: bf16 gradients are all-reduced in fp32 unless --grad-reduce-in-bf16 or bf16 main grads
        args.accumulate_allreduce_grads_in_fp32 = (not args.grad_reduce_in_bf16
                                                   and args.main_grads_dtype == torch.float32)
    # fp16/bf16, fp8/fp4 and their param-gather and --transformer-impl combinations: the configs' own checks
    # (_validate_configs, below)

    # ---- distributed / FSDP -------------------------------------------------------------------------------
    if args.init_model_with_meta_device and not (args.use_megatron_fsdp or args.use_distributed_optimizer):
        _fail("--init-model-with-meta-device needs --use-megatron-fsdp or --use-distributed-optimizer (their "
              "wrappers materialize the model)")
    _validate_data_parallel_args(args)

    # ---- data ---------------------------------------------------------------------------------------------
    _validate_data_path_args(args)
    if args.mock_data and (args.data_path or args.data_blend_per_split):
        _fail("--mock-data and --data-path (or --train-data-path ...) are mutually exclusive")
    if not args.mock_data and not args.data_path and not args.data_blend_per_split:
        _fail("give --data-path <prefix> (an indexed .bin/.idx dataset), --train-data-path ... or --mock-data")
    args.data_blend = parse_data_path(args.data_path) if args.data_path else None  # [(prefix, weight)]
    if args.data_blend is not None and len(args.data_blend) == 1:
        args.data_path = [args.data_blend[0][0]]  # "--data-path 1.0 <prefix>": a blend of one
    if args.split is None:
        args.split = "969,30,1"
    if args.reset_attention_mask and not args.create_attention_mask_in_dataloader:
        _fail("--reset-attention-mask needs the attention mask made in the dataloader: remove "
              "--no-create-attention-mask-in-dataloader")

    # ---- checkpointing ------------------------------------------------------------------------------------
    if args.ckpt_format != "torch_dist":
        _fail(f"--ckpt-format {args.ckpt_format} is not supported: this fork saves and loads torch_dist only")
    if args.save_interval is not None and args.save_interval <= 0:
        _fail(f"--save-interval must be positive (got {args.save_interval})")
    if args.save_interval is not None and not args.save:
        _fail("--save-interval needs --save <dir>")
    if args.exit_on_missing_checkpoint and not args.load:
        _fail("--exit-on-missing-checkpoint needs --load <dir>")
    if args.finetune and not args.load:
        _fail("--finetune needs --load <dir>")
    for flag in ("no_save_optim", "no_save_rng", "no_load_optim", "no_load_rng", "use_cpu_initialization"):
        if getattr(args, flag) is None:
            setattr(args, flag, False)
    if args.use_checkpoint_opt_param_scheduler and args.override_opt_param_scheduler:
        _fail("--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler are mutually exclusive")
    if args.ckpt_fresh_start and not args.load:
        _fail("--ckpt-fresh-start needs --load <dir> (it allows starting from scratch although --load holds "
              "checkpoints without a tracker)")
    _validate_run_control_args(args)
    _validate_refused_args(args)
    _validate_cuda_graph_args(args)
    _validate_mla_args(args)
    # --stream-ckpt-dequant without --load is accepted (it does nothing then).
    if not args.stream_ckpt_dequant_chunk_mb >= 0:
        _fail(f"--stream-ckpt-dequant-chunk-mb must be >= 0 (0: no chunking), got {args.stream_ckpt_dequant_chunk_mb}")
    _validate_configs(args)
    warn_param_gather_load(args)

    args.consumed_train_samples = 0
    args.consumed_valid_samples = 0
    args.iteration = 0
    return args


# ---- config builders -----------------------------------------------------------------------------------
def core_transformer_config_from_args(args, config_class=None):
    """``TransformerConfig`` (or ``config_class``) from validated args, upstream's field mapping."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    config_class = config_class or (MLATransformerConfig if args.multi_latent_attention else TransformerConfig)
    kw = dict(
        multi_latent_attention=args.multi_latent_attention, q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim, qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim, rotary_scaling_factor=args.rotary_scaling_factor, mscale=args.mscale,
        mscale_all_dim=args.mscale_all_dim, **({"rope_type": args.rope_type} if args.rope_type else {}),
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        context_parallel_size=args.context_parallel_size,
        cp_comm_type=args.cp_comm_type,
        layernorm_epsilon=args.norm_epsilon,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        qk_layernorm=args.qk_layernorm,
        calculate_per_token_loss=args.calculate_per_token_loss,
        normalization=args.normalization,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        gated_linear_unit=bool(args.swiglu or args.quick_geglu),
        window_size=args.window_size,
        window_attn_skip_freq=args.window_attn_skip_freq,
        softmax_type=args.softmax_type,
        glu_linear_offset=args.glu_linear_offset,
        activation_func_clamp_value=args.activation_func_clamp_value,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        apply_rope_fusion=bool(args.apply_rope_fusion),
        init_method_std=args.init_method_std,
        use_cpu_initialization=bool(args.use_cpu_initialization),
        init_model_with_meta_device=bool(args.init_model_with_meta_device),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=getattr(args, "virtual_pipeline_model_parallel_size", None),
        num_layers_in_first_pipeline_stage=getattr(args, "decoder_first_pipeline_num_layers", None),
        num_layers_in_last_pipeline_stage=getattr(args, "decoder_last_pipeline_num_layers", None),
        sequence_parallel=bool(args.sequence_parallel),
        params_dtype=args.params_dtype,
        fp16=args.fp16,
        bf16=args.bf16,
        fp8=args.fp8,
        fp8_recipe=args.fp8_recipe,
        fp8_margin=args.fp8_margin,
        fp8_amax_history_len=args.fp8_amax_history_len,
        fp8_amax_compute_algo=args.fp8_amax_compute_algo,
        fp8_param=args.fp8_param_gather,
        first_last_layers_bf16=args.first_last_layers_bf16,
        num_layers_at_start_in_bf16=args.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=args.num_layers_at_end_in_bf16,
        fp4=args.fp4,
        fp4_recipe=args.fp4_recipe,
        fp4_param=args.fp4_param_gather,
        transformer_impl=args.transformer_impl,
        num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_router_topk,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_layer_freq=args.moe_layer_freq,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,  # None or the TP size (validated above)
        moe_per_layer_logging=args.moe_per_layer_logging,
        disable_bf16_reduced_precision_matmul=args.disable_bf16_reduced_precision_matmul,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=args.cross_entropy_fusion_impl,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_grouped_gemm=args.moe_grouped_gemm,
        moe_permute_fusion=args.moe_permute_fusion,
        moe_router_fusion=args.moe_router_fusion,
        bias_activation_fusion=bool(args.swiglu and args.bias_swiglu_fusion),  # no fused GeLU here
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        moe_shared_expert_overlap=args.moe_shared_expert_overlap,
        moe_router_force_load_balancing=args.moe_router_force_load_balancing,
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_router_dtype=args.moe_router_dtype,
        moe_router_num_groups=args.moe_router_num_groups,
        moe_router_group_topk=args.moe_router_group_topk,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=args.moe_token_drop_policy,
        mtp_num_layers=args.mtp_num_layers,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        attention_backend=args.attention_backend,
        recompute_granularity="selective" if args.recompute_activations else args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        recompute_modules=args.recompute_modules,
        distribute_saved_activations=args.distribute_saved_activations,
        cuda_graph_impl=args.cuda_graph_impl,
        cuda_graph_modules=list(args.cuda_graph_modules),
        cuda_graph_warmup_steps=args.cuda_graph_warmup_steps,
    )
    if args.swiglu:
        import torch.nn.functional as F

        kw["activation_func"] = F.silu
    elif args.quick_geglu:
        from megatron.core.activations import quick_gelu

        kw["activation_func"] = quick_gelu
    config = _build(config_class, kw)
    if args.position_embedding_type == "yarn" and not args.multi_latent_attention:
        # upstream's config.yarn_* attributes of standard attention's YaRN (its _apply_yarn_config_from_args)
        for attr, value, default in (
                ("yarn_rotary_scaling_factor", args.rotary_scaling_factor, 1.0),
                ("yarn_original_max_position_embeddings", args.yarn_original_max_position_embeddings, 4096),
                ("yarn_beta_fast", args.yarn_beta_fast, 32.0), ("yarn_beta_slow", args.yarn_beta_slow, 1.0),
                ("yarn_mscale", args.mscale, 1.0), ("yarn_mscale_all_dim", args.mscale_all_dim, 0.0),
                ("yarn_correction_range_round_to_int", args.yarn_correction_range_round_to_int, True)):
            setattr(config, attr, default if value is None else value)
    return config


def optimizer_config_from_args(args):
    """``megatron.core.optimizer.OptimizerConfig`` from args (fields it does not have are left out)."""
    from megatron.core.optimizer import OptimizerConfig

    kw = dict(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=args.params_dtype,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
        use_precision_aware_optimizer=args.use_precision_aware_optimizer,
        main_grads_dtype=args.main_grads_dtype,
        main_params_dtype=args.main_params_dtype,
        exp_avg_dtype=args.exp_avg_dtype,
        exp_avg_sq_dtype=args.exp_avg_sq_dtype,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
    )
    return _build(OptimizerConfig, kw)


def _validate_configs(args) -> None:
    """The config dataclasses are the single source of their checks: build them from the flags once, and turn a
    check's error (its message names the field and the flag) into the argument error."""
    try:
        core_transformer_config_from_args(args)
        optimizer_config_from_args(args)
        ddp_config_from_args(args)
    except ValueError as e:
        _fail(str(e))


def ddp_config_from_args(args):
    """``DistributedDataParallelConfig`` from args (fields it does not have are left out)."""
    from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig

    kw = dict(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        align_param_gather=args.align_param_gather,
        bucket_size=args.ddp_bucket_size,
        num_buckets=args.ddp_num_buckets,
        pad_buckets_for_high_nccl_busbw=args.ddp_pad_buckets_for_high_nccl_busbw,
        average_in_collective=args.ddp_average_in_collective,
        use_distributed_optimizer=args.use_distributed_optimizer,
        data_parallel_sharding_strategy=args.data_parallel_sharding_strategy,
        fp8_param_gather=args.fp8_param_gather,
        use_megatron_fsdp=args.use_megatron_fsdp,
        suggested_communication_unit_size=args.suggested_communication_unit_size,
    )
    return _build(DistributedDataParallelConfig, kw)


def _build(cls, kw):
    import dataclasses
    import inspect

    if dataclasses.is_dataclass(cls):
        names = {f.name for f in dataclasses.fields(cls)}
    else:
        names = set(inspect.signature(cls).parameters)
    return cls(**{k: v for k, v in kw.items() if k in names})
