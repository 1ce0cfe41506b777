"""Which rank does the I/O of a shard that several ranks hold, and the exchange of loaded shards between ranks
(upstream's ``dist_checkpointing.exchange_utils``; used by ``strategies/fully_parallel.py``).

A ``ShardDistribution`` is valid for one process group (implicit): ranks in it are ranks *of that group*.
"""
import logging
from itertools import zip_longest
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Set, Tuple, TypeVar

import torch
import torch.distributed as dist

from ..extensions.transformer_engine import Float8Tensor as _Float8Tensor
from ..parallel_state import collective_device
from .core import CheckpointingException
from .dict_utils import nested_values
from .mapping import ShardedStateDict, ShardedTensor, is_main_replica
from .utils import _sharded_tensor_shard_id, _ShardId

HAVE_TE_FLOAT8TENSOR = _Float8Tensor is not None  # upstream's flag: Transformer Engine's Float8Tensor importable


def is_float8tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a Transformer Engine ``Float8Tensor`` (False without TE)."""
    return HAVE_TE_FLOAT8TENSOR and isinstance(tensor, _Float8Tensor)

logger = logging.getLogger(__name__)

EXCHANGE_ALGOS = ("broadcast", "gather_object", "gather_rounds")


class ShardDistribution(NamedTuple):
    """A distribution of ShardedTensors over the ranks of a group.

    main_rank_for_shard: shard id -> the group rank that saves (or reads) it;
    shards_in_this_group: the shards that have a main replica in the group (all of them for a load);
    shard_to_metadata: shard id -> a data-less ShardedTensor describing it;
    all_ranks_for_shard: shard id -> the group ranks that hold (or need) it.
    """

    main_rank_for_shard: Dict[_ShardId, int]
    shards_in_this_group: Set[_ShardId]
    shard_to_metadata: Dict[_ShardId, ShardedTensor]
    all_ranks_for_shard: Dict[_ShardId, List[int]]


def _shard_size(sh_ten: ShardedTensor) -> int:
    """The shard's weight in the distribution, as upstream counts it: bytes of its ``local_shape`` (for a flattened
    shard that is the whole local tensor, not its flat range, so the same ranks are chosen as upstream)."""
    numel = 1
    for n in sh_ten.local_shape:
        numel *= n
    return numel * torch.empty((), dtype=sh_ten.dtype).element_size()


def _io_bytes(sh_ten: ShardedTensor) -> int:
    """Bytes of the shard's data actually written or read (its flat range if flattened)."""
    return sh_ten.numel() * torch.empty((), dtype=sh_ten.dtype).element_size()


def _exchange_shape(sh_ten: ShardedTensor):
    fr = sh_ten.flattened_range
    return (fr.stop - fr.start,) if fr is not None else tuple(sh_ten.local_shape)


T = TypeVar("T")


def distribute_shards_to_ranks(
    shard_to_ranks: Dict[T, List[int]],
    shard_to_size: Dict[T, int],
    num_ranks: int,
    cross_parallelization_group_loads: Set[T],
) -> Dict[T, int]:
    """One rank per shard among the ranks holding it, balancing bytes, in upstream's order so that the same state
    dict gets the same assignment as upstream: shards whose main replica is in this group before those loaded for
    another group (``cross_parallelization_group_loads``), then fewer holders first, then larger first, then by
    shard id; each goes to its least loaded holder (ties to the lowest rank). Deterministic: every rank computes
    the same."""
    load = [0] * num_ranks
    result = {}

    def order(shard):
        return (shard in cross_parallelization_group_loads, len(shard_to_ranks[shard]), -shard_to_size[shard], shard)

    for shard in sorted(shard_to_ranks, key=order):
        rank = min(shard_to_ranks[shard], key=lambda r: (load[r], r))
        result[shard] = rank
        load[rank] += shard_to_size[shard]
    return result


