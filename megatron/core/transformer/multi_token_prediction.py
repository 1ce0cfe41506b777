"""Multi-token prediction (DeepSeek-V3's MTP; upstream's ``--mtp-num-layers`` / ``--mtp-loss-scaling-factor``).

Depth ``k`` (1-based) predicts the token ``k + 1`` positions ahead. It takes the previous depth's hidden states (depth
1: the decoder's output after its final norm) and the embedding of the input tokens shifted left by ``k``:

    h_k = final_layernorm(transformer_layer(eh_proj(cat(enorm(emb(roll(ids, -k))), hnorm(h_{k-1})))))

and the shared output layer turns ``h_k`` into logits scored against the labels shifted left by ``k``. Shifted-in
positions (the last ``k`` of each sequence) are masked out of the loss. The MTP loss of depth ``k`` is its mean over
the remaining tokens; ``mtp_loss_scaling_factor / mtp_num_layers`` times the sum over depths trains the model (its
gradient enters through ``MTPLossAutoScaler``, not through the returned language-model loss), and each depth's mean
is logged as ``mtp_<k> loss``, as upstream.

Upstream's module names and checkpoint keys: ``mtp.layers.<i>.{enorm,hnorm,eh_proj,final_layernorm}`` and the
depth's transformer layer (attribute ``mtp_model_layer``, stored as ``mtp.layers.<i>.transformer_layer.``). With
pipeline parallelism the MTP block sits on the last stage, which then keeps a copy of the word embeddings (tied to
the first stage's, as the tied output weight is).

Context parallelism: the rolls of the token ids, position ids, labels and loss mask are those of the whole
sequence across the CP ranks' chunks (:func:`roll_tensor` with ``cp_group``), and the loss of each depth is
normalised by the CP group's token count (:func:`process_mtp_loss`), so the MTP losses equal CP=1's.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import torch
import torch.distributed as dist

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import build_norm
from megatron.core.transformer.utils import apply_prefix_mapping, config_init_method


def roll_tensor(tensor: torch.Tensor, shifts: int = -1, dims: int = -1, cp_group=None):
    """``(rolled, rolled.sum())``: ``tensor`` shifted left by one along ``dims`` with the shifted-in last position
    set to 0 (upstream's ``roll_tensor``). ``cp_group`` (context parallelism, upstream's keyword): ``tensor`` is this
    CP rank's two chunks of the sequence (``context_parallel.split_for_cp_rank``) and the roll is the one of the
    whole sequence: each chunk's last position takes the first of the next chunk (another rank's, or this rank's
    other chunk), the sequence's last position (rank 0's second chunk) 0; the sum is this rank's."""
    if tensor is None:
        return None, None
    if shifts != -1:
        raise ValueError(f"roll_tensor: only shifts=-1 is supported, got {shifts}")
    size = 1 if cp_group is None else dist.get_world_size(cp_group)
    if size == 1:
        rolled = torch.roll(tensor, shifts=shifts, dims=dims)
        rolled.select(dims, -1).zero_()
        return rolled, rolled.sum()
    rank = dist.get_rank(cp_group)
    halves = tensor.chunk(2, dim=dims)  # chunks rank and 2 cp - 1 - rank of the sequence
    firsts = torch.stack([h.select(dims, 0) for h in halves]).contiguous()
    gathered = [torch.empty_like(firsts) for _ in range(size)]
    dist.all_gather(gathered, firsts, group=cp_group)
    # chunk rank + 1 is rank + 1's first (the last rank: its own second); chunk 2 cp - rank is rank - 1's second
    after_first = gathered[rank + 1][0] if rank + 1 < size else firsts[1]
    after_second = gathered[rank - 1][1] if rank > 0 else torch.zeros_like(firsts[1])
    rolled = []
    for half, after in zip(halves, (after_first, after_second)):
        r = torch.roll(half, shifts=-1, dims=dims)
        r.select(dims, -1).copy_(after)
        rolled.append(r)
    out = torch.cat(rolled, dim=dims)
    return out, out.sum()


def mtp_cp_group(config):
    """The context-parallel group the MTP rolls and token counts span (None without context parallelism)."""
    if getattr(config, "context_parallel_size", 1) <= 1:
        return None
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


