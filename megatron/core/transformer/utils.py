"""Helpers shared by the model code: init methods, the init contract, sharded-state-dict builders, devices."""
import math
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch

from megatron.core import parallel_state


# ---- devices ----------------------------------------------------------------------------------------------
def get_default_device() -> torch.device:
    """The device for tensors that must be real even under ``with torch.device('meta')`` (e.g. ``expert_bias``):
    the current CUDA device if CUDA is available, else the CPU. Pass it EXPLICITLY to factory functions."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ambient_device() -> torch.device:
    """The device a factory call without ``device=`` would use now (meta inside ``with torch.device('meta')``)."""
    return torch.empty(0).device


# ---- init methods -----------------------------------------------------------------------------------------
def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """``normal_(t, 0, sigma)`` from the global torch RNG."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int, multiplier: float = 2.0):
    """``normal_(t, 0, sigma / sqrt(multiplier * num_layers))``, used for the output projections of each layer."""
    return init_method_normal(sigma / math.sqrt(multiplier * num_layers))


def init_weights(model: torch.nn.Module) -> None:
    """The init contract: call ``reset_parameters()`` of every module (in ``model.modules()`` order) that has one.

    Each ``reset_parameters`` initialises only that module's direct parameters from the global torch RNG, so
    materialising a meta-built model module by module in the same order and calling ``reset_parameters`` gives
    bit-identical values. Does nothing when the model was built on the meta device (all its parameters are meta;
    materialisation does it then). TE layers are always built on meta (deferred init); their
    ``reset_parameters`` materialises them, so an eager model with TE layers is initialised here.
    """
    params = list(model.parameters())
    if params and all(p.is_meta for p in params):
        return
    with torch.no_grad():
        for m in model.modules():
            fn = getattr(m, "reset_parameters", None)
            if callable(fn):
                fn()


def set_param_attrs(params: Iterable[Optional[torch.Tensor]], **attrs) -> None:
    for p in params:
        if p is not None:
            for k, v in attrs.items():
                setattr(p, k, v)


# ---- sharded state dict ---------------------------------------------------------------------------------
def _dp_replica_id() -> Tuple[int, int, int]:
    return (0, 0, parallel_state.get_data_parallel_rank())


def make_sharded_tensor_for_checkpoint(tensor, key: str, prepend_offsets=(), replica_id=None, **kwargs):
    """A ShardedTensor of a tensor replicated over data-parallel ranks (TP size 1)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    if replica_id is None:
        replica_id = _dp_replica_id()
    return ShardedTensor.from_rank_offsets(
        key, tensor, *prepend_offsets, replica_id=replica_id, prepend_axis_num=len(prepend_offsets), **kwargs
    )


def make_sharded_object_for_checkpoint(obj, key: str, sharded_offsets=(), replica_id=None, **kwargs):
    """A ShardedObject (e.g. TE ``_extra_state``), one per model (global shape (1,)) replicated over DP ranks."""
    from megatron.core.dist_checkpointing import ShardedObject

    if replica_id is None:
        replica_id = _dp_replica_id()
    return ShardedObject(key, obj, (1,), (0,), replica_id=replica_id, **kwargs)


def make_sharded_tensors_for_checkpoint(
    state_dict: Dict[str, object],
    prefix: str,
    tensor_parallel_layers_axis_map: Optional[Dict[str, int]] = None,
    sharded_offsets: Iterable[Tuple[int, int, int]] = (),
    extra_state_suffix: str = "_extra_state",
) -> Dict[str, object]:
    """``{prefix + key: ShardedTensor | ShardedObject}`` for a module's local ``state_dict``.

    Tensors become ShardedTensors replicated over data-parallel ranks (tensor parallel size is 1 here, so the axis
    map is accepted for API compatibility only); ``*_extra_state`` entries become ShardedObjects.
    """
    sharded_offsets = tuple(sharded_offsets)
    out = {}
    for key, value in state_dict.items():
        full = f"{prefix}{key}"
        if key.endswith(extra_state_suffix):
            out[full] = make_sharded_object_for_checkpoint(value, full, sharded_offsets)
        elif isinstance(value, torch.Tensor):
            out[full] = make_sharded_tensor_for_checkpoint(value, full, sharded_offsets)
        else:
            raise TypeError(f"make_sharded_tensors_for_checkpoint: state dict entry {full!r} is a {type(value)}")
    return out
