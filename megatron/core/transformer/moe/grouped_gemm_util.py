"""Grouped-GEMM expert linears for ``--moe-grouped-gemm`` without Transformer Engine (``--transformer-impl local``);
with TE the experts are TE's ``GroupedLinear`` (``megatron.core.tensor_parallel.te_layers.TEColumnParallelGroupedLinear``).
Both run their GEMMs through ``megatron.core.fusions.grouped_mm.grouped_gemm`` (TE: unquantized bf16 on Hopper;
FP8/FP4 and expert tensor parallelism stay on TE's grouped GEMM).

``ColumnParallelGroupedLinear`` / ``RowParallelGroupedLinear`` hold one weight per local expert under TE
``GroupedLinear``'s names (``weight0 .. weight{n-1}``, ``bias0 ..``), split over the expert tensor-parallel group
like the local linears (column: ``[out / tp, in]``; row: ``[out, in / tp]``, bias replicated, added after the
all-reduce). They add each expert's bias to its rows themselves and return ``(output, None)``.

Initialisation does not depend on the expert parallel size: ``reset_parameters`` draws every GLOBAL expert's weight
in order, keeping this rank's and drawing the others' into a scratch tensor, so a layer at EP=k holds the same
experts as at EP=1 built from the same seed.
"""
import re
from typing import Callable, List, Sequence

import torch

from megatron.core import parallel_state
from megatron.core.init_contract import InitialisedOnConstruction
from megatron.core.fusions.grouped_mm import add_grouped_bias, grouped_gemm
from megatron.core.tensor_parallel.layers import _init_split, set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.utils import divide, tp_group_info
from megatron.core.transformer.utils import set_param_attrs

_EXTRA_STATE_N = re.compile(r"_extra_state\d+$")


class _GroupedLinearBase(InitialisedOnConstruction, torch.nn.Module):
    partition_dim = 0

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config, init_method: Callable,
                 bias: bool = True, skip_bias_add: bool = False, is_expert: bool = True, **unused):
        super().__init__()
        if not is_expert:
            raise ValueError(f"{type(self).__name__} holds experts (is_expert=True)")
        if skip_bias_add:
            raise ValueError(f"{type(self).__name__} adds each expert's bias itself (skip_bias_add=False)")
        self.config = config
        self.num_gemms = num_gemms
        self.input_size, self.output_size = input_size, output_size
        self.init_method = init_method
        self.is_expert = True
        self.use_bias = bias
        self.tp_group, self.tp_size, self.tp_rank = tp_group_info(True)
        self.ep_size = parallel_state.get_expert_model_parallel_world_size()
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        what = f"{type(self).__name__}({input_size}, {output_size})"
        if self.partition_dim == 0:
            w_shape = (divide(output_size, self.tp_size, f"{what} output size over expert tensor-parallel ranks"),
                       input_size)
        else:
            w_shape = (output_size, divide(input_size, self.tp_size, f"{what} input size over expert tensor-parallel "
                                                                     "ranks"))
        b_size = w_shape[0]
        dtype = config.params_dtype
        for i in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(w_shape, dtype=dtype))
            set_tensor_model_parallel_attributes(w, True, self.partition_dim)
            self.register_parameter(f"weight{i}", w)
            if bias:
                b = torch.nn.Parameter(torch.empty(b_size, dtype=dtype))
                set_tensor_model_parallel_attributes(b, self.partition_dim == 0, 0)
                self.register_parameter(f"bias{i}", b)
        set_param_attrs(self.parameters(recurse=False), allreduce=False)

    @property
    def weights(self) -> List[torch.Tensor]:
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    @property
    def biases(self) -> List[torch.Tensor]:
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else []

    def reset_parameters(self) -> None:
        """Every global expert's draw in order, this rank's kept (see the module docstring); biases zero."""
        with torch.no_grad():
            if self.config.perform_initialization:
                offset, weights = self.ep_rank * self.num_gemms, self.weights
                scratch = None
                for g in range(self.ep_size * self.num_gemms):
                    i = g - offset
                    if 0 <= i < self.num_gemms:
                        w = weights[i]
                    else:
                        scratch = torch.empty_like(weights[0]) if scratch is None else scratch
                        w = scratch
                    _init_split(w, self.init_method, self.partition_dim, self.config, self.tp_size, self.tp_rank,
                                True)
            for b in self.biases:
                b.zero_()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # a checkpoint holds one ``_extra_state`` per expert (``_extra_state``, ``_extra_state1``, ... as upstream's
        # TEGroupedLinear); a local linear has none: accepted and ignored, and not required
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for key in [k for k in unexpected_keys if k.startswith(prefix) and _EXTRA_STATE_N.fullmatch(k[len(prefix):])]:
            unexpected_keys.remove(key)

    def set_extra_state(self, state) -> None:
        """Ignored: a local linear has no extra state (checkpoints hold None, or TE's state if TE wrote them)."""

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in={self.input_size}, out={self.output_size}, bias={self.use_bias}, "
                f"tp={self.tp_size}")


class ColumnParallelGroupedLinear(_GroupedLinearBase):
    """Per-expert ``Y_i = X_i A_i^T + b_i``, A_i split by output rows over the expert TP group."""

    partition_dim = 0

    def forward(self, x: torch.Tensor, m_splits: Sequence[int]):
        if self.tp_size > 1:
            x = copy_to_tensor_model_parallel_region(x, group=self.tp_group)
        out = grouped_gemm(x, self.weights, m_splits)
        if self.use_bias:
            out = add_grouped_bias(out, self.biases, m_splits)
        return out, None


class RowParallelGroupedLinear(_GroupedLinearBase):
    """Per-expert ``Y_i = X_i A_i^T + b_i``, A_i split by input columns over the expert TP group (partial products
    all-reduced, then the replicated bias added)."""

    partition_dim = 1

    def forward(self, x: torch.Tensor, m_splits: Sequence[int]):
        out = grouped_gemm(x, self.weights, m_splits)
        if self.tp_size > 1:
            out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        if self.use_bias:
            out = add_grouped_bias(out, self.biases, m_splits)
        return out, None
