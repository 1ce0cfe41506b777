"""Upstream's ``filesystem_async`` module names, for the storage writer of this fork's ``torch_dist`` saves.

``FileSystemWriterAsync`` is the ``ChecksummedFileSystemWriter`` (``filesystem.py``) under upstream's name and
constructor (``path, *args, separation_hint=None, use_msc=False, **kwargs``): one DCP ``FileSystemWriter`` for
synchronous and asynchronous saves alike (an asynchronous save hands it to PyTorch DCP's ``async_save``; see
``async_utils``). Upstream's own multi-process write pipeline (``prepare_write_data``,
``get_save_function_and_args``) is not part of this fork. ``separation_hint`` writes the keys with that prefix to
files of their own, as upstream; ``use_msc`` (the Multi-Storage Client) is refused with an error naming it.

``get_write_results_queue(mp_mode)`` is upstream's process-shared queue (one per process, made on first use).
"""
import os
from typing import Optional, Union

from torch import multiprocessing as mp
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX  # noqa: F401 (upstream re-exports it here)

from ..core import CheckpointingException
from .filesystem import ChecksummedFileSystemWriter

try:
    import psutil  # noqa: F401

    HAVE_PSUTIL = True
except ImportError:
    HAVE_PSUTIL = False

_results_queue = None


def get_write_results_queue(mp_mode: str = "spawn") -> mp.Queue:
    """A queue shared with worker processes (a ``Manager`` queue of the ``mp_mode`` context), made once."""
    global _results_queue
    if _results_queue is None:
        _results_queue = mp.get_context(mp_mode).Manager().Queue()
    return _results_queue


class FileSystemWriterAsync(ChecksummedFileSystemWriter):
    """The DCP storage writer of this fork's ``torch_dist`` saves (checksummed items), under upstream's name."""

    def __init__(self, path: Union[str, os.PathLike], *args, separation_hint: Optional[str] = None,
                 use_msc: bool = False, **kwargs):
        if use_msc:
            raise CheckpointingException(
                f"FileSystemWriterAsync({path}): use_msc=True (the Multi-Storage Client) is not supported by this "
                f"fork; it writes to the local file system")
        super().__init__(path, *args, separation_hint=separation_hint, **kwargs)
        self.checkpoint_dir = path
        self.use_msc = use_msc