# ---- the MTP loss: gradient without changing the returned loss; values for the log ---------------------------
class MTPLossAutoScaler(torch.autograd.Function):
    """Identity on ``output``; in backward it also sends ``main_loss_backward_scale`` as the gradient of the MTP
    loss (the training loop sets it like the main loss's: 1 / micro-batches, times the fp16 loss scale)."""

    main_loss_backward_scale: torch.Tensor = torch.tensor(1.0)

    @staticmethod
    def forward(ctx, output: torch.Tensor, mtp_loss: torch.Tensor):
        ctx.save_for_backward(mtp_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (mtp_loss,) = ctx.saved_tensors
        scale = MTPLossAutoScaler.main_loss_backward_scale
        return grad_output, torch.ones_like(mtp_loss) * scale.to(mtp_loss.device)

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        MTPLossAutoScaler.main_loss_backward_scale = scale


_MTP_LOSSES: Dict[int, torch.Tensor] = {}  # depth index -> this iteration's per-micro-batch means, summed


def record_mtp_loss(depth: int, value: torch.Tensor) -> None:
    _MTP_LOSSES[depth] = _MTP_LOSSES.get(depth, 0.0) + value.detach().float().reshape(())


def clear_mtp_losses() -> None:
    _MTP_LOSSES.clear()


def reduce_mtp_losses(mtp_num_layers: int, num_microbatches: int) -> Dict[str, float]:
    """``{'mtp_<k> loss': value}`` of this iteration as upstream's ``MTPLossLoggingHelper`` logs it: each depth's
    per-micro-batch means summed and divided by the micro-batches, added over context-parallel ranks (each records
    its share of the sequence's mean) and averaged over data-parallel ranks (added over pipeline stages here, so
    every rank has them; only the last stage records). Collective; clears the record."""
    from megatron.core import parallel_state
    from megatron.core.dist_utils import default_device, get_world_size

    recorded = list(_MTP_LOSSES.values())
    device = recorded[0].device if recorded else default_device()
    values = torch.zeros(mtp_num_layers, dtype=torch.float32, device=device)
    for depth, value in _MTP_LOSSES.items():
        values[depth] += value
    _MTP_LOSSES.clear()
    if dist.is_available() and dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        pp = parallel_state.get_pipeline_model_parallel_group()
        if pp is not None and get_world_size(pp) > 1:
            dist.all_reduce(values, group=pp)
        dp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        if dp is not None and get_world_size(dp) > 1:  # a CP rank records its share: summed over CP
            dist.all_reduce(values, group=dp)
            values = values / parallel_state.get_data_parallel_world_size()
    values = values.cpu() / max(num_microbatches, 1)
    return {f"mtp_{k + 1} loss": float(v) for k, v in enumerate(values)}


def process_mtp_loss(hidden_states: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor],
                     output_layer, output_weight: Optional[torch.Tensor], compute_language_model_loss, config,
                     is_training: bool = True, cp_group=None) -> torch.Tensor:
    """Upstream's ``process_mtp_loss``: ``hidden_states`` is the decoder's output followed by each depth's
    (``[(1 + D) * s, b, h]``); returns the decoder's part with every depth's scaled MTP loss attached
    (``MTPLossAutoScaler``). Depth ``k``'s loss: cross entropy against ``labels`` rolled left ``k`` times, under
    ``loss_mask`` rolled likewise (default all ones), summed and divided by the remaining tokens; times
    ``mtp_loss_scaling_factor / mtp_num_layers`` (per-token loss mode: times original / remaining tokens,
    unnormalised, as upstream). ``cp_group`` (context parallelism): the rolls are the whole sequence's
    (:func:`roll_tensor`) and the token counts the CP group's; a rank's loss is its loss sum over the group's
    tokens, times the CP size as the main loss (gradients are averaged over data x context ranks), so the MTP
    loss and its gradients equal CP=1's exactly (upstream divides each rank's sum by its own count)."""
    chunks = torch.chunk(hidden_states, 1 + config.mtp_num_layers, dim=0)
    hidden_states = chunks[0]
    mtp_labels = labels.clone()
    loss_mask = torch.ones_like(mtp_labels) if loss_mask is None else loss_mask
    cp = 1 if cp_group is None else dist.get_world_size(cp_group)

    def group_sum(t):
        if cp > 1:
            t = t.detach().clone()
            dist.all_reduce(t, group=cp_group)
        return t

    original_tokens = group_sum(loss_mask.sum())
    scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
    for depth in range(config.mtp_num_layers):
        logits, _ = output_layer(chunks[depth + 1], weight=output_weight)
        mtp_labels, _ = roll_tensor(mtp_labels, cp_group=cp_group)
        loss_mask, num_tokens = roll_tensor(loss_mask, cp_group=cp_group)
        num_tokens = group_sum(num_tokens)
        loss = compute_language_model_loss(mtp_labels, logits) * loss_mask
        safe_tokens = num_tokens.clamp(min=1)
        if is_training:
            record_mtp_loss(depth, loss.sum() * (num_tokens > 0).to(loss.dtype) / safe_tokens)
        if config.calculate_per_token_loss:
            scaled = scale * loss * (original_tokens / safe_tokens)
        else:
            scaled = scale * cp * loss / safe_tokens
        hidden_states = MTPLossAutoScaler.apply(hidden_states, scaled)
    return hidden_states


