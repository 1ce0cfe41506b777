"""LayerNorm / RMSNorm in plain torch, with the init contract (``reset_parameters``) and parameter attributes.

With sequence parallelism a norm sees only this rank's ``s / tp`` tokens: its parameters are marked
``sequence_parallel=True`` and ``finalize_model_grads`` all-reduces their gradients over the tensor-parallel group."""
import torch
import torch.nn.functional as F

from megatron.core.transformer.utils import set_param_attrs


class _NormBase(torch.nn.Module):
    """What LayerNorm and RMSNorm share: ``eps`` (default ``config.layernorm_epsilon``) and a ``[hidden_size]``
    weight with its parameter attributes."""

    def __init__(self, config, hidden_size: int, eps: float = None):
        super().__init__()
        self.config = config
        self.hidden_size = hidden_size
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=config.params_dtype))
        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        set_param_attrs((self.weight,), sequence_parallel=self.sequence_parallel, allreduce=True)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class LayerNorm(_NormBase):
    def __init__(self, config, hidden_size: int, eps: float = None):
        super().__init__(config, hidden_size, eps)
        self.bias = torch.nn.Parameter(torch.empty(hidden_size, dtype=config.params_dtype))
        set_param_attrs((self.bias,), sequence_parallel=self.sequence_parallel, allreduce=True)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)
            self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)


class RMSNorm(_NormBase):
    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)


def build_norm(config, hidden_size: int, eps: float = None) -> torch.nn.Module:
    """The norm named by ``config.normalization`` ('LayerNorm' | 'RMSNorm')."""
    if config.normalization == "LayerNorm":
        return LayerNorm(config, hidden_size, eps)
    if config.normalization == "RMSNorm":
        return RMSNorm(config, hidden_size, eps)
    raise ValueError(f"unknown normalization {config.normalization!r} (--normalization)")


class IdentityOp(torch.nn.Module):
    """Stands in for a norm that a fused TE LayerNormLinear already applies."""

    def forward(self, x, *args, **kwargs):
        return x
