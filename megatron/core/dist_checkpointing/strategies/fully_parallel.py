"""Fully-parallel save and load: spread the I/O of replicated shards over the ranks of a process group.

Both wrappers keep the wrapped strategy's behaviour and on-disk format; they only change *which rank* does the I/O
for a shard that several ranks hold (same key, global offset and local shape):

- ``FullyParallelSaveStrategyWrapper``: every distinct shard is written by exactly one rank of the group, chosen to
  balance the bytes written per rank (greedy, largest shard first, ties to the lowest rank: deterministic on all
  ranks). It works by rewriting ``replica_id`` (0 on the chosen rank, 1 elsewhere) on copies of the ShardedTensors
  and then delegating to the wrapped strategy.
- ``FullyParallelLoadStrategyWrapper``: every distinct shard is read from disk by exactly one rank of the group (the
  same balancing), through the wrapped strategy; the read shards are then exchanged over the group
  (``torch.distributed.broadcast``; gloo on CPU, NCCL on GPU) and written into every rank's own destination tensors.

Quantized destinations (Transformer Engine QuantizedTensor, ``--stream-ckpt-dequant``): the wrapped strategy's
quantized-destination logic is kept. A rank that reads a shard for itself only passes its own destination to the
wrapped strategy (so streaming dequantize applies unchanged). A rank that receives a shard receives it into a plain
high-precision buffer and quantizes it with ``dest.copy_(buf)``. A reader whose destination is quantized and that must
also send the shard to other ranks reads it into a plain high-precision buffer (through the wrapped strategy), sends
that exact checkpoint value and copies it into its destination with ``dest.copy_(buf)`` too, so every rank quantizes
the same high-precision values (bit-identical to a plain load). Cost: such a reader holds the high-precision
buffers of the shared quantized shards it reads (about 1/N of them for a group of N) until they are exchanged.

ShardedObjects are not redistributed: every rank loads its own through the wrapped strategy (they are small).
The wrapped load is called exactly once per rank (it is collective), also on a rank with nothing to read.
"""
import copy
import hashlib
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ...parallel_state import collective_device
from ..core import CheckpointingException
from ..mapping import ShardedObject, ShardedTensor
from .base import LoadShardedStrategy, SaveShardedStrategy

logger = logging.getLogger(__name__)

# A shard's identity across ranks: (key, global offset, local shape, flattened range or ()).
ShardId = Tuple[str, Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]

EXCHANGE_ALGOS = ("broadcast",)


# ---- helpers ---------------------------------------------------------------------------------------------------
def _is_main_replica(replica_id) -> bool:
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


def _shard_id(sh_ten) -> ShardId:
    fr = getattr(sh_ten, "flattened_range", None)
    fr = () if fr is None else (int(fr.start), int(fr.stop))
    return (
        str(sh_ten.key),
        tuple(int(o) for o in sh_ten.global_offset),
        tuple(int(s) for s in sh_ten.local_shape),
        fr,
    )


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _shard_nbytes(sh_ten) -> int:
    fr = getattr(sh_ten, "flattened_range", None)
    numel = (fr.stop - fr.start) if fr is not None else _numel(sh_ten.local_shape)
    return numel * torch.empty((), dtype=sh_ten.dtype).element_size()


