"""Host buffers an asynchronous save stages into: allocated once per shape set, reused by every later save.

An asynchronous ``torch_dist`` save (``TorchDistSaveShardedStrategy.async_save``) blocks training only for one copy
of the tensors this rank writes into host memory; the write then runs in the background from that copy. Allocating
the copy anew at every save costs as much as the copy itself (page faults of fresh memory; page-locking on CUDA), so
``HostStagingBuffers`` keeps one host tensor per staged tensor, keyed by (name, shape, dtype), and reuses it while the
next save stages the same shape set (a training run: every save). A tensor of a new shape gets a new buffer; buffers
no longer staged are freed.

- CUDA sources: the buffers are page-locked (``cudaHostRegister`` of exactly their bytes, so no power-of-two rounding
  of the caching host allocator), the copies are issued ``non_blocking`` and waited for once.
- ``shared=True`` (DCP's PROCESS checkpointer writes in another process): the buffers live in shared memory, so
  handing them to the checkpoint process passes file descriptors, not a second copy of the bytes.
- Every staged tensor has its own storage of exactly its size (DCP's writer clones a tensor that is a view of a larger
  storage: one flat buffer would cost another copy in the writer).
- ``stage`` waits until the write that used the buffers last called ``release`` (so a write still reading them is
  never overwritten); the asynchronous save releases them when its write finished, failed or not.
- ``close`` (and interpreter exit) unregisters and frees everything.
"""
import atexit
import logging
import threading
import time
from typing import Callable, Dict, Optional, Tuple

import torch

from ..core import CheckpointingException

logger = logging.getLogger(__name__)


def _host_register(t: torch.Tensor) -> None:
    """Page-lock ``t``'s storage for every CUDA context (flag 1: ``cudaHostRegisterPortable``)."""
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.untyped_storage().nbytes(), 1))


def _host_unregister(t: torch.Tensor) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))


class HostStagingBuffers:
    """Reusable host copies of a rank's tensors (see the module docstring). ``pinned``: page-lock the buffers (CUDA
    sources); ``shared``: allocate them in shared memory (another process writes them).

    Counters for tests and logs: ``allocated_bytes`` (bytes allocated over the object's life), ``staged_bytes``
    (bytes copied by the last ``stage``), ``waited_s`` (how long the last ``stage`` waited for the previous write).
    """

    def __init__(self, pinned: bool, shared: bool):
        self.pinned, self.shared = pinned, shared
        self._buffers: Dict[Tuple[str, Tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self._idle = threading.Event()
        self._idle.set()
        self._lock = threading.Lock()
        self.allocated_bytes = 0
        self.staged_bytes = 0
        self.waited_s = 0.0

    def _allocate(self, shape, dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        if self.shared:
            t.share_memory_()
        if self.pinned and t.numel():
            _host_register(t)
        self.allocated_bytes += t.untyped_storage().nbytes()
        return t

    def _free(self, t: torch.Tensor) -> None:
        if self.pinned and t.numel():
            _host_unregister(t)

    def stage(self, tensors: Dict[str, torch.Tensor], convert: Optional[Callable] = None) -> Dict[str, torch.Tensor]:
        """Host copies of ``tensors`` (same keys; shapes and dtypes of ``convert(t)``), complete when this returns.
        ``convert`` (e.g. ``fp8_utils.dequantize``) runs on one tensor at a time right before its copy and its result
        is dropped right after, so a quantized state is never dequantized all at once. Until ``release`` the buffers
        belong to the caller's write; the next ``stage`` waits for that."""
        start = time.perf_counter()
        self._idle.wait()
        self.waited_s = time.perf_counter() - start
        with self._lock:
            self._idle.clear()
            try:
                return self._stage(tensors, convert)
            except BaseException:
                self._idle.set()
                raise

    def _stage(self, tensors: Dict[str, torch.Tensor], convert: Optional[Callable]) -> Dict[str, torch.Tensor]:
        staged, devices, nbytes = {}, set(), 0
        used = set()
        for name, t in tensors.items():
            src = convert(t) if convert is not None else t
            if not isinstance(src, torch.Tensor) or src.is_meta:
                raise CheckpointingException(f"async save staging: {name!r} is not a tensor with data ({type(src)})")
            key = (name, tuple(src.shape), src.dtype)
            used.add(key)
            buf = self._buffers.get(key)
            if buf is None:
                stale = [k for k in self._buffers if k[0] == name]  # this name's buffer of another shape
                for k in stale:
                    self._free(self._buffers.pop(k))
                buf = self._buffers[key] = self._allocate(key[1], key[2])
            src = src.detach()
            if src.is_cuda:
                devices.add(src.device)
            buf.copy_(src, non_blocking=self.pinned and src.is_cuda)
            staged[name] = buf
            nbytes += buf.untyped_storage().nbytes()
            del src  # a converted copy goes now (a device copy: after the transfer, in stream order)
        for key in [k for k in self._buffers if k not in used]:  # names no longer staged
            self._free(self._buffers.pop(key))
        for device in devices:
            torch.cuda.current_stream(device).synchronize()
        self.staged_bytes = nbytes
        return staged

    def release(self) -> None:
        """The write that used the staged buffers is over: the next ``stage`` may overwrite them."""
        self._idle.set()

    def held_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._buffers.values())

    def close(self, timeout: float = None) -> bool:
        """Free every buffer, once no write uses them (waits up to ``timeout`` seconds, None: as long as it takes);
        False when a write still held them (then nothing is freed)."""
        if not self._idle.wait(timeout):
            return False
        with self._lock:
            for t in self._buffers.values():
                self._free(t)
            self._buffers.clear()
        return True


_stagers: Dict[Tuple[bool, bool], HostStagingBuffers] = {}


def get_host_stager(shared: bool, pinned: bool = None) -> HostStagingBuffers:
    """The process's ``HostStagingBuffers`` for (pinned, shared); ``pinned`` defaults to whether CUDA is available."""
    pinned = torch.cuda.is_available() if pinned is None else pinned
    key = (pinned, shared)
    if key not in _stagers:
        _stagers[key] = HostStagingBuffers(pinned=pinned, shared=shared)
    return _stagers[key]


def release_host_stagers() -> None:
    """Hand every stager's buffers back as if their write had finished: for a staging whose write never runs (a
    warm-up that only allocates the buffers)."""
    for stager in _stagers.values():
        stager.release()


@atexit.register
def close_host_stagers() -> None:
    """Free the staging buffers of every stager no write uses (at interpreter exit, where a write still running is
    left alone: the process's memory goes with it; safe to call more than once)."""
    for stager in _stagers.values():
        try:
            stager.close(timeout=0)
        except Exception as e:  # never fail an exit over an unregister
            logger.warning(f"freeing async-save staging buffers failed: {type(e).__name__}: {e}")
    _stagers.clear()
