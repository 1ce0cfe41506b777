"""Sharded state dict building blocks: what a rank holds of a global tensor or object.

A *sharded state dict* is a nested dict/list whose leaves may be:

- ``ShardedTensor``: a local piece (``data``) of a global tensor ``key`` of ``global_shape``, placed at
  ``global_offset``; optionally only a contiguous flat slice (``flattened_range``) of that piece.
- ``ShardedObject``: an arbitrary picklable object, one per ``global_offset`` of a ``global_shape`` grid.
- ``ShardedTensorFactory``: builds a sub sharded state dict before save/load and merges the loaded values after load.
- ``LocalNonpersistentObject``: returned as-is by ``load``, never saved.

Everything else is "common" state, saved once (rank 0) to ``common.pt``.

``replica_id`` (an int or a tuple of ints) marks replicas of the same shard: the *main* replica, the one that is
saved, is the one whose replica_id is 0 (all zeros for a tuple).
"""
import logging
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from .core import CheckpointingException
from .dict_utils import dict_list_map_inplace  # noqa: F401 (upstream's mapping.dict_list_map_inplace)

logger = logging.getLogger(__name__)

# A nested dict/list; leaves are ShardedBase objects, factories, nonpersistent objects or plain values.
ShardedStateDict = Dict[str, Any]
CommonStateDict = Dict[str, Any]  # the non-sharded part of a state dict (upstream's name)
StateDict = Dict[str, Any]
ReplicaId = Union[int, Tuple[int, ...]]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """True iff ``replica_id`` designates the main replica (0, or a tuple of zeros)."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class ShardedBase(ABC):
    """Common interface of ShardedTensor and ShardedObject."""

    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raise CheckpointingException if the metadata is inconsistent."""

    @abstractmethod
    def without_data(self) -> "ShardedBase":
        """A copy without the data (for gathering metadata across ranks)."""


