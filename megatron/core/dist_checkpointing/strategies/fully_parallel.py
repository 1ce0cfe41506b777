"""Fully-parallel save and load: spread the I/O of replicated shards over the ranks of a process group.

Both wrappers keep the wrapped strategy's behaviour and on-disk format; they only change *which rank* does the I/O
for a shard that several ranks hold (same key, global offset and local shape):

- ``FullyParallelSaveStrategyWrapper``: every distinct shard is written by exactly one rank of the group, chosen to
  balance the bytes written per rank (upstream's greedy order, ``exchange_utils.distribute_shards_to_ranks``:
  deterministic on all ranks, the same ranks as upstream). As upstream, it rewrites ``replica_id`` in place (0 on the
  chosen rank, 1 elsewhere) and then delegates to the wrapped strategy.
- ``FullyParallelLoadStrategyWrapper``: every distinct shard is read from disk by exactly one rank of the group (the
  same balancing), through the wrapped strategy; the read shards are then exchanged over the group
  (``torch.distributed.broadcast``; gloo on CPU, NCCL on GPU) and written into every rank's own destination tensors.
  As upstream, it rewrites ``replica_id`` in place too (0 on the shards this rank reads, 1 elsewhere).

Quantized destinations (Transformer Engine QuantizedTensor, ``--stream-ckpt-dequant``): the wrapped strategy's
quantized-destination logic is kept. A rank that reads a shard for itself only passes its own destination to the
wrapped strategy (so streaming dequantize applies unchanged). A rank that receives a shard receives it into a plain
high-precision buffer and quantizes it with ``dest.copy_(buf)``. A reader whose destination is quantized and that must
also send the shard to other ranks reads it into a plain high-precision buffer (through the wrapped strategy), sends
that exact checkpoint value and copies it into its destination with ``dest.copy_(buf)`` too, so every rank quantizes
the same high-precision values (bit-identical to a plain load). Cost: such a reader holds the high-precision
buffers of the shared quantized shards it reads (about 1/N of them for a group of N) until they are exchanged.

The distribution is upstream's ``ShardDistribution`` (``exchange_utils.determine_main_replica_uniform_distribution``)
and the exchange ``exchange_utils.exchange_by_distribution``; ``cached_distribution`` holds the last one.

ShardedObjects are not redistributed: every rank loads its own through the wrapped strategy (they are small).
The wrapped load is called exactly once per rank (it is collective), also on a rank with nothing to read.
"""
import copy
import hashlib
import logging
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ...parallel_state import collective_device
from ..core import CheckpointingException
from ..dict_utils import dict_list_map_outplace, nested_values
from ..exchange_utils import (  # noqa: F401 (distribute_shards_to_ranks: re-exported, its old home)
    ShardDistribution,
    bytes_per_rank,
    determine_main_replica_uniform_distribution,
    distribute_shards_to_ranks,
    exchange_by_distribution,
)
from ..mapping import ShardedObject, ShardedTensor, is_main_replica
from ..utils import _sharded_tensor_shard_id, _ShardId
from .async_utils import check_async_strategy
from .base import LoadShardedStrategy, SaveShardedStrategy

logger = logging.getLogger(__name__)

ShardId = _ShardId  # a shard's identity across ranks: (key, global offset, local shape, flattened range or ())
_shard_id = _sharded_tensor_shard_id

EXCHANGE_ALGOS = ("broadcast",)


# ---- helpers ---------------------------------------------------------------------------------------------------
def _fingerprint(items) -> bytes:
    return hashlib.sha1(repr(items).encode()).digest()


def _any_rank_true(flag: bool, group) -> bool:
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def _local_fingerprint(sharded_tensors) -> bytes:
    """What the distribution depends on, on this rank (to reuse a cached distribution when nothing changed)."""
    return _fingerprint([(_shard_id(t), str(t.dtype), is_main_replica(t.replica_id)) for t in sharded_tensors])