def determine_main_replica_uniform_distribution(
    sharded_state_dict: ShardedStateDict,
    parallelization_group: Optional[dist.ProcessGroup] = None,
    ignore_groups: bool = False,
) -> Optional[ShardDistribution]:
    """The balanced distribution of the ShardedTensors of ``sharded_state_dict`` over ``parallelization_group``
    (default WORLD): collective (one ``all_gather_object`` of data-less metadata); None for a group of one rank.

    For a save only shards whose main replica (replica_id 0) is on a rank of the group are distributed (the others
    are another group's); ``ignore_groups=True`` (a load) distributes every shard.
    """
    size = dist.get_world_size(parallelization_group)
    if size <= 1:
        return None
    local = [t.without_data() for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
    gathered: List[Optional[List[ShardedTensor]]] = [None] * size
    dist.all_gather_object(gathered, local, group=parallelization_group)
    all_ranks: Dict[_ShardId, List[int]] = {}
    metadata: Dict[_ShardId, ShardedTensor] = {}
    has_main: Set[_ShardId] = set()
    for rank, shards in enumerate(gathered):
        for sh in shards:
            sid = _sharded_tensor_shard_id(sh)
            ranks = all_ranks.setdefault(sid, [])
            if rank not in ranks:  # a rank holding the same shard twice counts once
                ranks.append(rank)
            metadata.setdefault(sid, sh)
            if is_main_replica(sh.replica_id):
                has_main.add(sid)
    # A load (ignore_groups) distributes every shard; those whose main replica is in another group come last.
    in_group = set(all_ranks) if ignore_groups else has_main
    cross_group = in_group - has_main
    all_ranks = {sid: ranks for sid, ranks in all_ranks.items() if sid in in_group}
    sizes = {sid: _shard_size(metadata[sid]) for sid in all_ranks}
    main = distribute_shards_to_ranks(all_ranks, sizes, size, cross_group)
    return ShardDistribution(main, in_group, metadata, all_ranks)


def bytes_per_rank(distribution: ShardDistribution, num_ranks: int) -> List[int]:
    """Bytes each group rank saves/reads under ``distribution`` (for reports and tests)."""
    out = [0] * num_ranks
    for sid, rank in distribution.main_rank_for_shard.items():
        out[rank] += _io_bytes(distribution.shard_to_metadata[sid])
    return out


def _global_rank(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _receives_in_place(dest: Optional[ShardedTensor], meta: ShardedTensor, device: torch.device) -> bool:
    """Whether a shard can be received straight into ``dest.data`` (a plain contiguous tensor of the exchanged
    dtype, shape and device), saving a buffer."""
    if dest is None or type(dest.data) not in (torch.Tensor, torch.nn.Parameter):
        return False
    d = dest.data
    return (
        d.device == device and d.dtype == meta.dtype and d.is_contiguous()
        and tuple(d.shape) == _exchange_shape(meta)
    )


def _get_empty_tensor_for_exchange(
    shard_id: _ShardId,
    needed_shards: Dict[_ShardId, ShardedTensor],
    unneeded_shards: Dict[_ShardId, ShardedTensor],
    loaded_tensors: Dict[_ShardId, torch.Tensor],
    device: Optional[torch.device] = None,
) -> Tuple[torch.Tensor, Optional[torch.device]]:
    """The buffer that receives shard ``shard_id`` in an exchange (upstream's name and arguments), and the device of
    this rank's own tensor for it (None when this rank does not need the shard).

    A shard this rank needs (in ``needed_shards``) is received in place into its ``data`` when that is a plain
    contiguous tensor of the exchanged dtype/shape on ``device`` (the collective device by default), else into a new
    buffer; either way the buffer is recorded in ``loaded_tensors``. A shard it does not need gets a new buffer
    shaped from its metadata in ``unneeded_shards`` (dropped after the exchange)."""
    if device is None:
        device = collective_device()
    dest = needed_shards.get(shard_id)
    meta = dest if dest is not None else unneeded_shards[shard_id]
    if _receives_in_place(dest, meta, device):
        buf = dest.data.detach()
    else:
        buf = torch.empty(_exchange_shape(meta), dtype=meta.dtype, device=device)
    if dest is None:
        return buf, None
    loaded_tensors[shard_id] = buf
    return buf, (dest.data.device if isinstance(dest.data, torch.Tensor) else None)


@torch.no_grad()
def exchange_loaded_tensors_broadcast(
    loaded_tensors: Dict[_ShardId, torch.Tensor],
    unloaded_shards: Dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Optional[dist.ProcessGroup] = None,
    *,
    on_received: Optional[Callable[[_ShardId, torch.Tensor], None]] = None,
) -> Dict[_ShardId, torch.Tensor]:
    """Every shard needed by more than one rank is broadcast over the group from the rank that loaded it
    (``loaded_tensors`` on that rank); ranks that do not need it receive and drop it. Collective.

    Returns ``loaded_tensors`` plus the received shards that this rank needs (``unloaded_shards``), each received
    in place into its ``data`` when that is a plain tensor of the right dtype/shape on the collective device, else
    into a new buffer. With ``on_received`` (this fork's extra) each received shard is handed to
    ``on_received(shard_id, tensor)`` right away and not kept, so at most one buffer is alive at a time.
    """
    main, _, metadata, all_ranks = shard_distribution
    my_rank = dist.get_rank(parallelization_group)
    device = collective_device(parallelization_group)
    out = dict(loaded_tensors)
    for sid in sorted(main):  # the same order on every rank
        if len(all_ranks[sid]) < 2:
            continue
        src, meta = main[sid], metadata[sid]
        if src == my_rank:
            if sid not in loaded_tensors:
                raise CheckpointingException(f"exchange: rank {my_rank} should send shard {sid} but did not load it")
            buf = loaded_tensors[sid].to(device=device, dtype=meta.dtype).contiguous()
        else:
            buf, _ = _get_empty_tensor_for_exchange(sid, unloaded_shards, metadata, {}, device=device)
        dist.broadcast(buf, src=_global_rank(parallelization_group, src), group=parallelization_group)
        if src != my_rank and sid in unloaded_shards:
            if on_received is not None:
                on_received(sid, buf)
            else:
                out[sid] = buf
        del buf
    return out


def _all_gather_merged(local: Dict[_ShardId, Any], group: Optional[dist.ProcessGroup]) -> Dict[_ShardId, Any]:
    """Every rank's ``{shard id: value}`` merged (one ``all_gather_object``); a shard id from two ranks is a
    CheckpointingException "Duplicate shard ids loaded by different ranks" naming it."""
    gathered: List[Optional[Dict[_ShardId, Any]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    merged: Dict[_ShardId, Any] = {}
    for rank, items in enumerate(gathered):
        for sid, value in items.items():
            if sid in merged:
                raise CheckpointingException(f"Duplicate shard ids loaded by different ranks: shard {sid} (also "
                                             f"rank {rank})")
            merged[sid] = value
    return merged


def exchange_loaded_objects_gather_object(loaded_objects: Dict[_ShardId, Any]) -> Dict[_ShardId, Any]:
    """Upstream's function: the objects every rank loaded (over WORLD), merged; duplicates refused."""
    return _all_gather_merged(loaded_objects, None)


def exchange_loaded_tensors_gather_object(
    loaded_tensors: Dict[_ShardId, torch.Tensor],
    unloaded_shards: Dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Optional[dist.ProcessGroup] = None,
    *,
    on_received: Optional[Callable[[_ShardId, torch.Tensor], None]] = None,
) -> Dict[_ShardId, torch.Tensor]:
    """Like ``exchange_loaded_tensors_broadcast`` with one ``all_gather_object`` of every rank's loaded tensors
    (simple, for debugging; every rank holds every loaded shard at once). CheckpointingException if two ranks
    loaded the same shard."""
    everything = _all_gather_merged({k: v.cpu() for k, v in loaded_tensors.items()}, parallelization_group)
    out = dict(loaded_tensors)
    for sid in sorted(unloaded_shards):
        if sid not in everything:
            raise CheckpointingException(f"exchange: no rank loaded shard {sid}")
        if on_received is not None:
            on_received(sid, everything[sid])
        else:
            out[sid] = everything[sid]
    return out


@torch.no_grad()
def exchange_loaded_tensors_gather_rounds(
    loaded_tensors: Dict[_ShardId, torch.Tensor],
    unloaded_shards: Dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution = None,
    parallelization_group: Optional[dist.ProcessGroup] = None,
    *,
    on_received: Optional[Callable[[_ShardId, torch.Tensor], None]] = None,
) -> Dict[_ShardId, torch.Tensor]:
    """Upstream's round-based exchange: per dtype, the shards needed by more than one rank are lined up by loading
    rank, and round ``k`` exchanges every rank's ``k``-th such shard at once (an empty tensor from a rank that has
    no more); one ``all_gather`` per round where the round's shards have one shape, else one broadcast per rank of
    the round (gloo's all_gather takes equal sizes only). Collective. Returns what
    ``exchange_loaded_tensors_broadcast`` returns (received shards in place where possible; ``on_received`` as
    there)."""
    if shard_distribution is None:
        raise CheckpointingException("exchange_loaded_tensors_gather_rounds needs a ShardDistribution (got None)")
    main, _, metadata, all_ranks = shard_distribution
    my_rank, size = dist.get_rank(parallelization_group), dist.get_world_size(parallelization_group)
    device = collective_device(parallelization_group)
    out = dict(loaded_tensors)
    for dtype in sorted({metadata[sid].dtype for sid in main}, key=str):
        by_rank: List[List[_ShardId]] = [[] for _ in range(size)]
        for sid in sorted(main):  # the same order on every rank
            if len(all_ranks[sid]) > 1 and metadata[sid].dtype == dtype:
                by_rank[main[sid]].append(sid)
        for round_ids in zip_longest(*by_rank):
            bufs, received = [], {}
            for rank, sid in enumerate(round_ids):
                if sid is None:
                    bufs.append(torch.empty(0, dtype=dtype, device=device))
                elif rank == my_rank:
                    if sid not in loaded_tensors:
                        raise CheckpointingException(
                            f"exchange: rank {my_rank} should send shard {sid} but did not load it")
                    bufs.append(loaded_tensors[sid].to(device=device, dtype=dtype).contiguous()
                                .reshape(_exchange_shape(metadata[sid])))
                else:
                    buf, _ = _get_empty_tensor_for_exchange(sid, unloaded_shards, metadata, {}, device=device)
                    bufs.append(buf)
                    if sid in unloaded_shards:
                        received[sid] = buf
            shapes = {(0,) if sid is None else tuple(_exchange_shape(metadata[sid])) for sid in round_ids}
            if len(shapes) == 1:  # decided from the metadata: the same on every rank
                dist.all_gather(bufs, bufs[my_rank], group=parallelization_group)
            else:
                for rank, buf in enumerate(bufs):
                    if buf.numel():
                        dist.broadcast(buf, src=_global_rank(parallelization_group, rank),
                                       group=parallelization_group)
            for sid, buf in received.items():
                if on_received is not None:
                    on_received(sid, buf)
                else:
                    out[sid] = buf
            del bufs, received
    return out


def exchange_by_distribution(
    loaded_tensors: Dict[_ShardId, torch.Tensor],
    unloaded_shards: Dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Optional[dist.ProcessGroup] = None,
    exchange_algo: str = "broadcast",
    *,
    on_received: Optional[Callable[[_ShardId, torch.Tensor], None]] = None,
) -> Dict[_ShardId, torch.Tensor]:
    """Exchange the loaded shards with ``exchange_algo``: ``'broadcast'`` (default), ``'gather_object'`` or
    ``'gather_rounds'`` (upstream's three); another name is a CheckpointingException naming it."""
    if shard_distribution is None:
        raise CheckpointingException("exchange_by_distribution needs a ShardDistribution (got None)")
    algos = {
        "broadcast": exchange_loaded_tensors_broadcast,
        "gather_object": exchange_loaded_tensors_gather_object,
        "gather_rounds": exchange_loaded_tensors_gather_rounds,
    }
    if exchange_algo not in algos:
        raise CheckpointingException(
            f"exchange_by_distribution: exchange_algo {exchange_algo!r} is not supported; supported: "
            f"{', '.join(EXCHANGE_ALGOS)}"
        )
    return algos[exchange_algo](
        loaded_tensors, unloaded_shards, shard_distribution, parallelization_group, on_received=on_received
    )
