"""``MCoreTensorAwareStateDict``: a sharded state dict split into its common part and its tensors, for in-memory
(local) checkpoint managers such as nvidia-resiliency-ext's.

``from_state_dict`` preprocesses a sharded state dict as a save does (factories applied, nonpersistent entries
dropped, common part split off) and, with ``algo='fully_parallel'``, keeps the data of only the shards this rank
saves under the balanced distribution. The tensors can then be popped out (``pop_tensors``), moved to CPU
(``copy_tensors_to_cpu``), put back (``insert_tensors``) or re-allocated empty (``init_tensors``), and
``to_state_dict`` turns it back into a regular state dict for a model's sharded state dict (exchanging the shards
other ranks hold when fully parallel).

Unlike upstream, nvidia-resiliency-ext is optional: where it is installed the class derives from its
``TensorAwareStateDict``; without it the same class works on its own (nothing here needs it).
"""
import logging
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from .core import CheckpointingException
from .dict_utils import dict_list_map_inplace, dict_list_map_outplace, merge, nested_values
from .exchange_utils import ShardDistribution, determine_main_replica_uniform_distribution, exchange_by_distribution
from .mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict, apply_factory_merges
from .state_dict_utils import load_preprocess, save_preprocess
from .utils import _sharded_object_id, _sharded_tensor_shard_id, debug_time, extract_sharded_base, zip_strict
from .validation import (
    StrictHandling,
    determine_global_metadata,
    parse_strict_flag,
    validate_integrity_and_strict_load,
)

logger = logging.getLogger(__name__)

try:
    from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict

    HAVE_NVRX = True
except ImportError:
    class TensorAwareStateDict:  # stand-in base class when nvidia-resiliency-ext is absent
        """Base of tensor-aware state dicts (nvidia-resiliency-ext's interface)."""

    HAVE_NVRX = False

_ALGOS = ("atomic", "fully_parallel")
_ORIG_DEVICE = "orig_device"  # attribute remembering where a popped / CPU-copied tensor came from