# ---- save ------------------------------------------------------------------------------------------------------
class FullyParallelSaveStrategyWrapper(SaveShardedStrategy):
    """Save replicated shards once across ``parallelization_group`` (default: WORLD), balancing bytes per rank.

    Only shards whose main replica (``replica_id`` 0) lies on a rank of the group are redistributed among the ranks
    of the group holding them; the others get replica_id 1 (another group saves them). The group's ranks must
    hold identical data for identical shards (that is what a replica is).
    """

    def __init__(
        self,
        strategy: SaveShardedStrategy,
        parallelization_group: Optional[dist.ProcessGroup] = None,
        do_cache_distribution: bool = False,
        backend: str = "torch_dist",
        version: int = 1,
    ):
        super().__init__(backend, version)  # the wrapper's own, as upstream's (the checkpoint's metadata.json)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.cached_distribution: Optional[ShardDistribution] = None
        self._cached_fingerprint: Optional[bytes] = None
        self.last_saved_bytes_per_rank: Optional[List[int]] = None  # what the distribution assigned, for reports

    @property
    def can_handle_sharded_objects(self):
        return self.base_strategy.can_handle_sharded_objects

    def save(self, sharded_state_dict, checkpoint_dir):
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.save(sharded_state_dict, checkpoint_dir)

    def async_save(self, sharded_state_dict, checkpoint_dir, async_strategy: str = "nvrx"):
        check_async_strategy(async_strategy, "FullyParallelSaveStrategyWrapper.async_save")
        if not hasattr(self.base_strategy, "async_save"):
            raise CheckpointingException(
                f"{type(self.base_strategy).__name__} has no async_save; cannot save {checkpoint_dir} asynchronously"
            )
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir, async_strategy)

    def determine_distribution(self, sharded_state_dict) -> ShardDistribution:
        """Collective over the group: upstream's ShardDistribution (``main_rank_for_shard``: the group rank that
        saves each shard the group saves), reused when cached and no rank's shards changed."""
        group = self.parallelization_group
        local = [v for v in nested_values(sharded_state_dict) if isinstance(v, ShardedTensor)]
        fp = _local_fingerprint(local)
        if self.do_cache_distribution and self.cached_distribution is not None:
            if not _any_rank_true(fp != self._cached_fingerprint, group):
                return self.cached_distribution
        distribution = determine_main_replica_uniform_distribution(local, group)
        self.last_saved_bytes_per_rank = bytes_per_rank(distribution, dist.get_world_size(group))
        if self.do_cache_distribution:
            self.cached_distribution = distribution
            self._cached_fingerprint = fp
        return distribution

    def apply_saving_parallelization(self, sharded_state_dict) -> None:
        """Rewrite the ``replica_id`` of the ShardedTensors of ``sharded_state_dict`` in place, as upstream does
        (``distribute_main_replicas_with_precomputed_distribution`` with this wrapper's distribution)."""
        if dist.get_world_size(self.parallelization_group) == 1:
            return None
        distribution = self.determine_distribution(sharded_state_dict)
        distribute_main_replicas_with_precomputed_distribution(sharded_state_dict, self.parallelization_group,
                                                               distribution)
        return None


def distribute_main_replicas_with_precomputed_distribution(sharded_state_dict, parallelization_group,
                                                           precomputed_distribution: Optional[ShardDistribution]):
    """Upstream's function: in place, ``replica_id`` 0 for the ShardedTensors this rank saves (or reads) for the
    group under ``precomputed_distribution``, 1 for every other one (also for shards whose main replica is in
    another group). Nothing changes in a group of one (None: WORLD); otherwise a distribution is required.
    Deviation: a rank holding the same shard twice marks only its first copy 0."""
    if parallelization_group is None:
        parallelization_group = dist.group.WORLD
    if dist.get_world_size(parallelization_group) <= 1:
        return
    if precomputed_distribution is None:
        raise ValueError("precomputed_distribution must be not None for non-trivial parallelization group")
    my_rank = dist.get_rank(parallelization_group)
    marked = set()
    for v in nested_values(sharded_state_dict):
        if not isinstance(v, ShardedTensor):
            continue
        sid = _shard_id(v)
        mine = (sid in precomputed_distribution.shards_in_this_group
                and precomputed_distribution.main_rank_for_shard[sid] == my_rank and sid not in marked)
        v.replica_id = 0 if mine else 1
        if mine:
            marked.add(sid)


# ---- load ------------------------------------------------------------------------------------------------------
def is_quantized_destination(tensor) -> bool:
    """True for a quantized destination (TE QuantizedTensor, or the quantized-tensor protocol of fp8_utils)."""
    from ...fp8_utils import is_quantized_tensor

    return is_quantized_tensor(tensor)