@dataclass
class ShardedTensor(ShardedBase):
    """A local shard of the global tensor ``key``.

    Attributes:
        key: unique identifier of the global tensor.
        data: the local shard (shape ``local_shape``, or 1-D of ``flattened_range`` length), or None.
        dtype: dtype of the global tensor.
        local_shape: shape of the local shard, without the prepended axes.
        global_shape: shape of the global tensor, including the prepended axes.
        global_offset: offset of the local shard in the global tensor, including the prepended axes.
        axis_fragmentations: number of shards along each axis (a regular grid), or None for irregular (e.g. uneven
            torch.chunk-style FSDP) sharding.
        replica_id: identifies replicas of the same shard; the main replica (0 / all zeros) is saved.
        prepend_axis_num: number of leading singleton axes of the global tensor that the local data does not have.
        allow_shape_mismatch: on load, accept a checkpoint whose global shape differs (the caller handles it).
        flattened_range: the local data is only ``data_nd.flatten()[flattened_range]`` of the N-D shard.
    """

    key: str
    data: Optional[torch.Tensor]
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def __post_init__(self):
        self.local_shape = tuple(int(s) for s in self.local_shape)
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = tuple(int(s) for s in self.axis_fragmentations)
        self.validate_metadata_integrity()

    # ---- construction ----
    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: Tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: Optional[slice] = None,
        **init_kwargs,
    ) -> "ShardedTensor":
        """A shard of a regular grid: each ``(axis, axis_rank_offset, axis_fragmentations)`` says the shard is the
        ``axis_rank_offset``-th of ``axis_fragmentations`` equal pieces along ``axis`` (of the global tensor; axes
        below ``prepend_axis_num`` are the prepended singleton axes)."""
        if flattened_range is not None:
            raise CheckpointingException(
                f"{key}: use ShardedTensor.from_rank_offsets_flat for a flattened_range shard"
            )
        ndim = data.ndim + prepend_axis_num
        global_offset = [0] * ndim
        global_shape = [1] * prepend_axis_num + list(data.shape)
        axis_fragmentations = [1] * ndim
        seen = set()
        for axis, axis_rank_offset, axis_fragm in rank_offsets:
            if not (0 <= axis < ndim):
                raise CheckpointingException(f"{key}: axis {axis} out of range for a {ndim}-D global tensor")
            if not (0 <= axis_rank_offset < axis_fragm):
                raise CheckpointingException(
                    f"{key}: axis {axis} rank offset {axis_rank_offset} not in [0, {axis_fragm})"
                )
            if axis in seen:
                raise CheckpointingException(f"{key}: duplicated axis {axis} in rank offsets")
            seen.add(axis)
            local_axis_shape = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis] = axis_fragm * local_axis_shape
            global_offset[axis] = axis_rank_offset * local_axis_shape
            axis_fragmentations[axis] = axis_fragm
        axis_fragmentations = tuple(axis_fragmentations)
        return cls._from_data(
            key, data, global_shape, global_offset, axis_fragmentations, replica_id, prepend_axis_num, init_kwargs
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: Tuple[int, ...],
        *args,
        flattened_range: Optional[slice] = None,
        **kwargs,
    ) -> "ShardedTensor":
        """Like ``from_rank_offsets`` for the N-D shard of shape ``non_flat_local_shape``, of which ``data`` (1-D) is
        the contiguous flat slice ``flattened_range``."""
        if flattened_range is None:
            raise CheckpointingException(f"{key}: from_rank_offsets_flat needs a flattened_range")
        if data.ndim != 1:
            raise CheckpointingException(f"{key}: flattened data must be 1-D, got shape {tuple(data.shape)}")
        non_flat = torch.empty(tuple(non_flat_local_shape), dtype=data.dtype, device="meta")
        sh_ten = cls.from_rank_offsets(key, non_flat, *args, **kwargs)
        sh_ten.data = data
        sh_ten.flattened_range = flattened_range
        sh_ten.validate_metadata_integrity()
        return sh_ten

    @classmethod
    def from_global_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        global_shape: Tuple[int, ...],
        global_offset: Tuple[int, ...],
        *,
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        **init_kwargs,
    ) -> "ShardedTensor":
        """A shard placed explicitly (no regular grid: ``axis_fragmentations`` None), e.g. uneven torch.chunk-style
        FSDP shards, including empty ones (0 rows)."""
        return cls._from_data(key, data, global_shape, global_offset, None, replica_id, prepend_axis_num, init_kwargs)

    @classmethod
    def _from_data(
        cls, key, data, global_shape, global_offset, axis_fragmentations, replica_id, prepend_axis_num, init_kwargs
    ) -> "ShardedTensor":
        """The shard ``data`` (its dtype and shape) at the given placement; ``init_kwargs`` go to the constructor."""
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            axis_fragmentations,
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    # ---- queries ----
    def validate_metadata_integrity(self) -> None:
        ndim = len(self.global_shape)
        if len(self.global_offset) != ndim:
            raise CheckpointingException(
                f"{self.key}: global_offset {self.global_offset} and global_shape {self.global_shape} differ in length"
            )
        if len(self.local_shape) + self.prepend_axis_num != ndim:
            raise CheckpointingException(
                f"{self.key}: local_shape {self.local_shape} + {self.prepend_axis_num} prepended axes does not match "
                f"global_shape {self.global_shape}"
            )
        if self.axis_fragmentations is not None and len(self.axis_fragmentations) != ndim:
            raise CheckpointingException(
                f"{self.key}: axis_fragmentations {self.axis_fragmentations} do not match global_shape "
                f"{self.global_shape}"
            )
        for i in range(self.prepend_axis_num):
            if not (0 <= self.global_offset[i] < max(self.global_shape[i], 1)):
                raise CheckpointingException(
                    f"{self.key}: prepended axis {i} offset {self.global_offset[i]} outside global shape "
                    f"{self.global_shape}"
                )
        for i, (off, sh) in enumerate(zip(self.global_offset[self.prepend_axis_num :], self.local_shape)):
            gs = self.global_shape[i + self.prepend_axis_num]
            if off < 0 or sh < 0 or off + sh > gs:
                raise CheckpointingException(
                    f"{self.key}: local shard (offset {self.global_offset}, shape {self.local_shape}) exceeds global "
                    f"shape {self.global_shape}"
                )
        if self.flattened_range is not None:
            fr = self.flattened_range
            if fr.step not in (None, 1) or fr.start is None or fr.stop is None:
                raise CheckpointingException(f"{self.key}: flattened_range must be slice(start, stop), got {fr}")
            if not (0 <= fr.start <= fr.stop <= math.prod(self.local_shape)):
                raise CheckpointingException(
                    f"{self.key}: flattened_range {fr} outside the local shard of {math.prod(self.local_shape)} elements"
                )
        if self.data is None:
            return
        expected = (self.flattened_range.stop - self.flattened_range.start,) if self.flattened_range is not None \
            else self.local_shape
        if tuple(self.data.shape) != tuple(expected):
            raise CheckpointingException(
                f"{self.key}: data shape {tuple(self.data.shape)} does not match the expected local shape {expected}"
            )

    def global_slice(self) -> Tuple[Union[int, slice], ...]:
        """The local shard's position in the global tensor: ints for prepended axes, slices for the others."""
        return tuple(
            chain(
                (off for off in self.global_offset[: self.prepend_axis_num]),
                (
                    slice(off, off + sh)
                    for off, sh in zip(self.global_offset[self.prepend_axis_num :], self.local_shape)
                ),
            )
        )

    def local_chunk_offset_in_global(self) -> Tuple[int, ...]:
        """Index of the local shard in the grid of shards (offsets divided by the local shape)."""
        return tuple(
            chain(
                self.global_offset[: self.prepend_axis_num],
                (
                    off // sh if sh else 0
                    for off, sh in zip(self.global_offset[self.prepend_axis_num :], self.local_shape)
                ),
            )
        )

    def max_allowed_chunks(self) -> Tuple[int, ...]:
        """Chunk size along each axis of the regular grid (global shape divided by the fragmentations)."""
        if self.axis_fragmentations is None:
            raise CheckpointingException(f"{self.key}: no regular grid (axis_fragmentations is None)")
        chunks = []
        for axis_sh, axis_fragm in zip(self.global_shape, self.axis_fragmentations):
            if not self.allow_shape_mismatch and axis_sh % axis_fragm != 0:
                raise CheckpointingException(
                    f"{self.key}: axis shape {axis_sh} not divisible by axis fragmentation {axis_fragm}"
                )
            chunks.append(axis_sh // axis_fragm)
        return tuple(chunks)

    @property
    def has_regular_grid(self) -> bool:
        return self.axis_fragmentations is not None

    def init_data(self, device: Union[str, torch.device], init_fn=torch.empty) -> None:
        """Allocate ``data`` (if None) with ``init_fn(shape, dtype=..., device=...)``."""
        if self.data is not None:
            return
        shape = (self.flattened_range.stop - self.flattened_range.start,) if self.flattened_range is not None \
            else self.local_shape
        self.data = init_fn(shape, dtype=self.dtype, device=device)

    def global_box(self) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """(offset, shape) of the N-D local shard in the global tensor, prepended axes included."""
        return self.global_offset, (1,) * self.prepend_axis_num + self.local_shape

    def numel(self) -> int:
        """Number of elements this shard holds (of the flat slice if flattened)."""
        if self.flattened_range is not None:
            return self.flattened_range.stop - self.flattened_range.start
        return math.prod(self.local_shape)

    def without_data(self) -> "ShardedTensor":
        return replace(self, data=None)

    def narrow(self, dim: int, start: int, length: int) -> List["ShardedTensor"]:
        """Like ``torch.narrow`` applied to every rank's local shard: the result describes the global tensor made of
        each shard's ``[start, start + length)`` slice along local axis ``dim`` (its global size along that axis is
        ``axis_fragmentations * length``). Needs a regular grid.

        Returns a list (upstream's contract): one ShardedTensor for a non-flattened shard; for a flattened one
        (only ``dim`` 0) the part of the flat range that falls into the narrowed rows, or an empty list if none.
        """
        if self.axis_fragmentations is None:
            raise CheckpointingException(f"{self.key}: narrow needs a regular grid (axis_fragmentations)")
        if not (0 <= dim < len(self.local_shape)):
            raise CheckpointingException(f"{self.key}: narrow dim {dim} out of range for local shape {self.local_shape}")
        axis_len = self.local_shape[dim]
        if start < 0 or length < 0 or start + length > axis_len:
            raise CheckpointingException(
                f"{self.key}: narrow({dim}, {start}, {length}) outside local axis {dim} of size {axis_len}"
            )
        axis = dim + self.prepend_axis_num
        chunk = self.global_offset[axis] // axis_len if axis_len else 0
        local_shape = self.local_shape[:dim] + (length,) + self.local_shape[dim + 1 :]
        global_shape = list(self.global_shape)
        global_shape[axis] = self.axis_fragmentations[axis] * length
        global_offset = list(self.global_offset)
        global_offset[axis] = chunk * length
        placed = dict(local_shape=local_shape, global_shape=tuple(global_shape), global_offset=tuple(global_offset))
        if self.flattened_range is None:
            data = None if self.data is None else self.data.narrow(dim, start, length)
            return [replace(self, data=data, **placed)]
        if dim != 0:
            raise CheckpointingException(f"{self.key}: narrow of a flattened shard supports dim 0 only, got {dim}")
        row = math.prod(self.local_shape[1:])
        lo = max(self.flattened_range.start, start * row)
        hi = min(self.flattened_range.stop, (start + length) * row)
        if lo >= hi:
            return []
        fr = self.flattened_range
        data = None if self.data is None else self.data[lo - fr.start : hi - fr.start]
        return [replace(self, data=data, flattened_range=slice(lo - start * row, hi - start * row), **placed)]

    def __str__(self):
        return f"{self.__class__.__name__}(key='{self.key}')"


@dataclass
class ShardedObject(ShardedBase):
    """An object shard: one of a ``global_shape`` grid of objects, at ``global_offset``; saved by its main replica."""

    key: str
    data: object
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self):
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"{self.key}: global_offset {self.global_offset} and global_shape {self.global_shape} differ in length"
            )
        for off, sh in zip(self.global_offset, self.global_shape):
            if not (0 <= off < sh):
                raise CheckpointingException(
                    f"{self.key}: object offset {self.global_offset} outside global shape {self.global_shape}"
                )

    def without_data(self) -> "ShardedObject":
        return replace(self, data=None)

    @property
    def unique_key(self) -> str:
        """``key/shard_<offsets>_<shape>``, e.g. ``optimizer/shard_0.0_1.2`` (the checkpoint key)."""
        return (
            f"{self.key}/shard_{'.'.join(map(str, self.global_offset))}_{'.'.join(map(str, self.global_shape))}"
        )

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> "ShardedObject":
        """Parse a ``unique_key`` back into a data-less ShardedObject."""
        key, _, shard_str = unique_key.rpartition("/")
        if not key or not shard_str.startswith("shard_"):
            raise CheckpointingException(f"not a ShardedObject unique key: {unique_key!r}")
        parts = shard_str[len("shard_") :].split("_")
        if len(parts) != 2:
            raise CheckpointingException(f"not a ShardedObject unique key: {unique_key!r}")

        def _ints(s):
            return tuple(int(x) for x in s.split(".")) if s else ()

        return cls(key, None, _ints(parts[1]), _ints(parts[0]), replica_id)

    def __str__(self):
        return f"{self.__class__.__name__}(key='{self.key}')"


