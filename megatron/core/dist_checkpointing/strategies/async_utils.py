"""Asynchronous checkpoint save: upstream megatron-core 0.19's ``AsyncRequest`` / ``AsyncCallsQueue`` API on top of
PyTorch DCP's own asynchronous machinery.

How an asynchronous save runs::

    request = dist_checkpointing.save(sd, ckpt_dir, async_sharded_save=True)   # plan checks; nothing written yet
    request.add_finalize_fn(advance_tracker)                                  # the caller's finalize step
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)        # CPU copy taken now (preload_fn), write starts in the background
    ...training continues, the weights may change...
    queue.maybe_finalize_async_calls()           # each step: finalizes what finished on *every* rank
    queue.close()                                # at exit: waits for and finalizes what is pending

``schedule_async_request`` calls the request's ``preload_fn`` on the calling thread: for the ``torch_dist`` strategy
this copies the tensors this rank writes into host buffers kept and reused by every later save of the same shapes
(``host_staging.py``: page-locked on CUDA; shared memory when the write runs in DCP's checkpoint process). When ``schedule_async_request`` returns, the copy is complete: the training step may change the
weights. ``async_fn`` then runs in a background thread of this module (``TemporalAsyncCaller``: one per request;
``PersistentAsyncCaller``: one long-lived worker); for ``torch_dist`` it hands the staged copy to
``torch.distributed.checkpoint.async_save`` (``AsyncCheckpointerType.PROCESS``: DCP's checkpoint process does the
planning collectives and writes the files; ``THREAD``: a DCP thread of this process does) and waits for it.

Finalization: ``maybe_finalize_async_calls`` asks every rank (one all-reduce) whether its oldest request finished;
only when all have, each rank raises the write errors of any rank (the same ``CheckpointingException`` everywhere) or
runs the request's ``finalize_fns`` in order (``metadata.json``, ``integrity.json``, then the caller's, e.g. the
training tracker). A process killed before that leaves no ``metadata.json`` and an unchanged tracker.

Requests of one process run one after another (in scheduling order, the same on every rank), so the collectives of
two writes never interleave. The background collectives use a separate gloo group (``async_process_group``), never
the training's groups.

``nvidia-resiliency-ext`` is optional: ``get_async_strategy("nvrx")`` returns its classes when it is installed and
raises ``ModuleNotFoundError`` otherwise (as upstream); ``resolve_async_strategy`` (used by training's
``--async-strategy``) falls back to this module's callers ("mcore") and says so once in the log.
"""
import logging
import queue as _queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from ... import dist_utils
from ..core import CheckpointingException

logger = logging.getLogger(__name__)

def _log_once(key, level: int, message: str, rank0: bool = False) -> None:
    dist_utils.log_once(logger, key, level, message, rank0=rank0)