@dataclass
class MCoreTensorAwareStateDict(TensorAwareStateDict):
    """The common state dict and the sharded part (ShardedTensors / ShardedObjects) of a checkpoint in memory."""

    common: StateDict
    sharded_state_dict: ShardedStateDict
    _is_hollow: bool = False

    @staticmethod
    def _validate_params(algo: str) -> None:
        if algo not in _ALGOS:
            raise NotImplementedError(f"algo={algo!r}: only 'atomic' and 'fully_parallel' are supported")

    @staticmethod
    def _get_distribution(fully_parallel: bool, sharded_part: ShardedStateDict,
                          parallelization_group: Optional[dist.ProcessGroup],
                          cached_distribution: Optional[ShardDistribution] = None):
        """The save distribution for ``fully_parallel`` (``cached_distribution`` when given; None for one rank),
        else ``(None, None, None, None)``."""
        if not fully_parallel:
            return (None, None, None, None)
        if cached_distribution is not None:
            return cached_distribution
        return determine_main_replica_uniform_distribution(sharded_part, parallelization_group, True)

    @staticmethod
    def _remove_redundant_data(fully_parallel: bool, sharded_part: ShardedStateDict, shard_to_saving_rank,
                               parallelization_group: Optional[dist.ProcessGroup]) -> None:
        """Drop the data of the ShardedTensors another rank of the group saves."""
        if not fully_parallel or shard_to_saving_rank is None:
            return
        my_rank = dist.get_rank(parallelization_group)
        for sh_base in nested_values(sharded_part):
            if isinstance(sh_base, ShardedTensor) and shard_to_saving_rank[_sharded_tensor_shard_id(sh_base)] != my_rank:
                sh_base.data = None

    @classmethod
    def from_state_dict(cls, sharded_state_dict: ShardedStateDict, algo: str = "fully_parallel",
                        parallelization_group: Optional[dist.ProcessGroup] = None,
                        cached_metadata: Optional[ShardDistribution] = None,
                        ) -> Tuple["MCoreTensorAwareStateDict", Optional[ShardDistribution]]:
        """(tensor-aware state dict, the distribution to pass as ``cached_metadata`` next time).

        Collective over ``parallelization_group`` (default WORLD) for ``algo='fully_parallel'`` unless
        ``cached_metadata`` is given (the sharding is then also not re-validated)."""
        cls._validate_params(algo)
        fully_parallel = algo == "fully_parallel"
        with debug_time("MCoreTensorAwareStateDict.from_state_dict", logger):
            sharded_part, common = save_preprocess(sharded_state_dict, cached_metadata is None)
            distribution = cls._get_distribution(fully_parallel, sharded_part, parallelization_group,
                                                 cached_metadata)
            if distribution is not None:
                cls._remove_redundant_data(fully_parallel, sharded_part, distribution[0], parallelization_group)
        return cls(common=common, sharded_state_dict=sharded_part), distribution

    @property
    def is_hollow(self) -> bool:
        """True while the tensors are popped out (``pop_tensors``) and not yet put back."""
        return self._is_hollow

    def _check_hollow(self, expected: bool, what: str) -> None:
        if self._is_hollow != expected:
            state = "hollow (tensors popped)" if self._is_hollow else "not hollow (tensors present)"
            raise CheckpointingException(f"MCoreTensorAwareStateDict.{what}: the state dict is {state}")

    @property
    def _sharded_tensors(self) -> Iterator[ShardedTensor]:
        """The ShardedTensors this rank holds data for (when hollow: the ones popped)."""
        for sh_base in nested_values(self.sharded_state_dict):
            if isinstance(sh_base, ShardedTensor):
                if (hasattr(sh_base, _ORIG_DEVICE) if self._is_hollow else sh_base.data is not None):
                    yield sh_base

    @property
    def tensors(self) -> Iterator[torch.Tensor]:
        """The tensors this rank holds, in a fixed order."""
        self._check_hollow(False, "tensors")
        return (sh_ten.data for sh_ten in self._sharded_tensors)

    @property
    def common_state_dict(self) -> Dict:
        """The common (non-sharded) state dict."""
        return self.common

    def pop_tensors(self) -> List[torch.Tensor]:
        """Take the tensors out (the metadata stays); the state dict is hollow afterwards."""
        self._check_hollow(False, "pop_tensors")
        popped = []
        for sh_ten in self._sharded_tensors:
            popped.append(sh_ten.data)
            setattr(sh_ten, _ORIG_DEVICE, sh_ten.data.device.type)
            sh_ten.data = None
        self._is_hollow = True
        return popped

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """Put tensors back, in ``pop_tensors``' order (the inverse of ``pop_tensors``)."""
        self._check_hollow(True, "insert_tensors")
        for sh_ten, ten in zip_strict(list(self._sharded_tensors), list(tensor_data)):
            if getattr(sh_ten, _ORIG_DEVICE) == ten.device.type:
                delattr(sh_ten, _ORIG_DEVICE)
            sh_ten.data = ten
        self._is_hollow = False

    def init_tensors(self) -> None:
        """Allocate empty tensors (shape, dtype, original device) in place of the popped ones."""
        self._check_hollow(True, "init_tensors")
        for sh_ten in list(self._sharded_tensors):
            sh_ten.init_data(getattr(sh_ten, _ORIG_DEVICE))
            delattr(sh_ten, _ORIG_DEVICE)
        self._is_hollow = False

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace the tensors by CPU copies (the originals are left intact); ``restore_tensor_device`` moves them
        back to where they came from."""
        self._check_hollow(False, "copy_tensors_to_cpu")
        for sh_ten in self._sharded_tensors:
            if sh_ten.data.device.type == "cpu":
                if not hasattr(sh_ten, _ORIG_DEVICE):  # not a copy made here yet
                    sh_ten.data = sh_ten.data.clone()
            else:
                if not hasattr(sh_ten, _ORIG_DEVICE):
                    setattr(sh_ten, _ORIG_DEVICE, sh_ten.data.device.type)
                sh_ten.data = sh_ten.data.detach().to("cpu", non_blocking=non_blocking)

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move tensors copied by ``copy_tensors_to_cpu`` back to their original device."""
        self._check_hollow(False, "restore_tensor_device")
        for sh_ten in self._sharded_tensors:
            if hasattr(sh_ten, _ORIG_DEVICE):
                sh_ten.data = sh_ten.data.to(getattr(sh_ten, _ORIG_DEVICE), non_blocking=non_blocking)
                delattr(sh_ten, _ORIG_DEVICE)

    def _insert_sharded_data(self, fully_parallel: bool, sharded_part: ShardedStateDict,
                             parallelization_group: Optional[dist.ProcessGroup], exchange_algo: str) -> None:
        """Replace the ShardedTensors / ShardedObjects of ``sharded_part`` by the values held here (and, fully
        parallel, the shards other ranks hold)."""
        loaded = {_sharded_tensor_shard_id(t): t.data for t in self._sharded_tensors}
        if fully_parallel:
            distribution = self._get_distribution(True, sharded_part, parallelization_group)
            if distribution is not None:
                unloaded = {}
                for sh_base in nested_values(sharded_part):
                    if isinstance(sh_base, ShardedTensor) and _sharded_tensor_shard_id(sh_base) not in loaded:
                        unloaded[_sharded_tensor_shard_id(sh_base)] = sh_base
                loaded = exchange_by_distribution(loaded, unloaded, distribution, parallelization_group,
                                                  exchange_algo)
        objects = {_sharded_object_id(o): o.data for o in nested_values(self.sharded_state_dict)
                   if isinstance(o, ShardedObject)}

        def fill(x: Any):
            if isinstance(x, ShardedTensor):
                shard_id = _sharded_tensor_shard_id(x)
                if shard_id not in loaded:
                    raise CheckpointingException(f"to_state_dict: no data for shard {shard_id} of {x.key!r}")
                return loaded[shard_id]
            if isinstance(x, ShardedObject):
                object_id = _sharded_object_id(x)
                if object_id not in objects:
                    raise CheckpointingException(f"to_state_dict: no object {x.unique_key!r} in the state dict")
                return objects[object_id]
            return x

        dict_list_map_inplace(fill, sharded_part)

    def to_state_dict(self, sharded_state_dict: ShardedStateDict, algo: str = "atomic",
                      exchange_algo: str = "broadcast", validate_access_integrity: bool = True,
                      parallelization_group: Optional[dist.ProcessGroup] = None,
                      strict: StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
                      return_mismatch_keys: bool = False):
        """The state dict for ``sharded_state_dict`` (e.g. ``model.sharded_state_dict()``) filled from here: the
        common part, ``sharded_state_dict``'s nonpersistent entries and the tensors/objects; with
        ``return_mismatch_keys`` also (missing keys, unexpected keys) as ``load`` reports them."""
        self._check_hollow(False, "to_state_dict")
        self._validate_params(algo)
        fully_parallel = algo == "fully_parallel"
        recreated = dict_list_map_outplace(lambda x: x, self.common)
        if not sharded_state_dict:
            return (recreated, [], []) if return_mismatch_keys else recreated
        sharded_state_dict, nonpersistent, with_factories = load_preprocess(sharded_state_dict)
        merge(recreated, nonpersistent)
        sharded_part, _ = extract_sharded_base(sharded_state_dict)

        strict = parse_strict_flag(strict)
        ckpt_metadata = None
        if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
            ckpt_metadata = {b.key: b.without_data() for b in nested_values(self.sharded_state_dict)}
        local_metadata = global_metadata = None
        if validate_access_integrity or StrictHandling.requires_global_app_metadata(strict):
            local_metadata, global_metadata = determine_global_metadata(sharded_part)
        sharded_part, missing_keys, unexpected_keys = validate_integrity_and_strict_load(
            sharded_part, strict, validate_access_integrity, local_metadata, global_metadata, ckpt_metadata)
        self._insert_sharded_data(fully_parallel, sharded_part, parallelization_group, exchange_algo)
        merge(recreated, apply_factory_merges(sharded_part, with_factories))
        return (recreated, missing_keys, unexpected_keys) if return_mismatch_keys else recreated
