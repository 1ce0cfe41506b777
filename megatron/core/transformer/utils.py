"""Helpers shared by the model code: init methods, the init contract, devices, sharded-key prefixes.

The sharded-state-dict builders live below the model stack, in ``megatron/core/tensor_parallel/sharded_tensors.py``
(``set_param_attrs`` in ``tensor_parallel/utils.py``, the DTensor check in ``megatron/core/dtensor_utils.py``); their
names stay importable from here, where upstream has them.
"""
import math
from typing import Callable, Dict

import torch

from megatron.core.dtensor_utils import is_dtensor  # noqa: F401 (re-exported)
from megatron.core.init_contract import ambient_device, init_weights  # noqa: F401 (their home: init_contract.py)
from megatron.core.tensor_parallel.random import checkpoint
from megatron.core.tensor_parallel.sharded_tensors import (  # noqa: F401 (re-exported)
    extra_state_shape_and_offset,
    make_sharded_object_for_checkpoint,
    make_sharded_tensor_for_checkpoint,
    make_sharded_tensors_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)
from megatron.core.tensor_parallel.utils import set_param_attrs  # noqa: F401 (re-exported)


# ---- init methods -----------------------------------------------------------------------------------------
class NormalInit:
    """``normal_(t, 0, std)`` from the global torch RNG: an init method that compares equal by its ``std`` (so two
    ``TransformerConfig`` built alike, whose ``init_method`` defaults are these, are equal) and pickles."""

    def __init__(self, std: float):
        self.std = std

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=self.std)

    def __eq__(self, other) -> bool:
        return isinstance(other, NormalInit) and other.std == self.std

    def __hash__(self) -> int:
        return hash(("NormalInit", self.std))

    def __repr__(self) -> str:
        return f"NormalInit(std={self.std!r})"


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """``normal_(t, 0, sigma)`` from the global torch RNG."""
    return NormalInit(sigma)


def scaled_init_method_normal(sigma: float, num_layers: int, multiplier: float = 2.0):
    """``normal_(t, 0, sigma / sqrt(multiplier * num_layers))``, used for the output projections of each layer."""
    return init_method_normal(sigma / math.sqrt(multiplier * num_layers))


def config_init_method(config, name: str = "init_method") -> Callable[[torch.Tensor], torch.Tensor]:
    """The config's ``init_method`` / ``output_layer_init_method`` / ``embedding_init_method`` (upstream's fields,
    which ``TransformerConfig.__post_init__`` fills from ``init_method_std`` unless given); for a duck-typed config
    without them, upstream's default from ``init_method_std``."""
    method = getattr(config, name, None)
    if method is not None:
        return method
    if name == "output_layer_init_method":
        return scaled_init_method_normal(config.init_method_std, config.num_layers)
    if name == "embedding_init_method":
        return init_method_normal(getattr(config, "embedding_init_method_std", None) or config.init_method_std)
    return init_method_normal(config.init_method_std)


# ---- activation recompute (``--recompute-granularity``): TE's checkpoint under FP8/FP4, else tensor_parallel's
def recompute(config, function, *args, parameter_free: bool = False, preserve_rng_state: bool = True):
    """``checkpoint(function, ...)``; with FP8/FP4 (Transformer Engine) TE's checkpoint, whose recompute sees the
    FP8 scales of the original forward. ``parameter_free``: ``function`` uses no parameters and no TE module (core
    attention), so the lighter ``checkpoint_parameter_free`` does, whatever the precision; ``preserve_rng_state``
    there: whether it draws random numbers (dropout)."""
    if parameter_free:
        from megatron.core.tensor_parallel.random import checkpoint_parameter_free

        return checkpoint_parameter_free(function, *args, preserve_rng_state=preserve_rng_state)
    if config.transformer_impl == "transformer_engine" and (config.fp8 is not None or config.fp4 is not None):
        from megatron.core.tensor_parallel.te_layers import te_checkpoint
        from megatron.core.tensor_parallel.random import _counted_as_checkpointed

        return te_checkpoint(_counted_as_checkpointed(function), *args)
    return checkpoint(function, config.distribute_saved_activations, *args)


# ---- sharded keys (the checkpoint key of each ShardedTensor / ShardedObject, not the dict key) --------------
def _sharded_leaves(sharded_state_dict: dict):
    """The ShardedTensor / ShardedObject / ShardedTensorFactory values of a flat or nested sharded state dict."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return [v for v in nested_values(sharded_state_dict) if isinstance(v, (ShardedTensor, ShardedObject,
                                                                           ShardedTensorFactory))]


def replace_prefix_for_sharding(sharded_state_dict: dict, old_prefix: str, new_prefix: str) -> None:
    """In place: every sharded value's ``.key`` (the checkpoint key, not the dict key) must start with
    ``old_prefix``, which becomes ``new_prefix`` (e.g. ``decoder.layers.0.`` -> ``decoder.layers.``)."""
    for sh in _sharded_leaves(sharded_state_dict):
        if not sh.key.startswith(old_prefix):
            raise ValueError(f"sharded key {sh.key!r} does not start with the prefix {old_prefix!r} to replace")
        sh.key = new_prefix + sh.key[len(old_prefix):]


def apply_prefix_mapping(sharded_state_dict: dict, prefix_map: Dict[str, str]) -> None:
    """In place: a sharded value whose ``.key`` starts with a key of ``prefix_map`` gets that prefix replaced by its
    value (the first match, in ``prefix_map`` order); other keys stay."""
    for sh in _sharded_leaves(sharded_state_dict):
        for old, new in prefix_map.items():
            if sh.key.startswith(old):
                sh.key = new + sh.key[len(old):]
                break


# ---- sliding-window attention (``--window-size``, ``--window-attn-skip-freq``) ------------------------------------
def is_layer_window_attention(window_size, window_attn_skip_freq, layer_number: int) -> bool:
    """Whether layer ``layer_number`` (1-based, global) uses sliding-window attention, upstream's rule: never
    without ``window_size``; every layer without ``window_attn_skip_freq``; an int N: every layer but each N-th
    (``layer_number % N == 0`` is full attention); a list: entry ``layer_number - 1`` (1: window, 0: full)."""
    if not window_size:
        return False
    if window_attn_skip_freq is None:
        return True
    if isinstance(window_attn_skip_freq, int):
        return layer_number % window_attn_skip_freq != 0
    if isinstance(window_attn_skip_freq, (list, tuple)):
        return bool(window_attn_skip_freq[layer_number - 1])
    raise ValueError(f"window_attn_skip_freq (--window-attn-skip-freq) must be an int or a list of 0/1, got "
                     f"{window_attn_skip_freq!r}")
