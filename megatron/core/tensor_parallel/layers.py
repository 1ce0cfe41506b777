"""Linear and embedding layers split over tensor-parallel (TP) ranks, with upstream's names and call conventions.

``ColumnParallelLinear`` (``Y = X A^T + b``, A and b split by output rows: weight ``[out / tp, in]``) and
``RowParallelLinear`` (A split by input columns: weight ``[out, in / tp]``, b replicated) return ``(output, bias)``
like upstream: ``bias`` is None unless ``skip_bias_add`` (then the caller adds it). Column: the input enters the TP
region (``copy_to_``; with ``sequence_parallel`` an all-gather of the ``[s / tp, b, h]`` input), the output stays
split unless ``gather_output``. Row: the input is the split activation (``input_is_parallel``, else it is scattered);
the partial products are all-reduced, or reduce-scattered to ``[s / tp, b, h]`` with ``sequence_parallel``.
``VocabParallelEmbedding`` holds a contiguous slice of the vocabulary; ids outside it give zeros, then the
partial embeddings are all-reduced (or reduce-scattered into the sequence-parallel region).

The group is the tensor-parallel group (the expert tensor-parallel group for ``is_expert``), size 1 before
``parallel_state.initialize_model_parallel``; ``config.tensor_model_parallel_size`` must match it. Parameters are
allocated on the ambient device (meta inside ``with torch.device('meta')``); ``reset_parameters()`` initialises them,
run by the outermost construction (a layer built on its own initialises itself, as upstream's; see
``megatron/core/init_contract.py``). TP-split weights draw
from the model-parallel RNG tracker (different per TP rank, as upstream) or, with ``config.use_cpu_initialization``,
are sliced from a full master weight drawn from the default generator (the same values at every TP size).
Split parameters carry ``tensor_model_parallel=True``, ``partition_dim``, ``partition_stride`` (upstream's
attributes); parameters computed on the sequence-parallel region carry ``sequence_parallel=True``.
"""
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core.init_contract import InitialisedOnConstruction
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import (
    _EXPERT_PARALLEL_RNG_TRACKER_NAME,
    _MODEL_PARALLEL_RNG_TRACKER_NAME,
    model_parallel_rng_context,
)
from megatron.core.tensor_parallel.sharded_tensors import (
    make_sharded_tensors_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)
from megatron.core.tensor_parallel.utils import (
    IgnoresExtraState,
    check_tp_size,
    divide,
    set_param_attrs,
    split_along_dim,
    tp_group_info,
    vocab_range,
)


def set_tensor_model_parallel_attributes(tensor, is_parallel: bool, dim: int, stride: int = 1) -> None:
    """Upstream's attributes of a (possibly) TP-split parameter."""
    set_param_attrs((tensor,), tensor_model_parallel=is_parallel, partition_dim=dim, partition_stride=stride)


# upstream's tensor-parallel attributes of a parameter, with the value a parameter without them stands for
_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {
    "expert_tp": False,
    "is_qkv": False,
    "qkv_split_shapes": None,
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor) -> None:
    """Give ``tensor`` each tensor-parallel attribute it lacks, at its default (a replicated parameter)."""
    for name, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, value)


def copy_tensor_model_parallel_attributes(destination_tensor, source_tensor) -> None:
    """Copy the tensor-parallel attributes ``source_tensor`` has onto ``destination_tensor`` (e.g. a main fp32
    copy of a model parameter)."""
    for name in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, name):
            setattr(destination_tensor, name, getattr(source_tensor, name))


