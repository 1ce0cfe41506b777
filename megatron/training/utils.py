"""Small helpers of the training loop: rank-0 printing, loss averaging, memory figures, the exit on a user error."""
import os
import resource
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_utils import get_rank, get_world_size, is_distributed


def get_rank_safe() -> int:
    """This process's rank: torch.distributed's once initialised, before that the launcher's ``RANK`` (0 without
    one), as upstream's ``get_rank_safe``."""
    return get_rank() if is_distributed() else int(os.getenv("RANK", "0"))


def print_rank_0(message: str) -> None:
    if get_rank_safe() == 0:
        print(message, flush=True)


def is_last_rank() -> bool:
    return get_rank() == get_world_size() - 1


def print_rank_last(message: str) -> None:
    if is_last_rank():
        print(message, flush=True)


def unwrap_model(model):
    """The innermost module below DDP/FSDP wrappers (``.module`` chains); keeps lists as lists."""
    if isinstance(model, (list, tuple)):
        return [unwrap_model(m) for m in model]
    while hasattr(model, "module") and isinstance(getattr(model, "module"), torch.nn.Module):
        model = model.module
    return model


def average_losses_across_data_parallel_group(losses):
    """Mean of each loss over the data-parallel ranks (a float32 tensor)."""
    averaged = torch.stack([l.detach().float().reshape(()) for l in losses])
    group = parallel_state.get_data_parallel_group()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(averaged, group=group)
        averaged = averaged / dist.get_world_size(group)
    return averaged


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux ``/proc/self/statm``; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_report() -> str:
    """``max allocated`` on CUDA, ``RSS`` on CPU, in MiB."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"mem max allocated (MiB): {torch.cuda.max_memory_allocated() / 2**20:.1f}"
    return f"mem RSS (MiB): {current_rss_bytes() / 2**20:.1f}"


class TrainingStopped(RuntimeError):
    """Training stopped on purpose, the same way on every rank (a non-finite loss); ``exit_on_user_error`` prints it
    as one line."""


@contextmanager
def exit_on_user_error():
    """Turn a checkpoint or argument error or a stop of training (raised the same on every rank) into one line on rank 0's stderr,
    ``error: <message>``, and exit code 1 on every rank, instead of a traceback per rank. Other exceptions pass."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.training.checkpoint_safety import CheckpointError

    try:
        yield
    except (CheckpointError, CheckpointingException) as e:
        message = f"checkpoint error: {e}"
    except TrainingStopped as e:
        message = f"training stopped: {e}"
    except SystemExit as e:
        if not isinstance(e.code, str):  # exit codes (argparse, sys.exit(n)) keep their own behavior
            raise
        message = e.code
    else:
        return
    if get_rank_safe() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    if is_distributed():
        dist.destroy_process_group()
    raise SystemExit(1)


def get_batch_on_this_cp_rank(batch: dict, cp_group=None) -> dict:
    """Upstream's batch split for context parallelism: each ``[b, s, ...]`` tensor of ``batch`` (tokens, labels,
    loss mask, position ids; ``attention_mask`` ``[b, 1, s, s]`` on its query axis) cut into ``2 * cp`` chunks
    along the sequence, this CP rank keeping chunks ``r`` and ``2 cp - 1 - r`` (load-balanced for causal masks).
    None values are kept; the batch is returned unchanged without context parallelism."""
    from megatron.core.transformer.context_parallel import split_for_cp_rank

    if cp_group is None:
        cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
    size = dist.get_world_size(cp_group) if cp_group is not None else 1
    if size == 1:
        return batch
    rank = dist.get_rank(cp_group)
    return {key: val if val is None else split_for_cp_rank(val, 2 if key == "attention_mask" else 1, size, rank)
            for key, val in batch.items()}
