"""Causal self-attention: fused QKV projection, optional RoPE, ``F.scaled_dot_product_attention``, output proj.

Hidden states are ``[s, b, h]`` as upstream (``[s / tp, b, h]`` with sequence parallelism: the QKV projection
all-gathers them, the output projection reduce-scatters back). The QKV weight layout is upstream's: per query
group, ``[q heads of the group, k, v]`` each ``kv_channels`` wide, so the column-parallel split gives each tensor-parallel
rank ``num_query_groups / tp`` whole groups and their heads.
"""
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.dist_utils import log_once
from megatron.core.tensor_parallel.random import should_recompute
from megatron.core.tensor_parallel.utils import divide
from megatron.core.transformer.core_attention import CoreAttention, sdpa_backend  # noqa: F401 (also this module's name)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.rotary_pos_embedding import apply_rotary_pos_emb
from megatron.core.transformer.utils import config_init_method, recompute


def build_linear(config, kind: str, input_size: int, output_size: int, *, init_method, bias: bool, is_expert=False,
                 skip_bias_add: bool = False):
    """A linear layer for ``config.transformer_impl``: kind is 'column', 'row' or 'layernorm_column' (TE fused
    norm + linear; 'local' has no fused form, the caller then builds a separate norm)."""
    if config.transformer_impl == "transformer_engine":
        from megatron.core.tensor_parallel import te_layers

        cls = {
            "column": te_layers.TEColumnParallelLinear,
            "row": te_layers.TERowParallelLinear,
            "layernorm_column": te_layers.TELayerNormColumnParallelLinear,
        }[kind]
    else:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        if kind == "layernorm_column":
            raise ValueError("a fused layernorm+linear needs --transformer-impl transformer_engine")
        cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    return cls(
        input_size,
        output_size,
        config=config,
        init_method=init_method,
        bias=bias,
        skip_bias_add=skip_bias_add,
        is_expert=is_expert,
    )


@dataclass
class SelfAttentionSubmodules:
    """Upstream's attention submodule spec; here it records the linear classes ``SelfAttention`` builds (core
    attention is ``core_attention.CoreAttention`` on torch's ``scaled_dot_product_attention``: None)."""

    linear_qkv: object = None
    core_attention: object = None
    linear_proj: object = None
    q_layernorm: object = None
    k_layernorm: object = None


def fused_sdpa_kernel(q, k, v, dropout_p: float = 0.0) -> bool:
    """Whether causal ``F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)`` runs a fused
    kernel (flash, memory-efficient or cuDNN attention; on CPU torch's flash kernel) rather than the math one, as
    torch's own dispatcher decides under the current backend flags and priority order (call it inside
    ``sdpa_backend(...)`` for that backend). Without a mask a fused kernel keeps for backward q, k, v, its output and
    the per-row softmax statistics; the math kernel keeps the ``[s, s]`` probabilities. Unknown: False."""
    from torch.nn.attention import SDPBackend

    choose = getattr(torch, "_fused_sdp_choice", None)  # the choice F.scaled_dot_product_attention makes
    if choose is None:
        return False
    try:
        choice = choose(q, k, v, None, dropout_p, True)
    except (TypeError, RuntimeError):
        return False
    return choice in (SDPBackend.FLASH_ATTENTION.value, SDPBackend.EFFICIENT_ATTENTION.value,
                      SDPBackend.CUDNN_ATTENTION.value)