def param_is_not_tensor_parallel_duplicate(param, tp_group=None, expert_tp_group=None) -> bool:
    """True for a TP-split parameter, or for a replicated one on TP rank 0: count each value once (grad norms).
    The group is upstream's choice: ``expert_tp_group`` (when given) for a parameter reduced over expert data
    parallel (``allreduce=False``), else ``tp_group`` when given, else parallel_state's (expert) TP group."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    is_expert = not getattr(param, "allreduce", True)
    if is_expert and expert_tp_group is not None:
        return expert_tp_group.rank() == 0
    if tp_group is not None:
        return tp_group.rank() == 0
    return tp_group_info(is_expert=is_expert)[2] == 0


def _init_split(weight, init_method, partition_dim: int, config, tp_size: int, tp_rank: int, is_expert: bool):
    """Initialise this rank's piece of a TP-split weight (see the module docstring)."""
    if tp_size > 1 and getattr(config, "use_cpu_initialization", False):
        shape = list(weight.shape)
        shape[partition_dim] *= tp_size
        master = torch.empty(shape, dtype=weight.dtype, device=weight.device)
        init_method(master)
        weight.copy_(split_along_dim(master, partition_dim, tp_size, tp_rank))
        return
    name = _EXPERT_PARALLEL_RNG_TRACKER_NAME if is_expert else _MODEL_PARALLEL_RNG_TRACKER_NAME
    with model_parallel_rng_context(name=name, tp_size=tp_size):
        init_method(weight)


class _LinearBase(InitialisedOnConstruction, IgnoresExtraState, torch.nn.Module):
    partition_dim = 0  # the axis of the weight split over TP ranks

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: Callable,
        bias: bool = True,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        is_expert: bool = False,
        tp_group=None,
        stride: int = 1,
    ):
        super().__init__()
        self.tp_group, self.tp_size, self.tp_rank = tp_group_info(is_expert, tp_group)
        name = type(self).__name__
        if not is_expert:
            check_tp_size(config, self.tp_size, name)
        if stride != 1:
            raise ValueError(f"{name}: stride={stride} is not supported (only 1)")
        self.config = config
        self.input_size = input_size
        self.output_size = output_size
        self.init_method = init_method
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False)) and self.tp_size > 1
        dtype = config.params_dtype
        what = f"{name}({input_size}, {output_size})"
        if self.partition_dim == 0:
            w_shape = (divide(output_size, self.tp_size, f"{what} output size over tensor-parallel ranks"), input_size)
            b_size = w_shape[0]
        else:
            w_shape = (output_size, divide(input_size, self.tp_size, f"{what} input size over tensor-parallel ranks"))
            b_size = output_size
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = torch.nn.Parameter(torch.empty(w_shape, dtype=dtype))
            set_tensor_model_parallel_attributes(self.weight, True, self.partition_dim)
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(b_size, dtype=dtype))
            set_tensor_model_parallel_attributes(self.bias, self.partition_dim == 0, 0)
        else:
            self.register_parameter("bias", None)
        set_param_attrs((self.weight, self.bias), allreduce=not is_expert)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.weight is not None and self.config.perform_initialization:
                _init_split(self.weight, self.init_method, self.partition_dim, self.config, self.tp_size,
                            self.tp_rank, self.is_expert)
            if self.bias is not None:
                self.bias.zero_()

    def _weight(self, weight):
        if weight is None:
            weight = self.weight
            if weight is None:
                raise RuntimeError(
                    f"{type(self).__name__} was built with skip_weight_param_allocation=True: pass weight= to forward"
                )
        return weight

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
                f"expert={self.is_expert}, tp={self.tp_size}, sequence_parallel={self.sequence_parallel}")

    # Upstream's local linears carry an (always None) ``_extra_state`` so that their checkpoints have TE's keys: one
    # ``_extra_state`` ShardedObject per linear (stacked per layer, per expert). It is in ``sharded_state_dict`` only:
    # ``state_dict()`` stays the parameters, and ``load_state_dict`` accepts and ignores the key (IgnoresExtraState).
    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        sd = self.state_dict(keep_vars=True)
        sd[torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX] = None
        axis_map = {"weight": 0, "bias": 0} if self.partition_dim == 0 else {"weight": 1}
        return make_sharded_tensors_for_checkpoint(sd, prefix, axis_map, sharded_offsets, tp_group=self.tp_group)



