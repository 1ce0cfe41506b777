"""The one home of the small torch.distributed helpers every layer uses: is it distributed, rank, world size,
barrier, the default device, raising one error on every rank, and logging a message once per process.

Each works without torch.distributed (one process: rank 0 of 1, barrier a no-op). Groups default to WORLD.
"""
import logging
from typing import Dict, Hashable, List, Optional, Set, Tuple, Type

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True when torch.distributed is available and initialised."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Optional[dist.ProcessGroup] = None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: Optional[dist.ProcessGroup] = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def barrier(group: Optional[dist.ProcessGroup] = None) -> None:
    if get_world_size(group) > 1:
        dist.barrier(group=group)


def default_device() -> torch.device:
    """The current CUDA device when CUDA is available, else the CPU: where real tensors go by default (pass it
    explicitly to factory functions; it stays real under ``with torch.device('meta')``)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def raise_collectively(
    error: Optional[str],
    exc_type: Type[Exception] = RuntimeError,
    what: str = "operation",
    group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Collective over ``group``: if any rank has an ``error`` (a message, None for none), raise ``exc_type`` with the
    same message on every rank (the ranks named when not all failed; the distinct messages joined when they
    differ). Without torch.distributed: raise ``error`` if there is one."""
    size = get_world_size(group)
    if size == 1:
        if error is not None:
            raise exc_type(error)
        return
    errors: List[Optional[str]] = [None] * size
    dist.all_gather_object(errors, error, group=group)
    msgs = []
    for e in errors:
        if e is not None and e not in msgs:
            msgs.append(e)
    if not msgs:
        return
    ranks = [r for r, e in enumerate(errors) if e is not None]
    if len(msgs) == 1:
        raise exc_type(msgs[0] if len(ranks) == len(errors) else f"{msgs[0]} (ranks {ranks})")
    raise exc_type(f"{what} failed on ranks {ranks}: " + "; ".join(msgs))


_said_once: Set[Hashable] = set()


def log_once(logger: logging.Logger, key: Hashable, level: int, message: str, rank0: bool = False) -> None:
    """``logger.log(level, message)`` the first time ``key`` is seen in this process; ``rank0``: only on global rank
    0 (a message every rank would print the same, said once per job instead of once per rank)."""
    if key not in _said_once:
        _said_once.add(key)
        if not rank0 or get_rank() == 0:
            logger.log(level, message)


def foreach_copy(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
    """``d.copy_(s)`` for every pair (dtype conversion as ``copy_``), one ``torch._foreach_copy_`` per (device,
    dtype, source dtype) group (the optimizers' and the gradient buckets' copies)."""
    groups: Dict[tuple, Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}
    for d, s in zip(dst, src):
        ds, ss = groups.setdefault((d.device, d.dtype, s.device, s.dtype), ([], []))
        ds.append(d)
        ss.append(s)
    for ds, ss in groups.values():
        torch._foreach_copy_(ds, ss)