# ---- modules --------------------------------------------------------------------------------------------------
@dataclass
class MultiTokenPredictionLayerSubmodules:
    """Upstream's MTP layer spec: the norms, the projection and the depth's transformer layer spec. In this fork
    the norms and the projection follow ``config`` (TE or local, like the transformer layer's spec); the fields
    record what upstream's spec names."""

    enorm: object = None
    hnorm: object = None
    layer_norm: object = None
    eh_proj: object = None
    mtp_model_layer: Union[ModuleSpec, type, None] = None


@dataclass
class MultiTokenPredictionBlockSubmodules:
    """Upstream's MTP block spec: one MTP layer spec per depth."""

    layer_specs: Optional[List[ModuleSpec]] = None


def get_mtp_layer_spec(mtp_model_layer_spec: ModuleSpec, use_transformer_engine: bool) -> ModuleSpec:
    """The spec of one MTP depth around ``mtp_model_layer_spec`` (a TransformerLayer spec)."""
    if use_transformer_engine:
        from megatron.core.tensor_parallel import te_layers

        column = te_layers.TEColumnParallelLinear
    else:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear as column
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=WrappedTorchNorm, hnorm=WrappedTorchNorm, layer_norm=WrappedTorchNorm, eh_proj=column,
        mtp_model_layer=mtp_model_layer_spec))