# ---- the request ---------------------------------------------------------------------------------------------------
class AsyncRequest(NamedTuple):
    """An asynchronous call and what to do once it finished on every rank (upstream's fields and order).

    ``async_fn(*async_fn_args, **async_fn_kwargs)`` runs in the background (``None``: nothing to run).
    ``preload_fn()``, when given, runs on the scheduling thread first and its result replaces
    ``async_fn_args[1]`` (upstream's convention: the staged state dict). ``finalize_fns`` run in order, on every
    rank, after every rank's ``async_fn`` returned. ``call_idx`` is set by ``AsyncCallsQueue``.
    """

    async_fn: Optional[Callable]
    async_fn_args: Tuple
    finalize_fns: List[Callable]
    async_fn_kwargs: Dict = {}
    preload_fn: Optional[Callable] = None
    is_frozen: bool = False
    call_idx: int = 0

    def add_finalize_fn(self, fn: Callable) -> None:
        """Append ``fn`` to the finalize functions (run after the existing ones)."""
        if self.is_frozen:
            raise RuntimeError("Cannot add finalization functions to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def _resolved_args(self) -> Tuple:
        args = tuple(self.async_fn_args)
        if self.preload_fn is not None:
            if len(args) < 2:
                raise CheckpointingException(
                    "AsyncRequest with a preload_fn needs at least 2 async_fn_args (the 2nd is replaced by what "
                    f"preload_fn returns), got {len(args)}"
                )
            args = args[:1] + (self.preload_fn(),) + args[2:]
        return args

    def execute_sync(self) -> None:
        """Run the request synchronously: preload, ``async_fn``, a barrier, then the finalize functions."""
        args = self._resolved_args()
        if self.async_fn is not None:
            self.async_fn(*args, **self.async_fn_kwargs)
        if dist_utils.is_distributed():
            dist.barrier()
        for fn in self.finalize_fns:
            fn()

    def freeze(self) -> "AsyncRequest":
        """A copy that refuses ``add_finalize_fn``."""
        return self._replace(is_frozen=True)


# ---- background execution ------------------------------------------------------------------------------------------
class _Call:
    """One request in flight in this process: its thread/worker result."""

    def __init__(self, call_idx: int):
        self.call_idx = call_idx
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.start_time = time.time()
        self.end_time: Optional[float] = None

    def run(self, fn: Optional[Callable], args: Tuple, kwargs: Dict) -> None:
        try:
            if fn is not None:
                fn(*args, **kwargs)
        except BaseException as e:  # reported at finalization, on every rank
            self.error = e
            logger.error(f"asynchronous checkpoint call {self.call_idx} failed: {type(e).__name__}: {e}")
        finally:
            self.end_time = time.time()
            self.done.set()


_order_lock = threading.Lock()
_last_thread: Optional[threading.Thread] = None


class AsyncCaller(ABC):
    """Runs requests in the background and tells when the current one finished on all ranks."""

    @abstractmethod
    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Preload on this thread, then start ``async_fn`` in the background (call on every rank)."""

    @abstractmethod
    def _current(self) -> Optional[_Call]:
        """The oldest call of this caller not yet reported done."""

    @abstractmethod
    def _pop_current(self) -> Optional[_Call]:
        """Forget the oldest call (it was reported done on all ranks)."""

    def sync_all_async_calls(self, is_alive: int) -> bool:
        """True when no rank is still running its current call (one all-reduce over WORLD)."""
        from ...parallel_state import collective_device

        t = torch.tensor([int(is_alive)], dtype=torch.int32, device=collective_device())
        dist.all_reduce(t)
        return int(t.item()) == 0

    def is_current_async_call_done(self, blocking: bool, no_dist: bool) -> bool:
        """Whether the current call finished on all ranks (``no_dist``: on this rank); ``blocking`` waits for it.
        Call on every rank (unless ``no_dist``)."""
        call = self._current()
        if call is not None and blocking:
            call.done.wait()
        is_alive = int(call is not None and not call.done.is_set())
        done = not is_alive if (no_dist or not dist_utils.is_distributed()) else self.sync_all_async_calls(is_alive)
        if done:
            self.last_call = self._pop_current()
        return done

    @abstractmethod
    def close(self, abort: bool = False) -> None:
        """Release the background resources (``abort``: do not wait for a running call)."""


def _start_in_order(call: _Call, async_req: AsyncRequest, args: Tuple) -> threading.Thread:
    """A daemon thread running the request after the previously started one finished (the same order on every
    rank, so background collectives never interleave)."""
    global _last_thread
    with _order_lock:
        previous = _last_thread

        def target():
            if previous is not None:
                previous.join()
            call.run(async_req.async_fn, args, async_req.async_fn_kwargs)

        thread = threading.Thread(target=target, name=f"mcore-async-ckpt-{call.call_idx}", daemon=True)
        thread.start()
        _last_thread = thread
    return thread


class TemporalAsyncCaller(AsyncCaller):
    """One background thread per request (upstream: one forked process per request)."""

    def __init__(self):
        self.call: Optional[_Call] = None
        self.thread: Optional[threading.Thread] = None
        self.last_call: Optional[_Call] = None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        if self.call is not None:
            raise CheckpointingException("TemporalAsyncCaller runs one request; create one per request")
        self.call = _Call(async_req.call_idx)
        args = async_req._resolved_args()  # the CPU copy, on this thread
        if async_req.async_fn is None:
            self.call.run(None, args, {})
            return
        self.thread = _start_in_order(self.call, async_req, args)

    def _current(self) -> Optional[_Call]:
        return self.call

    def _pop_current(self) -> Optional[_Call]:
        call, self.call = self.call, None
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        return call

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """As ``AsyncCaller.is_current_async_call_done``, with upstream's defaults (non-blocking, synchronized)."""
        return super().is_current_async_call_done(blocking, no_dist)

    def close(self, abort: bool = False) -> None:
        if self.thread is not None and not abort:
            self.thread.join()
        self.thread = None


class PersistentAsyncCaller(AsyncCaller):
    """One long-lived background worker thread for all requests (upstream: one spawned worker process)."""

    def __init__(self):
        self.requests: "_queue.Queue" = _queue.Queue()
        self.calls: Deque[_Call] = deque()
        self.worker: Optional[threading.Thread] = None
        self.last_call: Optional[_Call] = None

    def _loop(self) -> None:
        while True:
            item = self.requests.get()
            if item is None:
                return
            call, fn, args, kwargs = item
            call.run(fn, args, kwargs)

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        call = _Call(async_req.call_idx)
        args = async_req._resolved_args()
        if self.worker is None:
            self.worker = threading.Thread(target=self._loop, name="mcore-async-ckpt-worker", daemon=True)
            self.worker.start()
        self.calls.append(call)
        self.requests.put((call, async_req.async_fn, args, async_req.async_fn_kwargs))

    def _current(self) -> Optional[_Call]:
        return self.calls[0] if self.calls else None

    def _pop_current(self) -> Optional[_Call]:
        return self.calls.popleft() if self.calls else None

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """As ``AsyncCaller.is_current_async_call_done``, with upstream's defaults (non-blocking, synchronized)."""
        return super().is_current_async_call_done(blocking, no_dist)

    def close(self, abort: bool = False) -> None:
        if self.worker is not None:
            self.requests.put(None)
            if not abort:
                self.worker.join()
            self.worker = None

    def __del__(self):
        """Stops the worker (after the requests already queued) when the caller is dropped."""
        if getattr(self, "worker", None) is not None:
            self.requests.put(None)
            self.worker = None


class _ActiveAsyncRequest(NamedTuple):
    idx: int
    async_caller: AsyncCaller
    async_request: AsyncRequest


class AsyncCallsQueue:
    """Requests in flight, finalized in scheduling order once they finished on every rank (upstream's API)."""

    def __init__(self, persistent: bool = False):
        self.async_calls: Deque[_ActiveAsyncRequest] = deque()
        self.call_idx: int = -1
        self.persistent = persistent
        self.persistent_caller: Optional[PersistentAsyncCaller] = None

    def _get_async_caller(self) -> AsyncCaller:
        if not self.persistent:
            return TemporalAsyncCaller()
        if self.persistent_caller is None:
            self.persistent_caller = PersistentAsyncCaller()
        return self.persistent_caller

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Preload (the CPU copy) now and start the request in the background; returns its index. Call on every
        rank, in the same order."""
        if not isinstance(async_request, AsyncRequest):
            raise CheckpointingException(
                f"schedule_async_request: expected an AsyncRequest (from save(..., async_sharded_save=True)), got "
                f"{type(async_request).__name__}"
            )
        self.call_idx += 1
        caller = self._get_async_caller()
        request = async_request.freeze()
        caller.schedule_async_call(request._replace(call_idx=self.call_idx, finalize_fns=[]))
        self.async_calls.append(_ActiveAsyncRequest(self.call_idx, caller, request))
        return self.call_idx

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> List[int]:
        """Finalize, in order, the requests that finished on every rank (``blocking``: wait for all of them);
        returns their indices. A write error on any rank is raised on every rank as a CheckpointingException and
        that request's finalize functions are not run. Call on every rank (``no_dist``: no collectives; each rank
        decides alone)."""
        finalized = []
        while self.async_calls:
            idx, caller, request = self.async_calls[0]
            if not caller.is_current_async_call_done(blocking, no_dist):
                break
            self.async_calls.popleft()
            call = caller.last_call
            error = None
            if call is not None and call.error is not None:
                error = f"asynchronous checkpoint save {idx} failed: {type(call.error).__name__}: {call.error}"
            if no_dist or not dist_utils.is_distributed():
                if error:
                    raise CheckpointingException(error) from call.error
            else:
                dist_utils.raise_collectively(error, CheckpointingException, "asynchronous checkpoint save")
            for fn in request.finalize_fns:
                fn()
            if not no_dist and dist_utils.is_distributed():
                from ...parallel_state import collective_device

                t = torch.tensor([idx], dtype=torch.int64, device=collective_device())
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if int(t.item()) != idx:
                    raise CheckpointingException(
                        f"asynchronous checkpoint finalization: rank {dist.get_rank()} finalized call {idx} while "
                        f"another rank finalized {int(t.item())} (not every rank calls maybe_finalize_async_calls)"
                    )
            finalized.append(idx)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        return len(self.async_calls)

    def close(self, abort: bool = False) -> None:
        """Finalize every pending request (``abort``: drop them unfinalized), then stop the worker."""
        if not abort:
            self.maybe_finalize_async_calls(blocking=True)
        else:
            self.async_calls.clear()
        if self.persistent_caller is not None:
            self.persistent_caller.close(abort=abort)
            self.persistent_caller = None


# ---- DCP: staging and the background write -------------------------------------------------------------------------
_ckpt_group: Optional[Tuple[Any, Any]] = None  # (default group it belongs to, the gloo group)


def async_process_group():
    """A gloo group over WORLD for the background writes (collective on first use, then cached while the default
    group and it live; made again after ``destroy_process_group`` of it, as code that tears its subgroups down
    between runs does, e.g. upstream's unit tests at 8 ranks): the training's groups (NCCL on GPU) are never used
    from the background."""
    global _ckpt_group
    if not dist_utils.is_distributed():
        return None
    default = dist.distributed_c10d._get_default_group()
    if (_ckpt_group is None or _ckpt_group[0] is not default
            or _ckpt_group[1] not in dist.distributed_c10d._world.pg_map):
        _ckpt_group = (default, dist.new_group(backend="gloo"))
    return _ckpt_group[1]


CHECKPOINTER_TYPES = ("process", "thread")


class _NoStaging:
    """The AsyncStager handed to ``async_save``: the state dict was staged when the request was scheduled."""

    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def dcp_async_write(checkpoint_dir, staged_state_dict, storage_writer, planner, checkpointer_type: str,
                    process_group) -> None:
    """The background part of an async ``torch_dist`` save: ``torch.distributed.checkpoint.async_save`` of the
    staged state dict, waited for (raises what the write raised)."""
    from torch.distributed.checkpoint import async_save
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    kind = AsyncCheckpointerType.PROCESS if checkpointer_type == "process" else AsyncCheckpointerType.THREAD
    import warnings

    from torch.distributed.checkpoint.api import CheckpointException as TorchCheckpointException

    from .filesystem import wrap_dcp_error

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
            future = async_save(
                staged_state_dict, storage_writer=storage_writer, planner=planner, process_group=process_group,
                async_checkpointer_type=kind, async_stager=_NoStaging(), no_dist=not dist_utils.is_distributed(),
            )
            (future.upload_completion if hasattr(future, "upload_completion") else future).result()
    except CheckpointingException:
        raise
    except (Exception, TorchCheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise wrap_dcp_error(e, Path(checkpoint_dir), None, "asynchronous save") from e


def check_checkpointer_type(checkpointer_type: str) -> str:
    if checkpointer_type not in CHECKPOINTER_TYPES:
        raise CheckpointingException(
            f"async checkpointer type {checkpointer_type!r} is not one of {CHECKPOINTER_TYPES}"
        )
    return checkpointer_type


# ---- strategy selection (upstream's get_async_strategy) -------------------------------------------------------------
_NVRX_ASYNC = "nvidia_resiliency_ext.checkpointing.async_ckpt"
_NVRX_NAMES = {  # upstream's names for NVRx's classes, by the NVRx module that holds them
    "core": ("AsyncCallsQueue", "AsyncRequest"),
    "cached_metadata_filesystem_reader": ("CachedMetadataFileSystemReader",),
    "filesystem_async": ("FileSystemWriterAsync", "_results_queue", "get_write_results_queue"),
    "state_dict_saver": ("CheckpointMetadataCache", "save_state_dict_async_finalize", "save_state_dict_async_plan"),
}
NVRX_REQUIRED = ('A compatible `nvidia-resiliency-ext` installation is required for `async_strategy="nvrx"`. '
                 'Please install it or set `async_strategy` to `mcore`.')


def _mcore_async_modules() -> Dict[str, Any]:
    from . import filesystem_async
    from .cached_metadata_filesystem_reader import CachedMetadataFileSystemReader

    return {
        "AsyncCallsQueue": AsyncCallsQueue,
        "AsyncRequest": AsyncRequest,
        "TemporalAsyncCaller": TemporalAsyncCaller,
        "PersistentAsyncCaller": PersistentAsyncCaller,
        "CachedMetadataFileSystemReader": CachedMetadataFileSystemReader,
        "FileSystemWriterAsync": filesystem_async.FileSystemWriterAsync,
        "_results_queue": filesystem_async._results_queue,
        "get_write_results_queue": filesystem_async.get_write_results_queue,
    }


def _nvrx_async_modules() -> Dict[str, Any]:
    import importlib

    modules = {}
    try:
        for module, names in _NVRX_NAMES.items():
            found = importlib.import_module(f"{_NVRX_ASYNC}.{module}")
            modules.update({name: getattr(found, name) for name in names})
    except (ImportError, AttributeError):
        raise ModuleNotFoundError(NVRX_REQUIRED) from None
    return modules


def get_async_strategy(async_strategy: str = "nvrx", module: Optional[str] = None):
    """``(strategy, modules)``: the async-save classes and functions of ``async_strategy`` ("mcore": this fork's;
    "nvrx": nvidia-resiliency-ext's, ``ModuleNotFoundError`` when it is not installed) as a dict by upstream's names,
    or the one named ``module`` (``KeyError`` when there is none). Another strategy is a ``TypeError``, as upstream."""
    if async_strategy == "mcore":
        modules = _mcore_async_modules()
    elif async_strategy == "nvrx":
        modules = _nvrx_async_modules()
    else:
        raise TypeError(f"async_strategy {async_strategy} is not supported. Available strategies: nvrx, mcore.")
    if module is None:
        return async_strategy, modules
    if module not in modules:
        raise KeyError(f"async strategy {async_strategy!r} has no {module!r}; it has {sorted(modules)}")
    return async_strategy, modules[module]


ASYNC_STRATEGIES = ("nvrx", "mcore")


def check_async_strategy(async_strategy: str, where: str) -> str:
    """``async_strategy`` when it is one of upstream's ("nvrx", "mcore"); else an error naming ``where``."""
    if async_strategy not in ASYNC_STRATEGIES:
        raise CheckpointingException(f"{where}: async_strategy must be 'nvrx' or 'mcore', got {async_strategy!r}")
    return async_strategy


def resolve_async_strategy(requested: str = "nvrx") -> str:
    """The strategy this fork's asynchronous save runs with: always the built-in one ("mcore": PyTorch DCP's
    async_save under this module's queue); a request for "nvrx" is said once in the log, with whether
    nvidia-resiliency-ext is installed."""
    check_async_strategy(requested, "--async-strategy")
    if requested == "nvrx":
        try:
            get_async_strategy("nvrx")
            why = "nvidia-resiliency-ext is installed but this fork writes through PyTorch DCP's async_save"
        except ImportError:
            why = "nvidia-resiliency-ext is not installed"
        _log_once(("nvrx", why), logging.WARNING, f"async checkpoint save: {why}; using the built-in caller (mcore)",
                  rank0=True)
    return "mcore"
