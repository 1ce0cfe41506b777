"""A stack of TransformerLayers (``layers``, an nn.ModuleList: the FSDP units) and the final norm."""
import contextlib
from dataclasses import dataclass, field
from typing import List, Optional, Union

import torch

from megatron.core.transformer.module import MegatronModule, sharded_state_dict_default
from megatron.core.transformer.torch_norm import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import pipeline_layer_counts
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    _chunk_position,
    get_transformer_layer_offset,
    is_moe_layer,
    layer_submodules,
    spec_transformer_impl,
)


def get_num_layers_to_build(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None) -> int:
    """Transformer layers of this rank's (``pp_rank``, default the current pipeline rank) model chunk ``vp_stage``
    (upstream's name and arguments; see ``pipeline_layer_counts``)."""
    vp_stage, pp_rank = _chunk_position(config, vp_stage, pp_rank)
    return pipeline_layer_counts(config)[vp_stage][pp_rank]
from megatron.core.transformer.utils import replace_prefix_for_sharding


@dataclass
class TransformerBlockSubmodules:
    """Upstream's block spec: one layer spec per layer, and the final norm."""

    layer_specs: List[ModuleSpec] = field(default_factory=list)
    layer_norm: object = None


def default_layer_specs(config, use_te: bool) -> List[ModuleSpec]:
    """One TransformerLayer spec per layer of ``config`` (dense or MoE by ``moe_layer_freq``)."""
    return [ModuleSpec(module=TransformerLayer,
                       submodules=layer_submodules(use_te, is_moe_layer(config, i + 1), config.moe_grouped_gemm,
                                                   bool(getattr(config, "multi_latent_attention", False)),
                                                   bool(config.qk_layernorm)))
            for i in range(config.num_layers)]


def resolve_layer_specs(config, spec, stage_layers: Optional[int] = None) -> List[ModuleSpec]:
    """The per-layer specs of ``spec`` (None: from ``config.transformer_impl``; a layer ModuleSpec: for every layer;
    TransformerBlockSubmodules: one per layer). The specs choose Transformer Engine or local linears, as upstream:
    ``config.transformer_impl`` is set to that choice (FP8/FP4 need the Transformer Engine spec)."""
    if spec is None:
        return default_layer_specs(config, config.transformer_impl == "transformer_engine")
    if isinstance(spec, TransformerBlockSubmodules):
        specs = list(spec.layer_specs)
        if len(specs) not in (config.num_layers, stage_layers):
            raise ValueError(f"the block spec has {len(specs)} layer specs; expected one per layer of the model "
                             f"(num_layers={config.num_layers}, --num-layers) or of this pipeline stage "
                             f"({stage_layers})")
    elif isinstance(spec, ModuleSpec):
        specs = [spec] * config.num_layers
    else:
        raise TypeError(f"transformer_layer_spec must be a ModuleSpec or TransformerBlockSubmodules "
                        f"(models.gpt.gpt_layer_specs), got {type(spec).__name__}")
    impls = {spec_transformer_impl(s.submodules) for s in specs}
    if len(impls) > 1:
        raise ValueError("the layer specs mix Transformer Engine and local layers; use one kind for every layer")
    impl = impls.pop()
    if impl != config.transformer_impl:
        if impl == "local" and (config.fp8 is not None or config.fp4 is not None):
            raise ValueError("fp8/fp4 (--fp8-format / --fp4-format) need Transformer Engine layers: build the model "
                             "with get_gpt_layer_with_transformer_engine_spec, not the local spec")
        config.transformer_impl = impl
    return specs


def quantization_autocast(config):
    """TE's FP8/FP4 autocast for ``config`` (Transformer Engine layers with fp8/fp4), else a no-op."""
    if config.transformer_impl == "transformer_engine" and (config.fp8 is not None or config.fp4 is not None):
        from megatron.core.fp8_utils import te_quantization_autocast

        return te_quantization_autocast(config)
    return contextlib.nullcontext()


def _high_precision_layer(config, layer_number: int) -> bool:
    from megatron.core.fp8_utils import is_first_last_bf16_layer

    return is_first_last_bf16_layer(config, layer_number - 1)


