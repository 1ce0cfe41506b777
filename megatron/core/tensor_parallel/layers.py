"""Linear and embedding layers with upstream's tensor-parallel names and call conventions, at TP size 1.

``ColumnParallelLinear`` / ``RowParallelLinear`` return ``(output, bias)`` like upstream: ``bias`` is None unless
``skip_bias_add`` (then the caller adds it). Parameters are allocated on the ambient device (meta inside
``with torch.device('meta')``), uninitialised: ``reset_parameters()`` initialises them (the init contract,
see ``megatron.core.transformer.utils.init_weights``).
"""
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core.transformer.utils import set_param_attrs


def _check_tp(config):
    tp = getattr(config, "tensor_model_parallel_size", 1)
    if tp != 1:
        raise ValueError(f"tensor_model_parallel_size={tp}: this fork supports tensor parallel size 1 only")


class _LinearBase(torch.nn.Module):
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
    ):
        super().__init__()
        _check_tp(config)
        self.config = config
        self.input_size = input_size
        self.output_size = output_size
        self.init_method = init_method
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        dtype = config.params_dtype
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(output_size, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        set_param_attrs((self.weight, self.bias), allreduce=not is_expert)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.weight is not None and self.config.perform_initialization:
                self.init_method(self.weight)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None):
        if weight is None:
            weight = self.weight
            if weight is None:
                raise RuntimeError(
                    f"{type(self).__name__} was built with skip_weight_param_allocation=True: pass weight= to forward"
                )
        if self.skip_bias_add:
            return F.linear(input_, weight), self.bias
        return F.linear(input_, weight, self.bias), None

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, expert={self.is_expert}"

    # Upstream's local linears carry an (always None) ``_extra_state`` so that their checkpoints have TE's keys: one
    # ``_extra_state`` ShardedObject per linear (stacked per layer, per expert). It is in ``sharded_state_dict`` only:
    # ``state_dict()`` stays the parameters (``get_extra_state`` is not overridden), while ``load_state_dict``
    # accepts the key (a loaded checkpoint's, None or TE's state) and ignores it, and does not require it.
    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        sd = self.state_dict(keep_vars=True)
        sd[torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX] = None
        return make_sharded_tensors_for_checkpoint(sd, prefix, {"weight": 0, "bias": 0}, sharded_offsets)

    def set_extra_state(self, state) -> None:
        """Ignored: a local linear has no extra state (checkpoints hold None, or TE's state if TE wrote them)."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = prefix + torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX
        if key in missing_keys:
            missing_keys.remove(key)


class ColumnParallelLinear(_LinearBase):
    """``Y = X A^T + b`` with A split by rows over TP ranks upstream; here TP size is 1 (no communication)."""

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
        )
        self.gather_output = gather_output


class RowParallelLinear(_LinearBase):
    """``Y = X A^T + b`` with A split by columns over TP ranks upstream; here TP size is 1 (no communication)."""

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
        )
        self.input_is_parallel = input_is_parallel
        set_param_attrs((self.bias,), sequence_parallel=False)


class VocabParallelEmbedding(torch.nn.Module):
    """Word embedding ``[num_embeddings, embedding_dim]`` (vocab split over TP ranks upstream; TP size 1 here)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: Callable, config, **unused):
        super().__init__()
        _check_tp(config)
        self.config = config
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.init_method = init_method
        self.weight = torch.nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=config.params_dtype))
        set_param_attrs((self.weight,), allreduce=True)

    def reset_parameters(self) -> None:
        if self.config.perform_initialization:
            with torch.no_grad():
                self.init_method(self.weight)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
