"""LayerNorm / RMSNorm in plain torch, with the init contract (``reset_parameters``) and parameter attributes.

With sequence parallelism a norm sees only this rank's ``s / tp`` tokens: its parameters are marked
``sequence_parallel=True`` and ``finalize_model_grads`` all-reduces their gradients over the tensor-parallel group.

Where upstream builds a Transformer Engine norm (``TENorm``: the block's ``final_layernorm`` whenever TE is importable,
a TE MoE layer's ``pre_mlp_layernorm``), its checkpoints carry that norm's ``_extra_state`` object, and upstream's
load requires it. A norm built with ``te_extra_state=True`` writes the same object (an empty uint8 tensor: what a TE
norm without quantizer state writes) in ``sharded_state_dict``; ``state_dict()`` stays the parameters, and a loaded
``_extra_state`` (TE's, None, or absent) is accepted and ignored."""
import torch
import torch.nn.functional as F

from megatron.core.init_contract import InitialisedOnConstruction
from megatron.core.tensor_parallel.utils import IgnoresExtraState
from megatron.core.transformer.identity_op import IdentityOp  # noqa: F401 (the norm slot TE fuses; importable here too)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint, set_param_attrs


class _NormBase(InitialisedOnConstruction, IgnoresExtraState, torch.nn.Module):
    """What LayerNorm and RMSNorm share: ``eps`` (default ``config.layernorm_epsilon``) and a ``[hidden_size]``
    weight with its parameter attributes."""

    def __init__(self, config, hidden_size: int, eps: float = None, te_extra_state: bool = False):
        super().__init__()
        self.config = config
        self.te_extra_state = te_extra_state
        self.hidden_size = hidden_size
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=config.params_dtype))
        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        set_param_attrs((self.weight,), sequence_parallel=self.sequence_parallel, allreduce=True)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"

    def _zero_centered(self) -> bool:
        """``--apply-layernorm-1p`` (upstream's ``layernorm_zero_centered_gamma``, TE's ``zero_centered_gamma``): the
        stored weight is ``gamma - 1`` (initialized to 0, decayed towards 0), the norm scales by ``1 + weight``."""
        return bool(getattr(self.config, "layernorm_zero_centered_gamma", False))

    def _gamma_init(self) -> float:
        return 0.0 if self._zero_centered() else 1.0

    def _gamma(self) -> torch.Tensor:
        return self.weight + 1 if self._zero_centered() else self.weight

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        sd = self.state_dict(keep_vars=True)
        if self.te_extra_state:
            sd[torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX] = torch.empty(0, dtype=torch.uint8)
        return make_sharded_tensors_for_checkpoint(sd, prefix, sharded_offsets=sharded_offsets)



class LayerNorm(_NormBase):
    def __init__(self, config, hidden_size: int, eps: float = None, te_extra_state: bool = False):
        super().__init__(config, hidden_size, eps, te_extra_state)
        self.bias = torch.nn.Parameter(torch.empty(hidden_size, dtype=config.params_dtype))
        set_param_attrs((self.bias,), sequence_parallel=self.sequence_parallel, allreduce=True)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(self._gamma_init())
            self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), self._gamma(), self.bias, self.eps)


class RMSNorm(_NormBase):
    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(self._gamma_init())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.hidden_size,), self._gamma(), self.eps)


def build_norm(config, hidden_size: int, eps: float = None, te_extra_state: bool = False) -> torch.nn.Module:
    """The norm named by ``config.normalization`` ('LayerNorm' | 'RMSNorm'); ``te_extra_state``: it stands where
    upstream builds a TE norm (see the module docstring)."""
    if config.normalization == "LayerNorm":
        return LayerNorm(config, hidden_size, eps, te_extra_state)
    if config.normalization == "RMSNorm":
        return RMSNorm(config, hidden_size, eps, te_extra_state)
    raise ValueError(f"unknown normalization {config.normalization!r} (--normalization)")


class WrappedTorchNorm:
    """Upstream's local-spec norm: ``WrappedTorchNorm(config, hidden_size, eps)`` builds the norm named by
    ``config.normalization`` (``build_norm``)."""

    def __new__(cls, config, hidden_size: int, eps: float = None, **kwargs):
        return build_norm(config, hidden_size, eps)


LNImpl = WrappedTorchNorm
