"""Pre-norm transformer layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (MLP or MoE)."""
from dataclasses import dataclass, field, fields
from typing import Dict, Optional

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.random import checkpoint_without_output, should_recompute
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import IdentityOp, WrappedTorchNorm, build_norm
from megatron.core.transformer.transformer_config import pipeline_layer_counts
from megatron.core.transformer.utils import apply_prefix_mapping, recompute

# Upstream's local layer spec (get_gpt_layer_local_spec) stores the separate norms under the names they have in the
# fused TE linears, so local and TE checkpoints share keys. The TE spec fuses those norms (no mapping); a TE MoE
# layer keeps a separate ``pre_mlp_layernorm`` (TENorm), stored under that name.
LOCAL_SPEC_SHARDED_KEYS_MAP = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def get_transformer_layer_offset(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None) -> int:
    """Global index of the first layer of this rank's (``pp_rank``, default the current pipeline rank) model chunk
    ``vp_stage`` (needed with virtual stages), upstream's name and arguments."""
    counts = pipeline_layer_counts(config)
    vp_stage, pp_rank = _chunk_position(config, vp_stage, pp_rank)
    flat = [n for row in counts for n in row]
    return sum(flat[: vp_stage * config.pipeline_model_parallel_size + pp_rank])


def _chunk_position(config, vp_stage, pp_rank):
    if pp_rank is None:
        from megatron.core import parallel_state

        pp_rank = parallel_state.get_pipeline_model_parallel_rank() if config.pipeline_model_parallel_size > 1 else 0
    if config.virtual_pipeline_model_parallel_size is not None:
        if vp_stage is None:
            raise ValueError("vp_stage must be provided if virtual pipeline model parallel size is set "
                             "(--num-layers-per-virtual-pipeline-stage)")
    else:
        vp_stage = 0
    return vp_stage, pp_rank


def is_moe_layer(config, layer_number: int) -> bool:
    """Whether layer ``layer_number`` (1-based) is an MoE layer: every ``moe_layer_freq``-th layer, counting from
    the first, when ``num_moe_experts`` is set."""
    if config.num_moe_experts is None:
        return False
    if isinstance(config.moe_layer_freq, int):
        return (layer_number - 1) % config.moe_layer_freq == 0
    return bool(config.moe_layer_freq[layer_number - 1])


@dataclass
class TransformerLayerSubmodules:
    """Upstream's layer spec fields. In this fork they record what ``TransformerLayer`` builds (see
    ``layer_submodules``); the bias-dropout-add and cross-attention slots stay None."""

    input_layernorm: object = None
    self_attention: object = None
    self_attn_bda: object = None
    pre_cross_attn_layernorm: object = None
    cross_attention: object = None
    cross_attn_bda: object = None
    pre_mlp_layernorm: object = None
    mlp: object = None
    mlp_bda: object = None
    sharded_state_dict_keys_map: Dict[str, str] = field(default_factory=dict)


def layer_submodules(use_te: bool, is_moe: bool, moe_grouped_gemm: bool = False,
                     multi_latent_attention: bool = False, qk_layernorm: bool = False) -> TransformerLayerSubmodules:
    """The submodules ``TransformerLayer`` builds with Transformer Engine (``use_te``) or local linears, for a dense
    or MoE layer: the contents of upstream's ``get_gpt_layer_{with_transformer_engine,local}_spec`` in this fork's
    classes. TE fuses the norms into ``linear_qkv`` / ``linear_fc1`` (``IdentityOp`` norms, no key map; an MoE layer
    keeps a separate ``pre_mlp_layernorm``); local keeps the norms and maps their checkpoint keys. Multi-latent
    attention (``qk_layernorm``: its q/kv norms) keeps a separate ``input_layernorm`` and, local, no key map, as
    upstream's MLA specs."""
    if use_te:
        from megatron.core.tensor_parallel import te_layers

        column, row = te_layers.TEColumnParallelLinear, te_layers.TERowParallelLinear
        fused = te_layers.TELayerNormColumnParallelLinear
    else:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear as column, RowParallelLinear as row

        fused = column
    if is_moe:
        from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP, TEGroupedMLP
        from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules

        experts = (TEGroupedMLP if use_te else GroupedMLP) if moe_grouped_gemm else SequentialMLP
        mlp = ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=experts))
    else:
        mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=fused, linear_fc2=row))
    if multi_latent_attention:
        from megatron.core.transformer.multi_latent_attention import MLASelfAttention, mla_submodules

        attention = ModuleSpec(module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                               submodules=mla_submodules(use_te, qk_layernorm))
    else:
        attention = ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                               submodules=SelfAttentionSubmodules(linear_qkv=fused, linear_proj=row))
    return TransformerLayerSubmodules(
        input_layernorm=IdentityOp if use_te and not multi_latent_attention else WrappedTorchNorm,
        self_attention=attention,
        pre_mlp_layernorm=IdentityOp if use_te and not is_moe else WrappedTorchNorm,
        mlp=mlp,
        sharded_state_dict_keys_map={} if use_te or multi_latent_attention else dict(LOCAL_SPEC_SHARDED_KEYS_MAP),
    )


