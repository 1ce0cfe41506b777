"""Multi-latent attention (DeepSeek-V2/V3 MLA): upstream's ``MLASelfAttention``, submodule names and checkpoint keys.

Queries: ``linear_q_down_proj`` (hidden -> ``q_lora_rank``), ``q_layernorm``, ``linear_q_up_proj`` (-> heads x
(``qk_head_dim`` + ``qk_pos_emb_head_dim``)); without q-LoRA (``q_lora_rank=None``) one ``linear_q_proj``. Keys and
values: ``linear_kv_down_proj`` (hidden -> ``kv_lora_rank`` + ``qk_pos_emb_head_dim``: the compressed latent and one
decoupled RoPE key shared by every head), ``kv_layernorm``, ``linear_kv_up_proj`` (latent -> heads x (``qk_head_dim``
+ ``v_head_dim``)); ``linear_proj`` back to hidden. The RoPE parts (queries' last ``qk_pos_emb_head_dim`` channels,
the shared key) are rotated by this module's own rotary embedding (``rope_type`` 'rope' or 'yarn', DeepSeek's
interleaved channel pairs), so GPTModel builds none. Softmax scale ``mscale(rotary_scaling_factor, mscale_all_dim)^2 /
sqrt(qk_head_dim + qk_pos_emb_head_dim)``.

The q/kv norms exist with ``qk_layernorm`` (``--qk-layernorm``), as upstream: local layers keep them as
``q_layernorm`` / ``kv_layernorm``; Transformer Engine layers fuse them into the up projections
(``linear_q_up_proj.layer_norm_weight``, ``linear_kv_up_proj.layer_norm_weight``; without q-LoRA the fused norm sits in
``linear_q_proj``, over the hidden states). Without ``qk_layernorm`` there are none.

Tensor parallelism as upstream: the up projections are column-parallel (each rank its heads), ``linear_proj``
row-parallel; the down projections are column-parallel with the latent gathered after them (upstream's local spec;
its TE spec replicates them, ``TELinear`` 'duplicated': the same global tensors in checkpoints, so either loads the
other's). With sequence parallelism the latents are scattered back over the sequence before their norms. The shared
RoPE key's gradient is summed over the tensor-parallel ranks (each has only its heads' share), so the down
projections' gradients equal those of one rank.

Context parallelism: each CP rank rotates its chunks' queries and keys by their global positions (the angles of the
whole sequence, this rank's rows; YaRN included) and attends through the CP group's attention
(``context_parallel.py``: the ring takes the value head size and the softmax scale of MLA).
"""
import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.random import model_parallel_rng_context, should_recompute
from megatron.core.tensor_parallel.utils import divide, tp_group_info
from megatron.core.transformer.attention import build_linear, sdpa_backend
from megatron.core.transformer.context_parallel import context_parallel_attention, get_pos_emb_on_this_cp_rank
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.rotary_pos_embedding import RotaryEmbedding, apply_rotary_pos_emb
from megatron.core.transformer.torch_norm import IdentityOp, WrappedTorchNorm, build_norm
from megatron.core.transformer.utils import config_init_method, recompute
from megatron.core.transformer.yarn_rotary_pos_embedding import YarnRotaryEmbedding, _yarn_get_mscale


@dataclass
class MLASelfAttentionSubmodules:
    """Upstream's MLA submodule spec; here it records the classes ``MLASelfAttention`` builds (``mla_submodules``)."""

    linear_proj: object = None
    q_layernorm: object = None
    kv_layernorm: object = None
    linear_q_proj: object = None
    linear_q_down_proj: object = None
    linear_q_up_proj: object = None
    linear_kv_down_proj: object = None
    linear_kv_up_proj: object = None
    linear_qkv_down_proj: object = None
    core_attention: object = None


