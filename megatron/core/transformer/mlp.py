"""MLP: ``fc2(act(fc1(x)))``, or gated (``act(x W1) * (x V)``, e.g. SwiGLU; gpt-oss's clamped quick-GeGLU) with
``gated_linear_unit``."""
import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.fusions.fused_bias_swiglu import swiglu_impl, use_fused_swiglu
from megatron.core.tensor_parallel.random import checkpoint_without_output, should_recompute
from megatron.core.transformer.attention import build_linear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import config_init_method


def apply_swiglu_sharded_factory(original, sharded_offsets=(), tp_rank: int = 0, tp_size: int = 1):
    """A ShardedTensorFactory writing a gated-linear-unit ``linear_fc1`` weight (or bias) as upstream does: the global
    tensor is ``[W; V]`` (``act(x W) * (x V)``) along the output axis (global axis ``len(sharded_offsets)``); a TP
    rank's local ``[W_r; V_r]`` is two chunks of it, ``W_r`` at fragment ``tp_rank`` and ``V_r`` at ``tp_size +
    tp_rank`` of ``2 * tp_size`` (upstream's swiglu factory). ``original`` is the plain ShardedTensor of this rank's
    parameter (TP fragment ``(tp_rank, tp_size)`` on that axis; explicit offsets for a Megatron-FSDP row shard of it,
    which is cut where it crosses the boundary between its halves). Loading concatenates the loaded pieces back
    (``merge_fn`` receives the list ``build_fn`` built)."""
    from megatron.core.dist_checkpointing import ShardedTensor, ShardedTensorFactory

    axis = len(tuple(sharded_offsets))
    if original.prepend_axis_num != axis:
        raise ValueError(f"{original.key}: {original.prepend_axis_num} prepended axes, sharded_offsets has {axis}")
    start, global_rows = original.global_offset[axis], original.global_shape[axis]
    if global_rows % (2 * tp_size):
        raise ValueError(f"{original.key}: gated linear unit fc1 has {global_rows} rows, not divisible by 2 x "
                         f"tensor-parallel size {tp_size}")
    tp_rows = global_rows // tp_size  # rows of this TP rank's [W_r; V_r]
    local_start = start - tp_rank * tp_rows  # where the shard starts inside [W_r; V_r]
    half, tp_half = global_rows // 2, tp_rows // 2
    regular = original.has_regular_grid and local_start == 0 and original.local_shape[0] == tp_rows

    @torch.no_grad()
    def build_fn(key, t, replica_id, flattened_range):
        if flattened_range is not None:
            return _flat_halves(key, t.detach(), flattened_range, replica_id)
        t = t.detach()  # the pieces are views of the live parameter's storage, loaded in place, outside autograd
        if regular:  # upstream's chunks exactly: W_r and V_r in a 2 * tp grid on the output axis
            w, v = torch.chunk(t, 2, dim=0)
            return [
                ShardedTensor.from_rank_offsets(key, piece, *sharded_offsets, (axis, idx, 2 * tp_size),
                                                replica_id=replica_id, prepend_axis_num=axis)
                for idx, piece in ((tp_rank, w), (tp_size + tp_rank, v))
            ]
        rows = t.shape[0]
        lo, hi = local_start, local_start + rows
        pieces = []  # (row range in t, global first row)
        if min(hi, tp_half) > lo:
            pieces.append((0, min(hi, tp_half) - lo, tp_rank * tp_half + lo))
        if hi > max(lo, tp_half):
            a = max(lo, tp_half)
            pieces.append((a - lo, hi - lo, half + tp_rank * tp_half + (a - tp_half)))
        if not pieces:  # an empty shard
            pieces = [(0, 0, min(tp_rank * tp_half + lo, global_rows))]
        return [
            ShardedTensor.from_global_offsets(
                key, t[a:b], original.global_shape,
                original.global_offset[:axis] + (g,) + original.global_offset[axis + 1 :],
                replica_id=replica_id, prepend_axis_num=axis,
            )
            for a, b, g in pieces
        ]

    def _flat_halves(key, t, fr, replica_id):
        # the distributed optimizer's state: ``t`` is the flat slice ``fr`` of the whole (regular) parameter;
        # its parts in the first and the second half are flat slices of the two chunks
        if not regular:
            raise NotImplementedError(f"{key}: a flattened_range shard of an irregularly sharded gated fc1")
        n = t.numel() if fr.stop is None else fr.stop - fr.start
        half_numel = half * math.prod(original.local_shape[1:])
        out = []
        for i in range(2):
            a, b = max(fr.start, i * half_numel), min(fr.start + n, (i + 1) * half_numel)
            if a >= b:
                continue
            out.append(ShardedTensor.from_rank_offsets_flat(
                key, t[a - fr.start : b - fr.start], (half,) + tuple(original.local_shape[1:]), *sharded_offsets,
                (axis, i, 2), replica_id=replica_id, prepend_axis_num=axis,
                flattened_range=slice(a - i * half_numel, b - i * half_numel)))
        return out

    def merge_fn(loaded):
        return torch.cat(list(loaded), dim=0)

    return ShardedTensorFactory(original.key, original.data, build_fn, merge_fn, original.replica_id)