class TransformerBlock(MegatronModule):
    """``spec`` (upstream's, optional here): see ``resolve_layer_specs``. ``pg_collection``: None or parallel_state's
    groups.

    With pipeline parallelism: this stage's layers (``get_num_layers_to_build``), numbered from the stage's global
    offset (``get_transformer_layer_offset``); ``pre_process=False``: the input comes from ``set_input_tensor`` (the
    previous stage's output); the final norm only on the last stage."""

    def __init__(
        self,
        config,
        spec: Union[TransformerBlockSubmodules, ModuleSpec, None] = None,
        post_layer_norm: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        pg_collection=None,
        vp_stage: Optional[int] = None,
        pp_rank: Optional[int] = None,
    ):
        super().__init__(config)
        from megatron.core.process_groups_config import check_mpu_groups

        check_mpu_groups(pg_collection, "TransformerBlock")  # parallel_state's groups only
        self.pre_process = pre_process
        self.post_process = post_process
        self.vp_stage = vp_stage
        self.input_tensor = None
        offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
        count = get_num_layers_to_build(config, vp_stage, pp_rank)
        specs = resolve_layer_specs(config, spec, count)  # the whole model's layers, or this stage's (upstream's)
        first = 0 if len(specs) == count != config.num_layers else offset
        self.layers = torch.nn.ModuleList([self._build_layer(specs[first + i], offset + i + 1) for i in range(count)])
        self.has_final_layernorm = post_process and post_layer_norm
        if self.has_final_layernorm:
            # upstream builds it as a TE norm whenever TE is importable: its checkpoints carry the _extra_state
            self.final_layernorm = build_norm(config, config.hidden_size, te_extra_state=True)

    def _build_layer(self, spec, layer_number: int):
        """A layer; one of the high-precision first/last layers (``--first-last-layers-bf16``) without quantized
        weights (upstream's per-layer init context)."""
        if _high_precision_layer(self.config, layer_number):
            from megatron.core.fp8_utils import high_precision_init

            with high_precision_init():
                return build_module(spec, self.config, layer_number=layer_number)
        return build_module(spec, self.config, layer_number=layer_number)

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None:
        """The hidden states this stage starts from when it is not the first one (upstream's pipeline hook)."""
        self.input_tensor = input_tensor

    def has_homogeneous_layers(self, metadata: Optional[dict] = None) -> bool:
        """Whether the layers are stacked in checkpoints (one key per parameter, a prepended layer axis). As upstream:
        not with ``metadata['non_homogeneous_layers']``, nor when ``moe_layer_freq`` is a list or an int > 1."""
        if (metadata or {}).get("non_homogeneous_layers", False):
            return False
        freq = self.config.moe_layer_freq
        return not (isinstance(freq, (list, tuple)) or (isinstance(freq, int) and freq > 1))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: Optional[dict] = None) -> dict:
        """Upstream's layout. Dict keys are the state-dict names (``layers.<i>.``); checkpoint keys of homogeneous
        layers are stacked: ``layers.<name>`` with prepended axis ``(0, global_layer_index, num_layers)``; of
        heterogeneous ones (e.g. ``moe_layer_freq`` != 1), ``layers.<global_layer_index>.<name>``, no extra axis."""
        if sharded_offsets:
            raise ValueError(f"TransformerBlock.sharded_state_dict: unexpected sharded_offsets {sharded_offsets}")
        stacked = self.has_homogeneous_layers(metadata)
        num_layers = self.config.num_layers
        out = {}
        for idx, layer in enumerate(self.layers):
            global_idx = layer.layer_number - 1
            sd_prefix = f"{prefix}layers.{idx}."
            if stacked:
                sh_prefix, offsets = f"{prefix}layers.", ((0, global_idx, num_layers),)
            else:
                sh_prefix, offsets = f"{prefix}layers.{global_idx}.", ()
            sd = layer.sharded_state_dict(sd_prefix, offsets, metadata)
            replace_prefix_for_sharding(sd, sd_prefix, sh_prefix)
            out.update(sd)
        for name, child in self.named_children():
            if child is not self.layers:
                out.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata))
        return out

    def _quantization_context(self):
        """The block's FP8/FP4 autocast; per layer instead with ``--first-last-layers-bf16`` (``_layer_context``)."""
        if getattr(self.config, "first_last_layers_bf16", False):
            return contextlib.nullcontext()
        return quantization_autocast(self.config)

    def _layer_context(self, layer):
        """With ``--first-last-layers-bf16``: the FP8/FP4 autocast for a quantized layer, none for a high-precision
        one (upstream's per-layer ``get_fp8_context``)."""
        if not getattr(self.config, "first_last_layers_bf16", False) or _high_precision_layer(self.config,
                                                                                             layer.layer_number):
            return contextlib.nullcontext()
        return quantization_autocast(self.config)

    def _run_layers(self, start: int, end: int):
        def run(hidden_states, attention_mask, rotary_pos_emb):
            for layer in self.layers[start:end]:
                with self._layer_context(layer):
                    hidden_states, _ = layer(hidden_states, attention_mask=attention_mask,
                                             rotary_pos_emb=rotary_pos_emb)
            return hidden_states

        return run

    def _checkpointed_forward(self, hidden_states, attention_mask, rotary_pos_emb):
        """Full recompute (``--recompute-granularity full``), upstream's methods: ``uniform`` keeps only the input
        of every chunk of ``recompute_num_layers`` layers and recomputes the chunk in backward; ``block`` recomputes
        each of the first ``recompute_num_layers`` layers and keeps the others' activations. Under Megatron-FSDP a
        one-layer chunk (``block``, or ``uniform`` with 1) recomputes with the parameters its backward gathers
        anyway; a longer uniform chunk gathers its earlier layers once more for the recompute."""
        from megatron.core.transformer.utils import recompute

        c, n = self.config, len(self.layers)
        k = c.recompute_num_layers
        if c.recompute_method == "uniform":
            spans = [(s, min(n, s + k), True) for s in range(0, n, k)]
        else:
            spans = [(i, i + 1, i < k) for i in range(n)]
        for start, end, checkpointed in spans:
            run = self._run_layers(start, end)
            if checkpointed:
                hidden_states = recompute(c, run, hidden_states, attention_mask, rotary_pos_emb)
            else:
                hidden_states = run(hidden_states, attention_mask, rotary_pos_emb)
        return hidden_states

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> torch.Tensor:
        if not self.pre_process:  # a later pipeline stage: the previous stage's output
            hidden_states = self.input_tensor
        with self._quantization_context():
            if self.config.recompute_granularity == "full" and self.training and torch.is_grad_enabled():
                hidden_states = self._checkpointed_forward(hidden_states, attention_mask, rotary_pos_emb)
            else:
                hidden_states = self._run_layers(0, len(self.layers))(hidden_states, attention_mask, rotary_pos_emb)
        if self.has_final_layernorm:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