class ColumnParallelLinear(_LinearBase):
    """``Y = X A^T + b`` with A (and b) split by output rows over TP ranks (see the module docstring)."""

    partition_dim = 0

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: Callable,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group=None,
        **unused,
    ):
        super().__init__(
            input_size,
            output_size,
            config=config,
            init_method=init_method,
            bias=bias,
            skip_bias_add=skip_bias_add,
            skip_weight_param_allocation=skip_weight_param_allocation,
            is_expert=is_expert,
            tp_group=tp_group,
            stride=stride,
        )
        if gather_output and self.sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True cannot be combined with sequence_parallel")
        self.gather_output = gather_output

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None):
        weight = self._weight(weight)
        bias = None if self.skip_bias_add else self.bias
        if self.tp_size == 1:
            out = F.linear(input_, weight, bias)
        else:
            if self.sequence_parallel:
                x = gather_from_sequence_parallel_region(input_, group=self.tp_group)
            else:
                x = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
            out = F.linear(x, weight, bias)
            if self.gather_output:
                out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(_LinearBase):
    """``Y = X A^T + b`` with A split by input columns over TP ranks, b replicated (see the module docstring)."""

    partition_dim = 1

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: Callable,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group=None,
        **unused,
    ):
        super().__init__(
            input_size,
            output_size,
            config=config,
            init_method=init_method,
            bias=bias,
            skip_bias_add=skip_bias_add,
            is_expert=is_expert,
            tp_group=tp_group,
            stride=stride,
        )
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.input_is_parallel = input_is_parallel
        # the bias is added on the sequence-parallel region: its gradient is partial per TP rank
        set_param_attrs((self.bias,), sequence_parallel=self.sequence_parallel)

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None):
        weight = self._weight(weight)
        if self.tp_size == 1:
            out = F.linear(input_, weight, None if self.skip_bias_add else self.bias)
            return out, (self.bias if self.skip_bias_add else None)
        x = input_ if self.input_is_parallel else scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        out = F.linear(x, weight)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
        else:
            out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None


class VocabParallelEmbedding(InitialisedOnConstruction, torch.nn.Module):
    """Word embedding ``[num_embeddings / tp, embedding_dim]``: this rank's contiguous vocab slice (see the module
    docstring). ``reduce_scatter_embeddings``: the output is ``[s / tp, b, h]`` (transposed from the ``[b, s]`` ids
    and reduce-scattered on the sequence), as upstream; else ``[*ids.shape, h]``, all-reduced."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: Callable, config,
                 reduce_scatter_embeddings: bool = False, tp_group=None, **unused):
        super().__init__()
        self.tp_group, self.tp_size, self.tp_rank = tp_group_info(False, tp_group)
        check_tp_size(config, self.tp_size, "VocabParallelEmbedding")
        self.config = config
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.init_method = init_method
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.vocab_start_index, self.vocab_end_index = vocab_range(num_embeddings, self.tp_rank, self.tp_size)
        local = self.vocab_end_index - self.vocab_start_index
        self.weight = torch.nn.Parameter(torch.empty(local, embedding_dim, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0)
        set_param_attrs((self.weight,), allreduce=True)

    def reset_parameters(self) -> None:
        if self.config.perform_initialization:
            with torch.no_grad():
                _init_split(self.weight, self.init_method, 0, self.config, self.tp_size, self.tp_rank, False)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            out = F.embedding(input_, self.weight)
            if self.reduce_scatter_embeddings:
                out = out.transpose(0, 1).contiguous()
            return out
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(out.transpose(0, 1).contiguous(), group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(out, group=self.tp_group)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """The weight split on the vocab axis (``allow_shape_mismatch``: a padded vocab may differ, as upstream)."""
        key = f"{prefix}weight"
        return {key: make_tp_sharded_tensor_for_checkpoint(self.weight, key, 0, sharded_offsets,
                                                          tp_group=self.tp_group, allow_shape_mismatch=True)}

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}"