class MultiTokenPredictionLayer(MegatronModule):
    """One MTP depth (``layer_number``: 1-based depth). Submodules as upstream: ``enorm``, ``hnorm`` (norms of the
    shifted tokens' embeddings and of the previous hidden states), ``eh_proj`` (column-parallel ``2h -> h``, no bias,
    gathered over tensor-parallel ranks), ``mtp_model_layer`` (a TransformerLayer; the last decoder layer's kind:
    dense or MoE) and ``final_layernorm``."""

    def __init__(self, config, submodules: Optional[MultiTokenPredictionLayerSubmodules] = None,
                 layer_number: int = 1, vp_stage: Optional[int] = None, pg_collection=None, **unused):
        super().__init__(config)
        if pg_collection is not None:
            raise ValueError("MultiTokenPredictionLayer: pg_collection must be None (this fork uses the "
                             "parallel_state groups)")
        from megatron.core.transformer.transformer_layer import TransformerLayer

        submodules = submodules or MultiTokenPredictionLayerSubmodules()
        te = config.transformer_impl == "transformer_engine"
        self.layer_number = layer_number
        self.vp_stage = vp_stage
        self.enorm = build_norm(config, config.hidden_size, te_extra_state=te)
        self.hnorm = build_norm(config, config.hidden_size, te_extra_state=te)
        if te:
            from megatron.core.tensor_parallel import te_layers

            column = te_layers.TEColumnParallelLinear
        else:
            from megatron.core.tensor_parallel.layers import ColumnParallelLinear as column
        self.eh_proj = column(2 * config.hidden_size, config.hidden_size, config=config,
                              init_method=config_init_method(config), bias=False, gather_output=False,
                              skip_bias_add=False, is_expert=False, tp_comm_buffer_name="mtp_eh_proj")
        spec = submodules.mtp_model_layer
        layer_submodules = getattr(spec, "submodules", None) if isinstance(spec, ModuleSpec) else None
        self.mtp_model_layer = TransformerLayer(config, layer_submodules, layer_number=layer_number,
                                                vp_stage=vp_stage, is_mtp_layer=True)
        self.final_layernorm = build_norm(config, config.hidden_size, te_extra_state=te)

    def forward(self, input_ids, position_ids, hidden_states, attention_mask=None, rotary_pos_emb=None,
                embedding=None, **unused):
        """-> ``(hidden_states, input_ids, position_ids)``: this depth's output ``[s, b, h]`` and the ids rolled
        once more (for the next depth)."""
        from megatron.core.tensor_parallel.mappings import (
            gather_from_tensor_model_parallel_region,
            scatter_to_sequence_parallel_region,
        )

        cp_group = mtp_cp_group(self.config)
        input_ids, _ = roll_tensor(input_ids, cp_group=cp_group)
        if position_ids is not None:
            position_ids, _ = roll_tensor(position_ids, cp_group=cp_group)
        decoder_input = embedding(input_ids, position_ids)  # [s(/tp), b, h]
        x = torch.cat((self.enorm(decoder_input), self.hnorm(hidden_states)), dim=-1)
        x, _ = self.eh_proj(x)  # [s, b, h / tp]
        x = gather_from_tensor_model_parallel_region(x)
        if self.config.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x)
        x, _ = self.mtp_model_layer(x, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        return self.final_layernorm(x), input_ids, position_ids

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: Optional[dict] = None) -> dict:
        """MegatronModule's, with upstream's checkpoint name ``transformer_layer.`` for ``mtp_model_layer.``."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        apply_prefix_mapping(out, {f"{prefix}mtp_model_layer.": f"{prefix}transformer_layer."})
        return out


class MultiTokenPredictionBlock(MegatronModule):
    """The MTP depths (``layers``), on the last pipeline stage. ``forward`` returns the decoder's hidden states
    followed by each depth's, concatenated along the sequence axis (``[(1 + D) * s, b, h]``), as upstream."""

    def __init__(self, config, spec: Union[MultiTokenPredictionBlockSubmodules, ModuleSpec, None] = None,
                 vp_stage: Optional[int] = None, pg_collection=None, **unused):
        super().__init__(config)
        if pg_collection is not None:
            raise ValueError("MultiTokenPredictionBlock: pg_collection must be None")
        if not config.mtp_num_layers:
            raise ValueError("MultiTokenPredictionBlock needs config.mtp_num_layers (--mtp-num-layers)")
        if isinstance(spec, ModuleSpec) and isinstance(spec.submodules, MultiTokenPredictionBlockSubmodules):
            spec = spec.submodules
        specs = list(spec.layer_specs) if isinstance(spec, MultiTokenPredictionBlockSubmodules) else []
        if specs and len(specs) != config.mtp_num_layers:
            raise ValueError(f"the MTP block spec has {len(specs)} layer specs; mtp_num_layers (--mtp-num-layers) "
                             f"is {config.mtp_num_layers}")
        self.vp_stage = vp_stage
        self.layers = torch.nn.ModuleList([
            MultiTokenPredictionLayer(config, specs[i].submodules if specs else None, layer_number=i + 1,
                                      vp_stage=vp_stage)
            for i in range(config.mtp_num_layers)])

    def forward(self, input_ids, position_ids, hidden_states, attention_mask=None, rotary_pos_emb=None,
                embedding=None, **unused) -> torch.Tensor:
        from megatron.core.transformer.transformer_block import quantization_autocast

        outputs = [hidden_states]
        with quantization_autocast(self.config):  # FP8/FP4 as the decoder (upstream: MTP in the global context)
            for layer in self.layers:
                hidden_states, input_ids, position_ids = layer(input_ids, position_ids, hidden_states, attention_mask,
                                                               rotary_pos_emb, embedding=embedding)
                outputs.append(hidden_states)
        return torch.cat(outputs, dim=0)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: Optional[dict] = None) -> dict:
        """``<prefix>layers.<depth - 1>.<name>`` for every depth (no stacked axis), as upstream."""
        out = {}
        for i, layer in enumerate(self.layers):
            layer_prefix = f"{prefix}layers.{i}."
            out.update(layer.sharded_state_dict(layer_prefix, (), metadata))
        return out