def mla_submodules(use_te: bool, qk_layernorm: bool) -> MLASelfAttentionSubmodules:
    """What upstream's MLA layer specs list (``get_gpt_layer_{local,with_transformer_engine}_spec`` with
    ``multi_latent_attention=True``): local linears with separate q/kv norms (``qk_layernorm``), or TE linears with
    the norms fused into the up projections (the down projections column-parallel, where upstream's TE spec has a
    replicated ``TELinear``: see the module docstring)."""
    if use_te:
        from megatron.core.tensor_parallel import te_layers

        column = te_layers.TEColumnParallelLinear
        up = te_layers.TELayerNormColumnParallelLinear if qk_layernorm else column
        return MLASelfAttentionSubmodules(
            linear_proj=te_layers.TERowParallelLinear, q_layernorm=IdentityOp, kv_layernorm=IdentityOp,
            linear_q_proj=column, linear_q_down_proj=column, linear_q_up_proj=up, linear_kv_down_proj=column,
            linear_kv_up_proj=up)
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    norm = WrappedTorchNorm if qk_layernorm else IdentityOp
    return MLASelfAttentionSubmodules(
        linear_proj=RowParallelLinear, q_layernorm=norm, kv_layernorm=norm, linear_q_proj=ColumnParallelLinear,
        linear_q_down_proj=ColumnParallelLinear, linear_q_up_proj=ColumnParallelLinear,
        linear_kv_down_proj=ColumnParallelLinear, linear_kv_up_proj=ColumnParallelLinear)


def mla_rotary_embedding(config):
    """The rotary embedding of the RoPE channels: ``rope_type`` 'rope' (``RotaryEmbedding``) or 'yarn'."""
    if config.rope_type == "rope":
        return RotaryEmbedding(config.qk_pos_emb_head_dim, rotary_percent=config.rotary_percent,
                               rotary_base=config.rotary_base)
    if config.rope_type == "yarn":
        return YarnRotaryEmbedding(
            config.qk_pos_emb_head_dim, rotary_base=config.rotary_base, scaling_factor=config.rotary_scaling_factor,
            original_max_position_embeddings=config.original_max_position_embeddings, beta_fast=config.beta_fast,
            beta_slow=config.beta_slow, mscale=config.mscale, mscale_all_dim=config.mscale_all_dim)
    raise ValueError(f"rope_type (--rope-type) must be 'rope' or 'yarn' for multi-latent attention, got "
                     f"{config.rope_type!r}")