def apply_activation(config, x: torch.Tensor) -> torch.Tensor:
    """``act(x)``, or ``act(x1) * (x2 + glu_linear_offset)`` for the halves ``[x1, x2]`` of the last axis with
    ``gated_linear_unit``, where ``activation_func_clamp_value`` c first clamps ``x1`` to ``<= c`` and ``x2`` to
    ``[-c, c]`` (gpt-oss's clamped GLU with ``--quick-geglu``, upstream's formula). SwiGLU with
    ``config.bias_activation_fusion`` (``--bias-swiglu-fusion``, upstream's default) and neither offset nor clamp
    runs fused (``megatron.core.fusions.fused_bias_swiglu``: Transformer Engine's kernels on CUDA, fp32 torch ops
    else; only ``x`` is saved for backward)."""
    clamp, offset = getattr(config, "activation_func_clamp_value", None), getattr(config, "glu_linear_offset", 0.0)
    if use_fused_swiglu(config) and clamp is None and not offset:
        return swiglu_impl(x)
    act = config.activation_func
    if config.gated_linear_unit:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        if clamp is not None:
            x1, x2 = x1.clamp(max=clamp), x2.clamp(min=-clamp, max=clamp)
        return act(x1) * (x2 + offset if offset else x2)
    return act(x)


def activation_then_fc2(config, x: torch.Tensor, fc2, recompute_act: bool):
    """``fc2(apply_activation(x))``; with ``recompute_act`` (the experts' ``--recompute-modules moe_act``) the
    activation's output is discarded once ``fc2`` has saved it and recomputed in backward (upstream's
    ``CheckpointWithoutOutput``): it is stored once and only the activation runs twice."""
    if not recompute_act:
        return fc2(apply_activation(config, x))
    return checkpoint_without_output(functools.partial(apply_activation, config), fc2, x, preserve_rng_state=False)


@dataclass
class MLPSubmodules:
    """Upstream's MLP submodule spec; here it records the linear classes ``MLP`` builds."""

    linear_fc1: object = None
    linear_fc2: object = None
    activation_func: object = None


class MLP(MegatronModule):
    def __init__(
        self,
        config,
        ffn_hidden_size: Optional[int] = None,
        is_expert: bool = False,
        input_size: Optional[int] = None,
        fuse_input_layernorm: bool = False,
    ):
        super().__init__(config)
        self.input_size = input_size or config.hidden_size
        self.ffn_hidden_size = ffn_hidden_size or config.ffn_hidden_size
        self.is_expert = is_expert
        fc1_out = 2 * self.ffn_hidden_size if config.gated_linear_unit else self.ffn_hidden_size
        init = config_init_method(config)
        out_init = config_init_method(config, "output_layer_init_method")
        self.linear_fc1 = build_linear(
            config, "layernorm_column" if fuse_input_layernorm else "column", self.input_size, fc1_out,
            init_method=init, bias=config.add_bias_linear, is_expert=is_expert,
        )
        self.linear_fc2 = build_linear(
            config, "row", self.ffn_hidden_size, config.hidden_size, init_method=out_init,
            bias=config.add_bias_linear, is_expert=is_expert, skip_bias_add=True,
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """As MegatronModule's, with a gated ``linear_fc1`` weight/bias written in two chunks like upstream."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.config.gated_linear_unit:
            for name in ("weight", "bias"):
                key = f"{prefix}linear_fc1.{name}"
                if key in out:
                    fc1 = self.linear_fc1
                    out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, getattr(fc1, "tp_rank", 0),
                                                            getattr(fc1, "tp_size", 1))
        return out

    def forward(self, hidden_states: torch.Tensor):
        """Returns ``(output, bias or None)``: the fc2 bias is returned unadded, as upstream."""
        x, _ = self.linear_fc1(hidden_states)
        return activation_then_fc2(self.config, x, self.linear_fc2,
                                   self.is_expert and should_recompute(self.config, "moe_act"))
