"""MLP: ``fc2(act(fc1(x)))``, or gated (``act(x W1) * (x V)``, e.g. SwiGLU) with ``gated_linear_unit``."""
import math
from typing import Optional

import torch

from megatron.core.transformer.attention import build_linear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import init_method_normal, scaled_init_method_normal


def apply_swiglu_sharded_factory(original, sharded_offsets=()):
    """A ShardedTensorFactory writing a gated-linear-unit ``linear_fc1`` weight (or bias) as upstream does: its two
    halves (``W`` and ``V`` of ``act(x W) * (x V)``) are separate chunks along the output axis (global axis
    ``len(sharded_offsets)``) of the same global tensor. ``original`` is the plain ShardedTensor of the whole
    parameter (a regular grid for a replicated tensor, explicit offsets for a Megatron-FSDP row shard, which is cut
    where it crosses the boundary between the halves). Loading concatenates the loaded pieces back (``merge_fn``
    receives the list ``build_fn`` built)."""
    from megatron.core.dist_checkpointing import ShardedTensor, ShardedTensorFactory

    axis = len(tuple(sharded_offsets))
    if original.prepend_axis_num != axis:
        raise ValueError(f"{original.key}: {original.prepend_axis_num} prepended axes, sharded_offsets has {axis}")
    start, global_rows = original.global_offset[axis], original.global_shape[axis]
    if global_rows % 2:
        raise ValueError(f"{original.key}: gated linear unit fc1 has an odd number of rows {global_rows}")
    half = global_rows // 2
    regular = original.has_regular_grid and start == 0 and original.local_shape[0] == global_rows

    @torch.no_grad()
    def build_fn(key, t, replica_id, flattened_range):
        if flattened_range is not None:
            return _flat_halves(key, t.detach(), flattened_range, replica_id)
        t = t.detach()  # the pieces are views of the live parameter's storage, loaded in place, outside autograd
        if regular:  # upstream's chunks exactly: the two halves of a 2-piece grid on the output axis
            w, v = torch.chunk(t, 2, dim=0)
            return [
                ShardedTensor.from_rank_offsets(key, piece, *sharded_offsets, (axis, i, 2), replica_id=replica_id,
                                                prepend_axis_num=axis)
                for i, piece in enumerate((w, v))
            ]
        rows = t.shape[0]
        bounds = [(max(lo, start), min(hi, start + rows)) for lo, hi in ((0, half), (half, global_rows))]
        bounds = [(a, b) for a, b in bounds if b > a] or [(min(start, global_rows),) * 2]  # an empty shard
        return [
            ShardedTensor.from_global_offsets(
                key, t[a - start : b - start], original.global_shape,
                original.global_offset[:axis] + (a,) + original.global_offset[axis + 1 :],
                replica_id=replica_id, prepend_axis_num=axis,
            )
            for a, b in bounds
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
        init = init_method_normal(config.init_method_std)
        out_init = scaled_init_method_normal(config.init_method_std, config.num_layers)
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
                    out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets)
        return out

    def forward(self, hidden_states: torch.Tensor):
        """Returns ``(output, bias or None)``: the fc2 bias is returned unadded, as upstream."""
        x, _ = self.linear_fc1(hidden_states)
        act = self.config.activation_func
        if self.config.gated_linear_unit:
            x1, x2 = torch.chunk(x, 2, dim=-1)
            x = act(x1) * x2
        else:
            x = act(x)
        return self.linear_fc2(x)