class FullyParallelLoadStrategyWrapper(LoadShardedStrategy):
    """Read each distinct shard once across ``parallelization_group`` (default: WORLD), then exchange it.

    ``exchange_algo``: only ``'broadcast'`` (one ``torch.distributed.broadcast`` per shard that more than one rank
    of the group needs, from the rank that read it).
    """

    def __init__(
        self,
        strategy: LoadShardedStrategy,
        parallelization_group: Optional[dist.ProcessGroup] = None,
        do_cache_distribution: bool = False,
        exchange_algo: str = "broadcast",
    ):
        super().__init__()
        if exchange_algo not in EXCHANGE_ALGOS:
            raise CheckpointingException(
                f"FullyParallelLoadStrategyWrapper: unknown exchange_algo {exchange_algo!r}; "
                f"supported: {', '.join(EXCHANGE_ALGOS)}"
            )
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo
        self.cached_distribution = None
        self._cached_fingerprint: Optional[bytes] = None
        self.last_read_bytes_per_rank: Optional[List[int]] = None

    # -- forwarded to the wrapped strategy --
    @property
    def stream_ckpt_dequant(self) -> bool:
        return getattr(self.base_strategy, "stream_ckpt_dequant", False)

    @stream_ckpt_dequant.setter
    def stream_ckpt_dequant(self, value: bool):
        self.base_strategy.stream_ckpt_dequant = value

    @property
    def stream_ckpt_dequant_chunk_mb(self) -> float:
        return getattr(self.base_strategy, "stream_ckpt_dequant_chunk_mb", 0)

    @stream_ckpt_dequant_chunk_mb.setter
    def stream_ckpt_dequant_chunk_mb(self, value: float):
        self.base_strategy.stream_ckpt_dequant_chunk_mb = value

    @property
    def can_handle_sharded_objects(self):
        return self.base_strategy.can_handle_sharded_objects

    def load_tensors_metadata(self, checkpoint_dir):
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir):
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)

    @property
    def last_load_stats(self):
        """The wrapped strategy's statistics of its last load (its read of this rank's share)."""
        return getattr(self.base_strategy, "last_load_stats", None)

    def check_backend_compatibility(self, loaded_backend):
        return self.base_strategy.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version):
        return self.base_strategy.check_version_compatibility(loaded_version)

    # -- distribution --
    def determine_distribution(self, sharded_tensors: List[ShardedTensor]) -> ShardDistribution:
        """Collective: upstream's ShardDistribution over the group for every requested shard
        (``main_rank_for_shard``: the group rank that reads it; ``all_ranks_for_shard``: the ranks that need it),
        reused when cached and no rank's requests changed."""
        group = self.parallelization_group
        fp = _local_fingerprint(sharded_tensors)
        if self.do_cache_distribution and self.cached_distribution is not None:
            if not _any_rank_true(fp != self._cached_fingerprint, group):
                return self.cached_distribution
        distribution = determine_main_replica_uniform_distribution(sharded_tensors, group, ignore_groups=True)
        self.last_read_bytes_per_rank = bytes_per_rank(distribution, dist.get_world_size(group))
        if self.do_cache_distribution:
            self.cached_distribution = distribution
            self._cached_fingerprint = fp
        return distribution

    def apply_loading_parallelization(self, sharded_state_dict) -> Optional[ShardDistribution]:
        """Upstream's method: the read distribution of ``sharded_state_dict``'s ShardedTensors (collective; cached
        as ``determine_distribution``), with ``replica_id`` 0 on what this rank reads and 1 elsewhere."""
        tensors = [v for v in nested_values(sharded_state_dict) if isinstance(v, ShardedTensor)]
        distribution = self.determine_distribution(tensors)
        distribute_main_replicas_with_precomputed_distribution(sharded_state_dict, self.parallelization_group,
                                                               distribution)
        return distribution

    def _sync_errors(self, exc: Optional[BaseException], group):
        """Raise on every rank of the group if the wrapped load failed on any (the wrapped strategy usually raises
        collectively itself; this covers failures on some ranks only, so the exchange never waits for a dead rank)."""
        if not _any_rank_true(exc is not None, group):
            return
        size = dist.get_world_size(group)
        errors = [None] * size
        dist.all_gather_object(errors, None if exc is None else f"{type(exc).__name__}: {exc}", group=group)
        if exc is not None and all(e is not None for e in errors):
            raise exc  # failed everywhere (a collective error): the wrapped strategy's own exception
        msgs = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None)
        raise CheckpointingException(f"fully-parallel load failed: {msgs}") from exc

    # -- load --
    def load(self, sharded_state_dict, checkpoint_dir, async_strategy: str = "mcore"):
        check_async_strategy(async_strategy, "FullyParallelLoadStrategyWrapper.load")
        group = self.parallelization_group
        if dist.get_world_size(group) == 1:
            return self.base_strategy.load(sharded_state_dict, checkpoint_dir)
        my_rank = dist.get_rank(group)

        leaves = list(nested_values(sharded_state_dict))
        sharded_tensors = [v for v in leaves if isinstance(v, ShardedTensor)]
        by_id: Dict[ShardId, List[ShardedTensor]] = {}
        for t in sharded_tensors:
            by_id.setdefault(_shard_id(t), []).append(t)

        distribution = self.determine_distribution(sharded_tensors)
        reader, holders = distribution.main_rank_for_shard, distribution.all_ranks_for_shard
        # as upstream, in place: replica_id 0 on the shards this rank reads, 1 on the others (the wrapped strategy
        # sees its share as main replicas)
        distribute_main_replicas_with_precomputed_distribution(sharded_state_dict, group, distribution)

        # What this rank reads through the wrapped strategy: its own destination, or a high-precision buffer when
        # the destination is quantized and other ranks need the value too. Sharded objects: every rank its own.
        to_load: Dict[str, Any] = {}
        send_buffers: Dict[ShardId, torch.Tensor] = {}
        for sid, tens in by_id.items():
            if reader[sid] != my_rank:
                continue
            first = tens[0]
            if is_quantized_destination(first.data) and len(holders[sid]) > 1:
                buf = torch.empty(tuple(first.data.shape), dtype=first.dtype, device=_buffer_device(first.data))
                proxy = copy.copy(first)
                proxy.data = buf
                send_buffers[sid] = buf
                to_load[f"t{len(to_load)}"] = proxy
            else:
                to_load[f"t{len(to_load)}"] = first
        objects = [v for v in leaves if isinstance(v, ShardedObject)]
        for i, o in enumerate(objects):
            to_load[f"o{i}"] = o

        exc, loaded = None, {}
        try:
            loaded = self.base_strategy.load(to_load, checkpoint_dir)
        except Exception as e:
            exc = e
        self._sync_errors(exc, group)

        loaded_objects = {}
        for name, item in to_load.items():
            value = loaded[name]
            if isinstance(item, ShardedObject):
                loaded_objects[id(item)] = value
            elif isinstance(value, torch.Tensor) and not _same_memory(value, item.data):
                item.data.copy_(value)  # strategies that do not load in place

        # Destinations that this rank read itself, held more than once on this rank.
        for sid, tens in by_id.items():
            if reader[sid] == my_rank:
                src = send_buffers.get(sid, tens[0].data)
                for t in tens if sid in send_buffers else tens[1:]:
                    t.data.copy_(src)

        # Shards read by another rank: received one at a time and copied into every destination here.
        loaded_here = {sid: send_buffers.get(sid, tens[0].data) for sid, tens in by_id.items() if reader[sid] == my_rank}
        needed = {sid: tens[0] for sid, tens in by_id.items() if reader[sid] != my_rank}

        def copy_received(sid, buf):
            for t in by_id[sid]:
                if not _same_memory(t.data, buf):
                    t.data.copy_(buf.view(t.data.shape) if t.data.shape != buf.shape else buf)

        with torch.no_grad():  # destinations may be parameters (leaves that require grad)
            exchange_by_distribution(
                loaded_here, needed, distribution, group, self.exchange_algo, on_received=copy_received
            )

        def result(v):
            if isinstance(v, ShardedTensor):
                return v.data
            if isinstance(v, ShardedObject):
                return loaded_objects[id(v)]
            return v

        return dict_list_map_outplace(result, sharded_state_dict)


def _same_memory(a, b) -> bool:
    if a is b:
        return True
    try:
        return a.data_ptr() == b.data_ptr() and a.numel() == b.numel()
    except Exception:  # tensor subclasses without storage
        return False


def _buffer_device(tensor) -> torch.device:
    return tensor.device if isinstance(tensor, torch.Tensor) else torch.device("cpu")
