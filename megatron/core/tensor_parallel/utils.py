"""Tensor-parallel helpers: the group a layer uses, exact division with a clear error, vocab ranges, the parameter
attributes a layer sets (``set_param_attrs``), and the ``_extra_state`` key that non-TE modules accept where
upstream's checkpoints have one. Upstream's public helpers of this module keep their names here too
(``split_tensor_along_last_dim``, ``split_tensor_into_1d_equal_chunks``, ``gather_split_1d_tensor``,
``VocabUtility``)."""
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_utils import get_rank, get_world_size, is_distributed


def divide(numerator: int, denominator: int, what: str = "") -> int:
    """``numerator // denominator``; raise naming ``what`` when it does not divide exactly."""
    if denominator <= 0 or numerator % denominator != 0:
        label = f"{what}: " if what else ""
        raise ValueError(f"{label}{numerator} is not divisible by {denominator}")
    return numerator // denominator


def tp_group_info(is_expert: bool = False, tp_group=None) -> Tuple[Optional[dist.ProcessGroup], int, int]:
    """``(group, size, rank)`` of the tensor-parallel group a layer uses: ``tp_group`` when given, else the expert
    tensor-parallel group for experts and the tensor-parallel group otherwise; ``(None, 1, 0)`` before
    ``parallel_state.initialize_model_parallel`` (a single-process model)."""
    if tp_group is None:
        if not (is_distributed() and parallel_state.model_parallel_is_initialized()):
            return None, 1, 0
        tp_group = (parallel_state.get_expert_tensor_parallel_group() if is_expert
                    else parallel_state.get_tensor_model_parallel_group())
        if tp_group is None:
            return None, 1, 0
    return tp_group, get_world_size(tp_group), get_rank(tp_group)


def set_param_attrs(params: Iterable[Optional[torch.Tensor]], **attrs) -> None:
    """Set ``attrs`` on every parameter of ``params`` that is not None (e.g. ``tensor_model_parallel``,
    ``allreduce``, ``sequence_parallel``)."""
    for p in params:
        if p is not None:
            for k, v in attrs.items():
                setattr(p, k, v)


def check_tp_size(config, size: int, what: str) -> None:
    """The layer's group must have ``config.tensor_model_parallel_size`` ranks (the flag and the groups agree)."""
    want = getattr(config, "tensor_model_parallel_size", 1)
    if size != want:
        raise ValueError(
            f"{what}: config.tensor_model_parallel_size={want} (--tensor-model-parallel-size) but the tensor-parallel "
            f"group has {size} rank(s); call parallel_state.initialize_model_parallel(tensor_model_parallel_size={want}) "
            "before building the model"
        )


def vocab_range(global_vocab_size: int, rank: int, world_size: int) -> Tuple[int, int]:
    """``[first, last)`` of the vocabulary rows held by ``rank`` (the vocab must divide evenly, as upstream)."""
    per = divide(global_vocab_size, world_size, "vocab size over tensor-parallel ranks (pad it: "
                 "--make-vocab-size-divisible-by)")
    return rank * per, (rank + 1) * per


def split_along_dim(t: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    """This rank's contiguous piece of ``t`` along ``dim`` (``size`` equal pieces)."""
    n = divide(t.shape[dim], size, f"dimension {dim} of a {tuple(t.shape)} tensor over {size} tensor-parallel ranks")
    return t.narrow(dim, rank * n, n).contiguous()


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> List[torch.Tensor]:
    """``num_partitions`` equal views of ``tensor`` along its last dimension (copies made contiguous with
    ``contiguous_split_chunks``)."""
    size = divide(tensor.shape[-1], num_partitions, f"last dimension of a {tuple(tensor.shape)} tensor")
    chunks = torch.split(tensor, size, dim=-1)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else chunks


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, new_buffer: bool = False, tp_group=None) -> torch.Tensor:
    """This tensor-parallel rank's equal piece of ``tensor`` flattened: a view, or a copy with ``new_buffer``."""
    group = get_tensor_model_parallel_group_if_none(tp_group)
    size, rank = get_world_size(group), get_rank(group)
    n = divide(tensor.numel(), size, f"{tensor.numel()} elements over {size} tensor-parallel ranks")
    piece = tensor.view(-1)[rank * n:(rank + 1) * n]
    return piece.clone() if new_buffer else piece


def gather_split_1d_tensor(tensor: torch.Tensor, tp_group=None) -> torch.Tensor:
    """The inverse of ``split_tensor_into_1d_equal_chunks``: every tensor-parallel rank's piece, concatenated in
    rank order (a new 1-D tensor)."""
    group = get_tensor_model_parallel_group_if_none(tp_group)
    size = get_world_size(group)
    flat = tensor.contiguous().view(-1)
    if size == 1:
        return flat.clone()
    out = torch.empty(flat.numel() * size, dtype=flat.dtype, device=flat.device)
    dist.all_gather_into_tensor(out, flat, group=group)
    return out


class VocabUtility:
    """``[first, last)`` vocabulary rows of a tensor-parallel rank (upstream's static helpers)."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                                  world_size: int) -> Sequence[int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> Sequence[int]:
        return vocab_range(global_vocab_size, rank, world_size)


class IgnoresExtraState:
    """Mixin for a module that stands where upstream has a Transformer Engine module (a local linear, a torch norm):
    checkpoints carry an ``_extra_state`` for it, which ``load_state_dict`` accepts and ignores (None, an empty tensor
    or TE's state) and does not require. ``state_dict()`` stays the parameters (``get_extra_state`` is not
    overridden); the module's ``sharded_state_dict`` adds the key."""

    def set_extra_state(self, state) -> None:
        """Ignored: this module has no quantizer state."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = prefix + torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX
        if key in missing_keys:
            missing_keys.remove(key)


def get_tensor_model_parallel_group_if_none(tp_group, is_expert: bool = False, check_initialized: bool = True):
    """``tp_group`` when given; else the (expert) tensor-parallel group of ``parallel_state``. None without
    torch.distributed; ``tp_group`` as passed while ``parallel_state`` holds no groups (upstream's rules; also
    importable from ``megatron.core.utils``, upstream's home)."""
    if not torch.distributed.is_initialized():
        return None
    if tp_group is not None or not parallel_state.is_initialized():
        return tp_group
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)