def config_layer_submodules(config, is_moe: bool) -> TransformerLayerSubmodules:
    """``layer_submodules`` for ``config`` (its implementation, grouped experts, multi-latent attention)."""
    return layer_submodules(config.transformer_impl == "transformer_engine", is_moe, config.moe_grouped_gemm,
                            bool(getattr(config, "multi_latent_attention", False)), bool(config.qk_layernorm))


def spec_transformer_impl(submodules: TransformerLayerSubmodules) -> str:
    """'transformer_engine' or 'local': which linears a layer spec's attention uses."""
    attention = getattr(submodules, "self_attention", None)
    submodules = getattr(attention, "submodules", None)
    qkv = getattr(submodules, "linear_qkv", None) or getattr(submodules, "linear_proj", None)  # MLA: linear_proj
    return "transformer_engine" if getattr(qkv, "__name__", "").startswith("TE") else "local"


class TransformerLayer(MegatronModule):
    """One layer; the FSDP wrapping unit. Local impl: separate ``input_layernorm`` / ``pre_mlp_layernorm``; TE
    impl: those norms are fused into ``linear_qkv`` / ``linear_fc1`` (``te.LayerNormLinear``) and the norm
    attributes are ``IdentityOp`` (MoE layers keep a separate ``pre_mlp_layernorm``), as upstream.

    ``submodules`` (upstream's spec, optional here): must be what this layer builds for ``config`` and its layer
    number (``layer_submodules``: the TE/local choice, dense or MoE, grouped experts); anything else is refused with
    the differing fields named, since this fork builds its own modules. ``layer_number``: 1-based and global (a
    pipeline stage's layers start at its offset + 1). ``pg_collection``: None or parallel_state's groups."""

    def __init__(
        self,
        config,
        submodules: Optional[TransformerLayerSubmodules] = None,
        layer_number: int = 1,
        hidden_dropout: Optional[float] = None,
        pg_collection=None,
        vp_stage: Optional[int] = None,
        is_mtp_layer: bool = False,
    ):
        super().__init__(config)
        from megatron.core.process_groups_config import check_mpu_groups

        check_mpu_groups(pg_collection, "TransformerLayer")  # parallel_state's groups only
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        # an MTP depth's layer (layer_number: the depth) is of the last decoder layer's kind, as upstream's spec; its
        # MoE losses are logged after the decoder's layers (num_layers + depth)
        self.is_moe = is_moe_layer(config, config.num_layers if is_mtp_layer else layer_number)
        moe_layer_number = config.num_layers + layer_number if is_mtp_layer else layer_number
        te = config.transformer_impl == "transformer_engine"
        if submodules is not None:
            self._check_submodules(submodules, config_layer_submodules(config, self.is_moe))
        self.submodules_config = submodules
        if te:
            from megatron.core.fp8_utils import check_te_available

            check_te_available()
        mla = bool(getattr(config, "multi_latent_attention", False))
        if mla:  # a separate input norm (TE: as upstream's TENorm), no key map
            from megatron.core.transformer.multi_latent_attention import MLASelfAttention

            self.input_layernorm = build_norm(config, config.hidden_size, te_extra_state=te)
            self.self_attention = MLASelfAttention(config, layer_number)
        else:
            self.input_layernorm = IdentityOp() if te else build_norm(config, config.hidden_size)
            self.self_attention = SelfAttention(config, layer_number, fuse_input_layernorm=te)
        fuse_mlp_norm = te and not self.is_moe
        self.pre_mlp_layernorm = (IdentityOp() if fuse_mlp_norm
                                  else build_norm(config, config.hidden_size, te_extra_state=te))  # TE MoE: TENorm
        self.sharded_state_dict_keys_map = {} if te or mla else dict(LOCAL_SPEC_SHARDED_KEYS_MAP)
        if self.is_moe:
            from megatron.core.transformer.moe.moe_layer import MoELayer

            self.mlp = MoELayer(config, moe_layer_number)
        else:
            self.mlp = MLP(config, fuse_input_layernorm=fuse_mlp_norm)

    def _check_submodules(self, given, expected: TransformerLayerSubmodules) -> None:
        if not isinstance(given, TransformerLayerSubmodules):
            raise TypeError(f"TransformerLayer {self.layer_number}: submodules must be TransformerLayerSubmodules "
                            f"(models.gpt.gpt_layer_specs), got {type(given).__name__}")
        differ = [f.name for f in fields(expected) if getattr(given, f.name) != getattr(expected, f.name)]
        if differ:
            kind = "MoE" if self.is_moe else "dense"
            raise ValueError(
                f"TransformerLayer {self.layer_number} ({kind}, transformer_impl={self.config.transformer_impl!r}, "
                f"moe_grouped_gemm={self.config.moe_grouped_gemm}): the layer spec's {differ} differ from what this "
                "fork builds for this config; build the spec with models.gpt.gpt_layer_specs "
                "(get_gpt_decoder_block_spec(config, use_transformer_engine) picks dense/MoE per layer)")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """MegatronModule's, with the checkpoint keys renamed by ``sharded_state_dict_keys_map`` (dict keys stay the
        state-dict names)."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.sharded_state_dict_keys_map:
            apply_prefix_mapping(out, {f"{prefix}{k}": f"{prefix}{v}" for k, v in self.sharded_state_dict_keys_map.items()})
        return out

    def _residual_add(self, out, bias, residual):
        if bias is not None:
            out = out + bias
        if self.hidden_dropout > 0:
            out = F.dropout(out, p=self.hidden_dropout, training=self.training)
        return residual + out

    cuda_graphs = None  # per-layer CUDA graphs (transformer/cuda_graphs.py's LayerGraphs) when --cuda-graph-impl

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        **kwargs,
    ):
        """``hidden_states`` ``[s, b, h]`` -> ``(hidden_states [s, b, h], context=None)`` as upstream."""
        graphs = self.cuda_graphs
        if graphs is not None and graphs.has("layer"):  # the whole layer graphed (--cuda-graph-impl, no modules)
            return graphs.run("layer", lambda: self._layer_eager(hidden_states, attention_mask, rotary_pos_emb),
                              hidden_states, attention_mask, rotary_pos_emb), None
        hidden_states = self._forward_attention(hidden_states, attention_mask, rotary_pos_emb)
        return self._forward_mlp(hidden_states), None

    def _layer_eager(self, hidden_states, attention_mask=None, rotary_pos_emb=None):
        return self._mlp_eager(self._attention_eager(hidden_states, attention_mask, rotary_pos_emb))

    def _forward_attention(self, hidden_states, attention_mask=None, rotary_pos_emb=None):
        """The input norm, self-attention and residual add (upstream's name; ``--cuda-graph-modules attn``)."""
        graphs = self.cuda_graphs
        if graphs is not None and graphs.has("attn"):
            return graphs.run("attn", lambda: self._attention_eager(hidden_states, attention_mask, rotary_pos_emb),
                              hidden_states, attention_mask, rotary_pos_emb)
        return self._attention_eager(hidden_states, attention_mask, rotary_pos_emb)

    def _attention_eager(self, hidden_states, attention_mask=None, rotary_pos_emb=None):
        out, bias = self._norm_then(self.input_layernorm, hidden_states, lambda x: self.self_attention(
            x, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb))
        return self._residual_add(out, bias, hidden_states)

    def _forward_mlp(self, hidden_states):
        """The pre-MLP norm, MLP / MoE and residual add (upstream's name; ``--cuda-graph-modules mlp`` for a dense
        layer, ``moe`` the same for a drop-and-pad MoE layer, ``moe_router`` an MoE layer's norm and router only)."""
        graphs = self.cuda_graphs
        for kind in ("mlp", "moe"):  # a dense layer's / a drop-and-pad MoE layer's norm, MLP and residual
            if graphs is not None and graphs.has(kind):
                return graphs.run(kind, lambda: self._mlp_eager(hidden_states), hidden_states)
        if graphs is not None and graphs.has("moe_router"):
            routed = graphs.run("moe_router", lambda: self._route_moe(hidden_states), hidden_states)
            out, bias = self.mlp.dispatch_and_combine(*routed)
            return self._residual_add(out, bias, hidden_states)
        return self._mlp_eager(hidden_states)

    def _mlp_eager(self, hidden_states):
        out, bias = self._norm_then(self.pre_mlp_layernorm, hidden_states, self._mlp)
        return self._residual_add(out, bias, hidden_states)

    def _route_moe(self, hidden_states):
        """An MoE layer's pre-MLP norm, shared experts and router, as a tuple of tensors (``MoELayer.route``; the
        ``moe_router`` graph's outputs)."""
        routed = self.mlp.route(self.pre_mlp_layernorm(hidden_states))
        return routed if routed[-1] is not None else routed[:-1]

    def _norm_then(self, norm, x, consumer):
        """``consumer(norm(x))``. With ``--recompute-modules layernorm`` the norm's output is discarded once the
        consumer (attention / MLP) has saved it and recomputed when the consumer's output gradient arrives
        (upstream's ``CheckpointWithoutOutput``); an ``IdentityOp`` norm (fused into TE's linear) has nothing to
        recompute."""
        if isinstance(norm, IdentityOp) or not should_recompute(self.config, "layernorm"):
            return consumer(norm(x))
        return checkpoint_without_output(norm, consumer, x, preserve_rng_state=False)  # a norm draws nothing

    def _mlp(self, x):
        """The MLP / MoE layer, recomputed whole in backward with ``--recompute-modules mlp`` / ``moe``."""
        if should_recompute(self.config, "moe" if self.is_moe else "mlp"):
            return recompute(self.config, self.mlp, x)
        return self.mlp(x)