def _map_leaves(obj, fn: Callable[[Any], Any]):
    """A copy of nested dicts/lists with ``fn`` applied to every leaf (containers are new, leaves are fn's)."""
    if isinstance(obj, dict):
        return {k: _map_leaves(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_leaves(v, fn) for v in obj]
    return fn(obj)


def _nested_values(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _nested_values(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _nested_values(v)
    else:
        yield obj


def _group_rank_size(group) -> Tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _global_rank(group, group_rank: int) -> int:
    if group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _fingerprint(items) -> bytes:
    return hashlib.sha1(repr(items).encode()).digest()


def _any_rank_true(flag: bool, group) -> bool:
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def distribute_shards_to_ranks(
    shard_to_ranks: Dict[ShardId, List[int]], shard_to_size: Dict[ShardId, int], num_ranks: int
) -> Dict[ShardId, int]:
    """Pick one rank per shard among the ranks holding it, balancing bytes: greedy, largest shard first.

    Deterministic (depends only on its arguments), so every rank computes the same answer.
    """
    load = [0] * num_ranks
    result = {}
    for shard in sorted(shard_to_ranks, key=lambda s: (-shard_to_size[s], s)):
        holders = shard_to_ranks[shard]
        rank = min(holders, key=lambda r: (load[r], r))
        result[shard] = rank
        load[rank] += shard_to_size[shard]
    return result


def _gather_shards(local: List[Tuple[ShardId, int, Any]], group) -> List[List[Tuple[ShardId, int, Any]]]:
    _, size = _group_rank_size(group)
    gathered = [None] * size
    dist.all_gather_object(gathered, local, group=group)
    return gathered


# ---- save ------------------------------------------------------------------------------------------------------
class FullyParallelSaveStrategyWrapper(SaveShardedStrategy):
    """Save replicated shards once across ``parallelization_group`` (default: WORLD), balancing bytes per rank.

    Only shards whose main replica (``replica_id`` 0) lies on a rank of the group are redistributed among the ranks
    of the group holding them; the others keep their replica_ids (another group saves them). The group's ranks must
    hold identical data for identical shards (that is what a replica is).
    """

    def __init__(
        self,
        strategy: SaveShardedStrategy,
        parallelization_group: Optional[dist.ProcessGroup] = None,
        do_cache_distribution: bool = False,
    ):
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.cached_distribution: Optional[Dict[ShardId, int]] = None
        self._cached_fingerprint: Optional[bytes] = None
        self.last_saved_bytes_per_rank: Optional[List[int]] = None  # what the distribution assigned, for reports

    @property
    def can_handle_sharded_objects(self):
        return self.base_strategy.can_handle_sharded_objects

    def save(self, sharded_state_dict, checkpoint_dir):
        sharded_state_dict = self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.save(sharded_state_dict, checkpoint_dir)

    def async_save(self, sharded_state_dict, checkpoint_dir):
        if not hasattr(self.base_strategy, "async_save"):
            raise CheckpointingException(
                f"{type(self.base_strategy).__name__} has no async_save; cannot save {checkpoint_dir} asynchronously"
            )
        sharded_state_dict = self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir)

    def _local_shards(self, sharded_state_dict):
        return [
            (_shard_id(v), _shard_nbytes(v), _is_main_replica(v.replica_id))
            for v in _nested_values(sharded_state_dict)
            if isinstance(v, ShardedTensor)
        ]

    def determine_distribution(self, sharded_state_dict) -> Dict[ShardId, int]:
        """Collective over the group: shard id -> group rank that saves it (for shards the group saves)."""
        group = self.parallelization_group
        local = self._local_shards(sharded_state_dict)
        if self.do_cache_distribution and self.cached_distribution is not None:
            fp = _fingerprint(local)
            if not _any_rank_true(fp != self._cached_fingerprint, group):
                return self.cached_distribution
        _, size = _group_rank_size(group)
        gathered = _gather_shards(local, group)
        shard_to_ranks: Dict[ShardId, List[int]] = {}
        shard_to_size: Dict[ShardId, int] = {}
        has_main = set()
        for rank, items in enumerate(gathered):
            for sid, nbytes, main in items:
                holders = shard_to_ranks.setdefault(sid, [])
                if rank not in holders:
                    holders.append(rank)
                shard_to_size[sid] = nbytes
                if main:
                    has_main.add(sid)
        shard_to_ranks = {s: r for s, r in shard_to_ranks.items() if s in has_main}
        distribution = distribute_shards_to_ranks(shard_to_ranks, shard_to_size, size)
        per_rank = [0] * size
        for sid, rank in distribution.items():
            per_rank[rank] += shard_to_size[sid]
        self.last_saved_bytes_per_rank = per_rank
        if self.do_cache_distribution:
            self.cached_distribution = distribution
            self._cached_fingerprint = _fingerprint(local)
        return distribution

    def apply_saving_parallelization(self, sharded_state_dict):
        """A copy of ``sharded_state_dict`` whose ShardedTensors (shallow copies, same data) have rewritten replica_ids.

        The caller's ShardedTensors are not modified.
        """
        group = self.parallelization_group
        if dist.get_world_size(group) == 1:
            return sharded_state_dict
        distribution = self.determine_distribution(sharded_state_dict)
        my_rank = dist.get_rank(group)
        seen_here = set()

        def rewrite(v):
            if not isinstance(v, ShardedTensor):
                return v
            sid = _shard_id(v)
            saver = distribution.get(sid)
            if saver is None:  # not saved by this group: keep the replica_id
                return v
            new = copy.copy(v)
            # A rank holding the same shard twice saves it once.
            new.replica_id = 0 if (saver == my_rank and sid not in seen_here) else 1
            if new.replica_id == 0:
                seen_here.add(sid)
            return new

        return _map_leaves(sharded_state_dict, rewrite)


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
    def can_handle_sharded_objects(self):
        return self.base_strategy.can_handle_sharded_objects

    def load_tensors_metadata(self, checkpoint_dir):
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir):
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)

    def check_backend_compatibility(self, loaded_backend):
        return self.base_strategy.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version):
        return self.base_strategy.check_version_compatibility(loaded_version)

    # -- distribution --
    def determine_distribution(self, sharded_tensors: List[ShardedTensor]):
        """Collective: ``(reader, holders, exchange_meta)`` dicts keyed by shard id.

        reader: group rank that reads the shard; holders: group ranks that asked for it; exchange_meta: (shape, dtype)
        of the buffer the shard travels in, and whether the reader's destination is quantized.
        """
        group = self.parallelization_group
        local = []
        seen = set()
        for t in sharded_tensors:
            sid = _shard_id(t)
            if sid in seen:
                continue
            seen.add(sid)
            local.append((sid, _shard_nbytes(t), (str(t.dtype), is_quantized_destination(t.data))))
        if self.do_cache_distribution and self.cached_distribution is not None:
            if not _any_rank_true(_fingerprint(local) != self._cached_fingerprint, group):
                return self.cached_distribution
        _, size = _group_rank_size(group)
        gathered = _gather_shards(local, group)
        holders: Dict[ShardId, List[int]] = {}
        sizes: Dict[ShardId, int] = {}
        extra: Dict[ShardId, Dict[int, Tuple[str, bool]]] = {}
        for rank, items in enumerate(gathered):
            for sid, nbytes, info in items:
                holders.setdefault(sid, []).append(rank)
                sizes[sid] = nbytes
                extra.setdefault(sid, {})[rank] = info
        reader = distribute_shards_to_ranks(holders, sizes, size)
        meta = {sid: extra[sid][reader[sid]] for sid in reader}
        per_rank = [0] * size
        for sid, rank in reader.items():
            per_rank[rank] += sizes[sid]
        self.last_read_bytes_per_rank = per_rank
        distribution = (reader, holders, meta)
        if self.do_cache_distribution:
            self.cached_distribution = distribution
            self._cached_fingerprint = _fingerprint(local)
        return distribution

    def _sync_errors(self, exc: Optional[BaseException], group):
        """Raise on every rank of the group if the wrapped load failed on any (the wrapped strategy usually raises
        collectively itself; this covers failures on some ranks only, so the exchange never waits for a dead rank)."""
        if not _any_rank_true(exc is not None, group):
            return
        _, size = _group_rank_size(group)
        errors = [None] * size
        dist.all_gather_object(errors, None if exc is None else f"{type(exc).__name__}: {exc}", group=group)
        if exc is not None and all(e is not None for e in errors):
            raise exc  # failed everywhere (a collective error): the wrapped strategy's own exception
        msgs = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None)
        raise CheckpointingException(f"fully-parallel load failed: {msgs}") from exc

    # -- load --
    def load(self, sharded_state_dict, checkpoint_dir):
        group = self.parallelization_group
        if dist.get_world_size(group) == 1:
            return self.base_strategy.load(sharded_state_dict, checkpoint_dir)
        my_rank = dist.get_rank(group)

        leaves = list(_nested_values(sharded_state_dict))
        sharded_tensors = [v for v in leaves if isinstance(v, ShardedTensor)]
        by_id: Dict[ShardId, List[ShardedTensor]] = {}
        for t in sharded_tensors:
            by_id.setdefault(_shard_id(t), []).append(t)

        reader, holders, meta = self.determine_distribution(sharded_tensors)

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

        self._exchange(reader, holders, meta, by_id, send_buffers, my_rank)

        def result(v):
            if isinstance(v, ShardedTensor):
                return v.data
            if isinstance(v, ShardedObject):
                return loaded_objects[id(v)]
            return v

        return _map_leaves(sharded_state_dict, result)

    @torch.no_grad()  # destinations may be parameters (leaves that require grad)
    def _exchange(self, reader, holders, meta, by_id, send_buffers, my_rank):
        group = self.parallelization_group
        device = collective_device(group)
        for sid in sorted(reader):
            if len(holders[sid]) < 2:
                continue
            src_rank = reader[sid]
            dtype_name, _ = meta[sid]
            dtype = getattr(torch, dtype_name.replace("torch.", ""))
            shape = sid[2] if not sid[3] else (sid[3][1] - sid[3][0],)
            if src_rank == my_rank:
                src = send_buffers.get(sid)
                if src is None:
                    src = by_id[sid][0].data
                buf = src.to(device=device, dtype=dtype).contiguous()
            else:
                buf = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(buf, src=_global_rank(group, src_rank), group=group)
            if src_rank != my_rank and sid in by_id:
                for t in by_id[sid]:
                    t.data.copy_(buf.view(t.data.shape) if t.data.shape != buf.shape else buf)
            del buf


def _same_memory(a, b) -> bool:
    if a is b:
        return True
    try:
        return a.data_ptr() == b.data_ptr() and a.numel() == b.numel()
    except Exception:  # tensor subclasses without storage
        return False


def _buffer_device(tensor) -> torch.device:
    return tensor.device if isinstance(tensor, torch.Tensor) else torch.device("cpu")
