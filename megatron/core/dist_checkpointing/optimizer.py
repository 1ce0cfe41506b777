"""Sharding of a plain ``torch.optim`` state dict after the model's sharding (upstream's
``dist_checkpointing.optimizer``): each state tensor of a parameter becomes a ShardedTensor placed like that
parameter's ShardedTensor, under ``optimizer.state.<state key>.<param key>``."""
import copy
import dataclasses
import logging
from typing import Dict, Iterable, Tuple, Union

import torch

from .dict_utils import nested_values
from .mapping import LocalNonpersistentObject, ShardedStateDict, ShardedTensor, ShardedTensorFactory, StateDict
from .utils import extract_sharded_tensors_and_factories

logger = logging.getLogger(__name__)

KEEP_VARS_HINT = (  # upstream's hint, appended where a parameter is not found in the model's sharded state dict
    " Make sure the state dict holds the original torch.nn.Parameters (not plain tensors) by passing"
    " `keep_vars=True` to `.state_dict()`; transform parameters with a ShardedTensorFactory."
)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) and type(t).__name__ == "DTensor" else t


def get_optim_param_to_id_map(optim_params_iter: Iterable[torch.Tensor]) -> Dict[int, int]:
    """{id(param): index of its first occurrence in ``optim_params_iter``} (the optimizer's state ids)."""
    out: Dict[int, int] = {}
    for i, param in enumerate(optim_params_iter):
        out.setdefault(id(_local(param)), i)
    return out


def get_param_id_to_sharded_param_map(
    model_sharded_state_dict: ShardedStateDict, optim_params_iter: Iterable[torch.Tensor]
) -> Dict[int, Union[ShardedTensor, ShardedTensorFactory]]:
    """{optimizer state id: the model's ShardedTensor/factory whose ``data`` is that parameter}. The model's sharded
    state dict must hold the parameters themselves (``state_dict(keep_vars=True)``), matched by identity; parameters
    absent from it are left out (a warning if nothing matches)."""
    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    param_to_id = get_optim_param_to_id_map(optim_params_iter)
    out = {}
    for sh in nested_values(sharded):
        idx = param_to_id.get(id(sh.data))
        if idx is not None:
            out[idx] = sh
    if not out:
        logger.warning("get_param_id_to_sharded_param_map: no model ShardedTensor holds an optimizer parameter."
                       + KEEP_VARS_HINT)
    return out


def make_sharded_optimizer_tensor(
    model_param: Union[ShardedTensor, ShardedTensorFactory], optim_param: torch.Tensor, prefix: str
) -> Union[ShardedTensor, ShardedTensorFactory]:
    """``model_param``'s placement for the optimizer tensor ``optim_param`` (its dtype), key ``<prefix>.<key>``.
    ValueError naming the key if the shapes differ."""
    optim_param = _local(optim_param)
    key = f"{prefix}.{model_param.key}"
    if isinstance(model_param, ShardedTensorFactory):
        return dataclasses.replace(model_param, key=key, data=optim_param)
    expected = (
        (model_param.flattened_range.stop - model_param.flattened_range.start,)
        if model_param.flattened_range is not None
        else tuple(model_param.local_shape)
    )
    if tuple(optim_param.shape) != expected:
        raise ValueError(
            f"{key}: optimizer tensor shape {tuple(optim_param.shape)} does not match the model shard's {expected}"
        )
    return dataclasses.replace(model_param, key=key, data=optim_param, dtype=optim_param.dtype)


def optim_state_to_sharding_state(
    optim_state_dict: StateDict,
    id_to_sharded_param_map: Dict[int, Union[ShardedTensor, ShardedTensorFactory]],
    exclude_keys: Tuple[str, ...] = (),
) -> None:
    """Turn a ``torch.optim`` state dict into a sharded one, in place: ``state[id][k]`` becomes
    ``make_sharded_optimizer_tensor(model shard of id, value, 'optimizer.state.<k>')`` (``exclude_keys`` dropped);
    the param groups are copied and their ``params`` wrapped in LocalNonpersistentObject (the loading optimizer
    keeps its own). ValueError naming the id if a state has no model shard."""
    sharded_state = {}
    for param_id, param_state in optim_state_dict["state"].items():
        if param_id not in id_to_sharded_param_map:
            raise ValueError(f"optimizer state id {param_id} does not match any model sharded parameter")
        model_param = id_to_sharded_param_map[param_id]
        sharded_state[param_id] = {
            k: make_sharded_optimizer_tensor(model_param, v, prefix=f"optimizer.state.{k}")
            for k, v in param_state.items()
            if k not in exclude_keys
        }
    optim_state_dict["param_groups"] = copy.deepcopy(optim_state_dict["param_groups"])
    for group in optim_state_dict["param_groups"]:
        group["params"] = LocalNonpersistentObject(group["params"])
    optim_state_dict["state"] = sharded_state