class SelfAttention(MegatronModule):
    def __init__(self, config, layer_number: int = 1, fuse_input_layernorm: bool = False):
        if getattr(config, "multi_latent_attention", False):
            raise NotImplementedError("multi-latent attention (--multi-latent-attention, MLATransformerConfig) is "
                                      "built by transformer.multi_latent_attention.MLASelfAttention, not SelfAttention")
        super().__init__(config)
        self.layer_number = layer_number
        tp = config.tensor_model_parallel_size
        self.head_dim = config.kv_channels
        self.query_projection_size = config.num_attention_heads * self.head_dim
        self.kv_projection_size = config.num_query_groups * self.head_dim
        qkv_size = self.query_projection_size + 2 * self.kv_projection_size
        # this rank's heads and query groups (TransformerConfig checked the divisibility with a message)
        self.num_heads = divide(config.num_attention_heads, tp, "num_attention_heads over tensor-parallel ranks")
        self.num_query_groups = divide(config.num_query_groups, tp, "num_query_groups over tensor-parallel ranks")
        init = config_init_method(config)
        out_init = config_init_method(config, "output_layer_init_method")
        self.linear_qkv = build_linear(
            config,
            "layernorm_column" if fuse_input_layernorm else "column",
            config.hidden_size,
            qkv_size,
            init_method=init,
            bias=config.add_bias_linear or config.add_qkv_bias,
        )
        self.linear_proj = build_linear(
            config, "row", self.query_projection_size, config.hidden_size, init_method=out_init,
            bias=config.add_bias_linear, skip_bias_add=True,
        )
        tp_rank = 0
        if tp > 1:
            from megatron.core import parallel_state

            tp_rank = parallel_state.get_tensor_model_parallel_rank()
        # sliding window, attention sinks (``softmax_offset``); see core_attention.py
        self.core_attention = CoreAttention(config, layer_number, self.num_heads, tp_rank, tp)
        if config.qk_layernorm:  # upstream's keys; a TE layer's norms carry TE's _extra_state as upstream's TENorm
            from megatron.core.transformer.torch_norm import build_norm

            te = config.transformer_impl == "transformer_engine"
            self.q_layernorm = build_norm(config, self.head_dim, te_extra_state=te)
            self.k_layernorm = build_norm(config, self.head_dim, te_extra_state=te)
            for norm in (self.q_layernorm, self.k_layernorm):  # a whole sequence per rank: not sequence-parallel
                for p in norm.parameters():
                    p.sequence_parallel = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
    ):
        """``hidden_states`` ``[s, b, h]``; ``attention_mask`` None (causal) or bool ``[b|1, 1, s, s]`` with True
        where attention is NOT allowed (upstream convention). Returns ``(output [s, b, h], bias or None)``."""
        s, b, _ = hidden_states.shape
        qkv, _ = self.linear_qkv(hidden_states)
        s = qkv.shape[0]  # the full sequence (sequence parallelism gathered it)
        per_group = self.num_heads // self.num_query_groups
        qkv = qkv.view(s, b, self.num_query_groups, per_group + 2, self.head_dim)
        q, k, v = torch.split(qkv, [per_group, 1, 1], dim=3)
        q = q.reshape(s, b, self.num_heads, self.head_dim)
        k = k.reshape(s, b, self.num_query_groups, self.head_dim)
        v = v.reshape(s, b, self.num_query_groups, self.head_dim)
        if self.config.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary_pos_emb is not None:
            q = apply_rotary_pos_emb(q, rotary_pos_emb, self.config)
            k = apply_rotary_pos_emb(k, rotary_pos_emb, self.config)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if per_group > 1:
            k = k.repeat_interleave(per_group, dim=1)
            v = v.repeat_interleave(per_group, dim=1)
        core = self.core_attention
        if should_recompute(self.config, "core_attn") and not self._fused_core_attention(q, k, v, attention_mask):
            ctx = recompute(self.config, core, q, k, v, attention_mask, core.sink(q), parameter_free=True,
                            preserve_rng_state=self.training and self.config.attention_dropout > 0)
        else:
            ctx = core(q, k, v, attention_mask)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)
        return self.linear_proj(ctx)

    def _fused_core_attention(self, q, k, v, attention_mask) -> bool:
        """``--recompute-modules core_attn`` where causal attention (no mask) runs a fused kernel: nothing to free
        (the kernel keeps only its inputs, output and softmax statistics, and the output is also what
        ``linear_proj`` keeps: 4 of 8397 MiB kept for backward in ``benchmarks/moe_grouped_recompute.py`` on the
        H200), so the core attention is not recomputed (Megatron-LM's legacy ``ParallelAttention`` skipped it under
        ``--use-flash-attn`` too). With the math kernel (which keeps the ``[s, s]`` probabilities) or an explicit
        mask (a fused kernel would keep the mask converted per layer; sliding windows and sinks have one) it is."""
        if attention_mask is not None or self.core_attention.window_size is not None or (
                self.config.softmax_type != "vanilla"):
            return False
        dropout_p = self.config.attention_dropout if self.training else 0.0
        with sdpa_backend(self.config.attention_backend):
            fused = fused_sdpa_kernel(q, k, v, dropout_p)
        if fused:
            log_once(logging.getLogger(__name__), "core_attn not recomputed", logging.WARNING,
                     "--recompute-modules core_attn: causal core attention runs a fused SDPA kernel (no [s, s] "
                     "activations to free), so it is not recomputed (--attention-backend unfused recomputes it)",
                     rank0=True)
        return fused