class MLASelfAttention(MegatronModule):
    """Multi-latent self-attention, ``[s(/tp), b, h] -> ([s(/tp), b, h], bias or None)`` (see the module docstring).
    ``config``: an ``MLATransformerConfig``."""

    def __init__(self, config, layer_number: int = 1):
        super().__init__(config)
        self.layer_number = layer_number
        te = config.transformer_impl == "transformer_engine"
        qk_norm = bool(config.qk_layernorm)
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        self.num_heads = divide(config.num_attention_heads, tp_group_info()[1],
                                "num_attention_heads over tensor-parallel ranks")
        self.softmax_scale = _yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim) ** 2 / math.sqrt(
            self.q_head_dim)
        self.rotary_pos_emb = mla_rotary_embedding(config)
        init = config_init_method(config)
        heads = config.num_attention_heads

        def linear(kind, n_in, n_out):
            return build_linear(config, kind, n_in, n_out, init_method=init, bias=False)

        up = "layernorm_column" if te and qk_norm else "column"
        if config.q_lora_rank is None:
            if qk_norm and not te:
                raise ValueError("qk_layernorm (--qk-layernorm) with multi-latent attention needs q-LoRA "
                                 "(--q-lora-rank) on local layers: the query norm acts on the q latent (upstream "
                                 "refuses it too)")
            self.linear_q_proj = linear(up, config.hidden_size, heads * self.q_head_dim)
        else:
            self.linear_q_down_proj = linear("column", config.hidden_size, config.q_lora_rank)
            self.linear_q_up_proj = linear(up, config.q_lora_rank, heads * self.q_head_dim)
        self.linear_kv_down_proj = linear("column", config.hidden_size,
                                          config.kv_lora_rank + config.qk_pos_emb_head_dim)
        self.linear_kv_up_proj = linear(up, config.kv_lora_rank, heads * (config.qk_head_dim + config.v_head_dim))
        self.linear_proj = build_linear(config, "row", heads * config.v_head_dim, config.hidden_size,
                                        init_method=config_init_method(config, "output_layer_init_method"),
                                        bias=config.add_bias_linear, skip_bias_add=True)
        separate_norms = qk_norm and not te
        if config.q_lora_rank is not None:
            self.q_layernorm = build_norm(config, config.q_lora_rank) if separate_norms else IdentityOp()
        self.kv_layernorm = build_norm(config, config.kv_lora_rank) if separate_norms else IdentityOp()

    def _latent(self, linear, x):
        """A down projection's full output (column-parallel: gathered over TP ranks), ``[s, b, n]``."""
        out, _ = linear(x)
        return gather_from_tensor_model_parallel_region(out) if tp_group_info()[1] > 1 else out

    def _to_sequence_parallel(self, x):
        sp = self.config.sequence_parallel and tp_group_info()[1] > 1
        return scatter_to_sequence_parallel_region(x) if sp else x

    def get_query_key_value_tensors(self, hidden_states):
        """``(query [s, b, n, dq], key [s, b, n, dq], value [s, b, n, dv])`` of this rank's heads, RoPE applied."""
        cfg = self.config
        if cfg.q_lora_rank is None:
            q, _ = self.linear_q_proj(hidden_states)
        else:
            q_latent = self._to_sequence_parallel(self._latent(self.linear_q_down_proj, hidden_states))
            q, _ = self.linear_q_up_proj(self.q_layernorm(q_latent))
        kv_latent, k_pos = torch.split(self._latent(self.linear_kv_down_proj, hidden_states),
                                       [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        kv, _ = self.linear_kv_up_proj(self.kv_layernorm(self._to_sequence_parallel(kv_latent)))
        if tp_group_info()[1] > 1:  # each rank's heads give a share of the shared key's gradient: summed
            k_pos = copy_to_tensor_model_parallel_region(k_pos)
        s, b = q.shape[:2]
        q = q.view(s, b, self.num_heads, self.q_head_dim)
        kv = kv.view(s, b, self.num_heads, cfg.qk_head_dim + cfg.v_head_dim)
        q_nope, q_pos = torch.split(q, [cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        k_nope, value = torch.split(kv, [cfg.qk_head_dim, cfg.v_head_dim], dim=-1)
        cp = cfg.context_parallel_size  # the angles of the whole sequence, then this CP rank's chunks' positions
        rotary = self.rotary_pos_emb(s * cp, device=q.device)
        freqs, mscale = rotary if isinstance(rotary, tuple) else (rotary, 1.0)
        if cp > 1:
            freqs = get_pos_emb_on_this_cp_rank(freqs, 0)
        q_pos = apply_rotary_pos_emb(q_pos, freqs, cfg, mscale=mscale, mla_rotary_interleaved=True)
        k_pos = apply_rotary_pos_emb(k_pos.unsqueeze(-2), freqs, cfg, mscale=mscale, mla_rotary_interleaved=True)
        query = torch.cat((q_nope, q_pos), dim=-1)
        key = torch.cat((k_nope, k_pos.expand(-1, -1, self.num_heads, -1)), dim=-1)
        return query, key, value

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None, **unused):
        """As ``SelfAttention.forward``; ``rotary_pos_emb`` must be None (MLA rotates with its own embedding)."""
        if rotary_pos_emb is not None:
            raise ValueError("MLASelfAttention computes its own rotary embedding: rotary_pos_emb must be None")
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        s, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
        if should_recompute(self.config, "core_attn"):
            ctx = recompute(self.config, self.core_attention, q, k, v, attention_mask, parameter_free=True,
                            preserve_rng_state=self.training and self.config.attention_dropout > 0)
        else:
            ctx = self.core_attention(q, k, v, attention_mask)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.config.v_head_dim)
        return self.linear_proj(ctx)

    def core_attention(self, q, k, v, attention_mask=None):
        """``softmax(q k^T * softmax_scale) v`` with dropout, ``[b, n, s, d]`` (v's head size may differ); with
        context parallelism the CP group's attention (``context_parallel.py``) with the same scale."""
        if self.config.context_parallel_size > 1:
            return context_parallel_attention(q, k, v, attention_mask, self.config, self.layer_number,
                                              scale=self.softmax_scale)
        dropout_p = self.config.attention_dropout if self.training else 0.0
        rng = model_parallel_rng_context(self.config) if dropout_p > 0 and not self.config.sequence_parallel else None
        with rng if rng is not None else contextlib.nullcontext(), sdpa_backend(self.config.attention_backend):
            if attention_mask is None:
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                                      scale=self.softmax_scale)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask.bool(), dropout_p=dropout_p,
                                                  scale=self.softmax_scale)
