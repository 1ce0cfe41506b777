"""What the training loop decides after each iteration besides the step itself (upstream's flags):

- saves: ``--save-interval`` (persistent), else ``--non-persistent-save-interval`` (``<save>/non_persistent``, only
  the latest kept);
- exits, every rank together: ``--exit-signal-handler`` (SIGTERM arrived on any rank: save with ``--save``, exit
  with code 0), ``--exit-duration-in-mins`` (the run is older than that: save, exit), ``--exit-interval``;
- housekeeping: ``--manual-gc`` / ``--manual-gc-interval`` / ``--no-manual-gc-eval`` (Python's collector disabled,
  run at fixed iterations on every rank, so no rank stalls a collective at a random time),
  ``--empty-unused-memory-level`` (return the CUDA caching allocator's unused blocks),
  ``--record-memory-history`` / ``--memory-snapshot-path`` (CUDA allocator history, dumped at the end).
"""
import gc
import signal
import time
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.dist_utils import is_distributed
from megatron.training.dist_signal_handler import DistributedSignalHandler
from megatron.training.utils import print_rank_0


_clock = time.time  # --exit-duration-in-mins (a test replaces it)


def release_cached_memory() -> bool:
    """Return the CUDA caching allocator's unused blocks to the device; False (nothing to do) without CUDA."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        return True
    return False


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (collective when distributed)."""
    if not is_distributed():
        return flag
    from megatron.core import parallel_state

    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=parallel_state.collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class RunControl:
    """Per-run state of the flags above. ``start_time``: when the run started (``--exit-duration-in-mins`` counts
    from there, as upstream counts from the start of ``pretrain``). Use as a context manager (or call
    :meth:`close`): the SIGTERM handler and the garbage collector are restored at the end."""

    def __init__(self, args, start_time: Optional[float] = None):
        self.args = args
        self.start_time = _clock() if start_time is None else start_time
        self.signal_handler = None
        self.collections = 0  # manual garbage collections run (tests, log)
        self.releases = 0  # --empty-unused-memory-level releases asked for
        self.interrupted = False  # stopped by SIGTERM or --exit-duration-in-mins (no final evaluation then)
        self._gc_was_enabled = gc.isenabled()
        if args.exit_signal_handler:
            self.signal_handler = DistributedSignalHandler(signal.SIGTERM).__enter__()
        if args.manual_gc:
            gc.disable()
            self._collect()
        if getattr(args, "record_memory_history", False):
            torch.cuda.memory._record_memory_history()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self) -> None:
        if self.signal_handler is not None:
            self.signal_handler.release()
            self.signal_handler = None
        if self.args.manual_gc and self._gc_was_enabled:
            gc.enable()
        if getattr(self.args, "record_memory_history", False):
            torch.cuda.memory._dump_snapshot(self.args.memory_snapshot_path)
            print_rank_0(f"  CUDA memory history written to {self.args.memory_snapshot_path}")

    def _collect(self) -> None:
        gc.collect()
        self.collections += 1

    def _release(self) -> None:
        self.releases += 1
        release_cached_memory()

    # ---- per iteration ---------------------------------------------------------------------------------------
    def after_step(self, iteration: int) -> None:
        """After the optimizer step of ``iteration``."""
        if self.args.empty_unused_memory_level >= 1:
            self._release()
        if self.args.manual_gc and self.args.manual_gc_interval and iteration % self.args.manual_gc_interval == 0:
            self._collect()

    def around_evaluation(self) -> None:
        """Before and after an evaluation (upstream collects there with --manual-gc, releases memory at level 2)."""
        if self.args.manual_gc and self.args.manual_gc_eval:
            self._collect()
        if self.args.empty_unused_memory_level >= 2:
            self._release()

    def save_and_decide_exit(self, iteration: int, save: Callable[..., None]) -> Tuple[Optional[str], bool]:
        """Save as the flags ask after ``iteration`` (``save(non_persistent=False)``) and decide, on every rank
        together, whether to stop. Returns (why the run stops, or None; whether a persistent checkpoint of
        ``iteration`` was saved)."""
        args = self.args
        if self.signal_handler is not None and any(self.signal_handler.signals_received()):
            saved = bool(args.save)
            self.interrupted = True
            if saved:
                save()
            return f"exiting program after receiving SIGTERM (iteration {iteration})", saved
        saved = False
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save()
            saved = True
        elif args.non_persistent_save_interval and iteration % args.non_persistent_save_interval == 0:
            save(non_persistent=True)
        if args.exit_duration_in_mins:
            minutes = (_clock() - self.start_time) / 60.0
            if _any_rank(minutes > args.exit_duration_in_mins):
                self.interrupted = True
                if args.save and not saved:
                    save()
                    saved = True
                return (f"exiting program after {minutes:.2f} minutes (--exit-duration-in-mins "
                        f"{args.exit_duration_in_mins}) at iteration {iteration}"), saved
        if args.exit_interval and iteration % args.exit_interval == 0:
            return f"exiting program at iteration {iteration} (--exit-interval {args.exit_interval})", saved
        return None, saved