@dataclass
class ShardedTensorFactory(ShardedBase):
    """Builds a sub sharded state dict from ``data`` before save/load; ``merge_fn`` turns the loaded sub state dict
    back into one value after load.

    ``build_fn(key, data, replica_id, flattened_range) -> ShardedStateDict``; ``merge_fn(sub_state_dict) -> value``.
    """

    key: str
    data: torch.Tensor
    build_fn: Callable[..., ShardedStateDict]
    merge_fn: Callable[[StateDict], Any]
    replica_id: ReplicaId = 0
    flattened_range: Optional[slice] = None

    def build(self) -> ShardedStateDict:
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        return None

    def without_data(self) -> "ShardedTensorFactory":
        raise CheckpointingException(f"{self.key}: a ShardedTensorFactory must be applied before gathering metadata")


class LocalNonpersistentObject:
    """An object that ``load`` returns as-is (unwrapped) and ``save`` never writes."""

    def __init__(self, obj):
        self.obj = obj

    def unwrap(self):
        return self.obj

    def __repr__(self):
        return f"LocalNonpersistentObject({self.obj!r})"


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace, in place, every ShardedTensorFactory by the sub state dict it builds."""

    def _apply(x):
        return x.build() if isinstance(x, ShardedTensorFactory) else x

    dict_list_map_inplace(_apply, sharded_state_dict)


def apply_factory_merges(x1: StateDict, x2: ShardedStateDict, key=()) -> StateDict:
    """Where ``x2`` (the state dict before ``apply_factories``) holds a factory, replace ``x1``'s value (the loaded sub
    state dict) by ``factory.merge_fn(value)``. Returns ``x1`` (modified in place where possible)."""
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                if isinstance(v2, ShardedTensorFactory):
                    raise CheckpointingException(f"{'.'.join(map(str, key + (k,)))}: factory result missing")
                continue
            x1[k] = apply_factory_merges(x1[k], v2, key + (k,))
    elif isinstance(x1, dict) and isinstance(x2, list):  # list extracted as {index: value}
        for i, v in list(x1.items()):
            if isinstance(i, int) and i < len(x2):
                x1[i] = apply_factory_merges(v, x2[i], key + (i,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise CheckpointingException(
                f"{'.'.join(map(str, key))}: list lengths differ when merging factories ({len(x1)} vs {len(x2)})"
            )
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, key + (i,))
    return x1
