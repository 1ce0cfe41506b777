"""DCP storage classes for ``torch_dist`` checkpoints that cannot lie silently or run code on load.

``ChecksummedFileSystemWriter`` (a ``FileSystemWriter``) checksums every stored item (a tensor chunk or a bytes
object) on the bytes as they are written to the data file (no second pass over the files);
``ChecksummedFileSystemReader`` (a ``FileSystemReader``) verifies each item's bytes when it reads them and reads
``.metadata`` through ``DcpMetadataUnpickler`` (DCP's metadata classes and plain containers only)::

    dcp_save(state_dict, storage_writer=ChecksummedFileSystemWriter(path))
    dcp_load(state_dict, storage_reader=ChecksummedFileSystemReader(path))

Where the checksums live: on each item's storage info in the DCP metadata (``metadata.storage_data[index]``, torch's
``_StorageInfo``), as the extra attribute ``mcore_checksum = "<algorithm>:<8 hex digits>"`` (``crc32c`` with the
optional ``crc32c`` or ``google-crc32c`` package, else ``crc32`` from zlib). It is written in the same atomic
``.metadata`` write as the rest of the metadata, travels with the item through any rewrite of the metadata, and is
invisible to readers that do not know it: torch's own ``FileSystemReader`` (hence upstream megatron-core) restores
it as an unused attribute and reads the checkpoint as before. ``metadata.json`` is not touched. Checkpoints
without checksums (older ones, upstream's) load unverified, said once in the log by the coordinator, unless the
verification mode (``checksum_verification``, ``--ckpt-verify``) is ``require`` (then a checkpoint or item without a
checksum this installation can verify is refused) or ``off`` (nothing verified, nothing said).

How the write side sees item boundaries: the writer's file streams are wrapped (``FileSystem.create_stream``, the
narrowest hook) by ``_ChecksummingStream``, which keeps a running checksum and closes a segment at every ``tell()``;
torch's ``_write_item`` calls ``tell()`` right before and right after each item, so each item is one segment, matched
by (file, offset, length) to the ``WriteResult``. Should an item not match one segment (a future torch writing
differently), its bytes are read back from the file once to checksum it (correct, slower, said once in the log).

The read side: ``ChecksummedFileSystemReader.read_data`` runs ``staged_read.read_staged`` (tensor items read with a
few I/O threads into staging buffers, no ``torch.load``, each item's checksum computed once from the bytes read);
object items and what that module does not read take the per-item path (``_read_item_unstaged``: ``_slice_file``
checksums the item's byte range in chunks before it is parsed). A mismatch raises ``CheckpointingException``
naming the key, the file and the byte range.
"""
import io
import logging
import math
import os
import queue
import threading
import time
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystem, SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from ... import dist_utils
from ..safe_load import _PLAIN_CLASSES, SafeUnpickler, safe_pickle_load, safe_torch_load
from ..core import CheckpointingException
from .item_checks import checksum_message, checksum_range, describe_index, truncated_message  # noqa: F401

logger = logging.getLogger(__name__)

CHECKSUM_ATTR = "mcore_checksum"
VERIFY_MODES = ("auto", "require", "off")
_verify_mode = "auto"  # of readers created without ``verify=`` (``checksum_verification``)


def _check_verify_mode(mode: str) -> str:
    if mode not in VERIFY_MODES:
        raise CheckpointingException(f"checksum verification mode (--ckpt-verify) must be one of {VERIFY_MODES}, "
                                     f"got {mode!r}")
    return mode


@contextmanager
def checksum_verification(mode: str):
    """Within the block, checkpoint readers created without ``verify=`` use ``mode`` (``--ckpt-verify``): "auto"
    verifies the item checksums present (checkpoints without them load unverified, said once); "require" refuses
    a checkpoint or an item without a checksum this installation can verify; "off" verifies nothing."""
    global _verify_mode
    previous, _verify_mode = _verify_mode, _check_verify_mode(mode)
    try:
        yield
    finally:
        _verify_mode = previous


# ---- checksum algorithms ------------------------------------------------------------------------------------------
def _crc32c_impl() -> Optional[Callable[[Any, int], int]]:
    try:
        import crc32c as _c  # hardware CRC32C (SSE4.2 / ARMv8), releases the GIL on large buffers

        return lambda data, value=0: _c.crc32c(data, value)
    except ImportError:
        pass
    try:
        import google_crc32c as _g

        # google_crc32c's C extension takes bytes only (not a writable buffer's view): one copy per write
        return lambda data, value=0: _g.extend(value, bytes(data))
    except ImportError:
        return None


# name -> update(data, running_value) -> new value; ``update(b, 0)`` is the checksum of ``b``.
ALGORITHMS: Dict[str, Callable[[Any, int], int]] = {"crc32": lambda data, value=0: zlib.crc32(data, value)}
_crc32c = _crc32c_impl()
if _crc32c is not None:
    ALGORITHMS["crc32c"] = _crc32c
DEFAULT_ALGORITHM = "crc32c" if "crc32c" in ALGORITHMS else "crc32"


def format_checksum(algorithm: str, value: int) -> str:
    return f"{algorithm}:{value:08x}"


def parse_checksum(text: Any) -> Tuple[str, int]:
    """``"crc32c:1a2b3c4d"`` -> ("crc32c", 0x1a2b3c4d); anything else is a CheckpointingException."""
    try:
        algorithm, hexval = str(text).split(":", 1)
        return algorithm, int(hexval, 16)
    except ValueError:
        raise CheckpointingException(f"malformed item checksum {text!r} in the checkpoint metadata") from None


def _log_once(key, level: int, message: str, rank0: bool = False) -> None:
    dist_utils.log_once(logger, key, level, message, rank0=rank0)


# ---- .metadata -------------------------------------------------------------------------------------------------
class DcpMetadataUnpickler(SafeUnpickler):
    """Unpickler for DCP ``.metadata`` files: DCP's metadata and planner classes, the filesystem storage info, torch
    Size/dtype/layout, the memory-format encoding, paths (``StorageMeta.checkpoint_id``), MCore's ``MCoreMetadata`` and plain containers; no tensors, no
    storages, nothing else (a planted payload is refused before it is called)."""

    _SAFE_CLASSES = _PLAIN_CLASSES | frozenset(
        {
            ("torch.serialization", "_get_layout"),
            # StorageMeta.checkpoint_id: the writer's path (a Path when torch's writer made it one)
            ("pathlib", "PosixPath"),
            ("pathlib", "WindowsPath"),
            ("pathlib", "PurePosixPath"),
            ("pathlib", "PureWindowsPath"),
            ("pathlib._local", "PosixPath"),
            ("pathlib._local", "WindowsPath"),
            ("torch.distributed.checkpoint.metadata", "Metadata"),
            ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
            ("torch.distributed.checkpoint.metadata", "StorageMeta"),
            ("torch.distributed.checkpoint.metadata", "TensorProperties"),
            ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
            ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
            ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
            ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            # DCP's planner dataclasses and enums: upstream's fully parallel save keeps its global plan in the
            # metadata (plain data: the enums are looked up by value, the dataclasses filled field by field)
            ("torch.distributed.checkpoint.planner", "SavePlan"),
            ("torch.distributed.checkpoint.planner", "LoadPlan"),
            ("torch.distributed.checkpoint.planner", "WriteItem"),
            ("torch.distributed.checkpoint.planner", "ReadItem"),
            ("torch.distributed.checkpoint.planner", "WriteItemType"),
            ("torch.distributed.checkpoint.planner", "LoadItemType"),
            ("torch.distributed.checkpoint.planner", "TensorWriteData"),
            ("torch.distributed.checkpoint.planner", "BytesIOWriteData"),
            # where older torch versions kept the tensor properties
            ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
            ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
            ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"),
        }
    )
    _REPLACEMENTS: Dict[Tuple[str, str], Any] = {}
    _ALLOW_TORCH_STORAGES = False


def read_dcp_metadata_file(path: Union[str, Path]) -> Metadata:
    """The DCP ``Metadata`` in the file ``path``, read with ``DcpMetadataUnpickler``; a refused, damaged or missing
    file is a ``CheckpointingException`` naming it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            metadata = safe_pickle_load(f, str(path), DcpMetadataUnpickler)
    except OSError as e:
        raise CheckpointingException(f"cannot read DCP metadata file {path}: {e.strerror or e}") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointingException(
            f"DCP metadata file {path} holds a {type(metadata).__name__}, not torch.distributed.checkpoint Metadata"
        )
    return metadata


# ---- progress --------------------------------------------------------------------------------------------------
PROGRESS_INTERVAL_S = 10.0  # a save or load running longer prints its progress on rank 0 this often (0: never)


class _Progress:
    """Bytes done of a rank's planned bytes; prints "<what>: X of Y GB (P%), T s" on rank 0 at most every
    ``PROGRESS_INTERVAL_S`` seconds (so a short save or load prints nothing). Thread-safe (writer threads)."""

    def __init__(self, what: str, total: int):
        from ...dist_utils import get_rank

        self.what, self.total, self.done = what, max(int(total), 1), 0
        self.start = self.last = time.monotonic()
        self.on = PROGRESS_INTERVAL_S > 0 and get_rank() == 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        if not self.on:
            return
        with self._lock:
            self.done += int(n)
            now = time.monotonic()
            if now - self.last < PROGRESS_INTERVAL_S:
                return
            self.last = now
        print(f"  {self.what}: {self.done / 1e6:.1f} of {self.total / 1e6:.1f} MB on rank 0 "
              f"({min(100.0, 100.0 * self.done / self.total):.0f}%), {now - self.start:.0f} s", flush=True)


def _planned_write_bytes(items) -> int:
    """Bytes of the tensor items of a DCP save plan (object items are small and not counted)."""
    return sum(
        math.prod(item.tensor_data.size) * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
        for item in items
        if getattr(item, "tensor_data", None) is not None
    )


# ---- write -----------------------------------------------------------------------------------------------------
WRITEBACK_BYTES = 64 << 20  # a data file's written bytes are handed to the kernel's writeback this often
_fadvise = getattr(os, "posix_fadvise", None)


@contextmanager
def _torch_save_without_zip_crc():
    """torch.save computes a CRC-32 of every record of its zip archive (a serial pass at ~2 GB/s, about half of a
    DCP item's serialization time). No torch version checks it on load (PyTorch builds miniz with
    ``MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS``) and every item here carries its own CRC32C: skip it while writing.
    torch keeps this option per thread: entered in each writer thread (``create_stream``)."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None:
        yield
        return
    before = get()
    set_(False)
    try:
        yield
    finally:
        set_(before)


class _ChecksummingStream:
    """A binary write stream that checksums what passes through it, one segment between consecutive ``tell()``
    calls; ``segments`` maps (start, end) byte offsets to the segment's checksum."""

    def __init__(self, raw, update: Callable[[Any, int], int], segments: Dict[Tuple[int, int], int]):
        self._raw = raw
        self._update = update
        self.segments = segments
        self._pos = 0  # created with mode "wb": empty
        self._start = 0
        self._value = 0
        self._flushed_to = 0
        self.progress: Optional[_Progress] = None

    def _close_segment(self) -> None:
        self.segments[(self._start, self._pos)] = self._value
        self._start, self._value = self._pos, 0

    def write(self, b) -> int:
        mv = memoryview(b)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        n = self._raw.write(mv)
        n = len(mv) if n is None else n
        self._value = self._update(mv[:n], self._value)
        self._pos += n
        if self.progress is not None:
            self.progress.add(n)
        if self._pos - self._flushed_to >= WRITEBACK_BYTES:
            self._start_writeback()
        return n

    def _start_writeback(self) -> None:
        """Start the kernel's writeback of what was written so far, without waiting for it (Linux:
        ``POSIX_FADV_DONTNEED`` on dirty pages queues their write-out), so the disk works while the next items are
        serialized instead of all at the final fsync."""
        if _fadvise is None:
            return
        try:
            self._raw.flush()
            _fadvise(self._raw.fileno(), self._flushed_to, self._pos - self._flushed_to, os.POSIX_FADV_DONTNEED)
        except (OSError, ValueError, AttributeError):  # not a plain file: the final fsync does all the work
            pass
        self._flushed_to = self._pos

    def tell(self) -> int:
        self._close_segment()
        return self._pos

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if not self._raw.closed:
            self._close_segment()
        self._raw.close()

    @property
    def closed(self) -> bool:
        return self._raw.closed

    @property
    def name(self):
        return getattr(self._raw, "name", None)


class _ChecksummingFileSystem(FileSystem):
    """DCP's local FileSystem whose write streams checksum their bytes (``segments[path][(start, end)]``)."""

    def __init__(self, update: Callable[[Any, int], int]):
        super().__init__()
        self._update = update
        self.segments: Dict[str, Dict[Tuple[int, int], int]] = {}
        self.progress: Optional[_Progress] = None

    @contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            segments = self.segments.setdefault(str(path), {})
            segments.clear()
            wrapped = _ChecksummingStream(stream, self._update, segments)
            wrapped.progress = self.progress
            with _torch_save_without_zip_crc():  # here: DCP's writer threads each open their own stream
                yield wrapped
            if not wrapped.closed:
                wrapped._close_segment()


class ChecksummedFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` that records a checksum of every item it writes (see the module docstring).

    ``algorithm``: "crc32c" (needs the ``crc32c`` or ``google-crc32c`` package) or "crc32"; default: crc32c when
    available. ``separation_hint``: the items whose key starts with it go to files of their own, named as upstream's
    (``<hint>__<rank>_<n>.distcp``; the others ``__<rank>_<n>.distcp``), so ``remove_sharded_tensors`` can delete
    them. Other arguments as ``FileSystemWriter``; only torch_save serialization (DCP's default) is offered.
    """

    def __init__(self, path: Union[str, os.PathLike], *args, algorithm: Optional[str] = None,
                 separation_hint: Optional[str] = None, **kwargs):
        fmt = kwargs.get("serialization_format", SerializationFormat.TORCH_SAVE)
        if fmt != SerializationFormat.TORCH_SAVE:
            raise CheckpointingException(
                f"ChecksummedFileSystemWriter({path}): serialization_format {fmt} is not supported (torch_save only)"
            )
        super().__init__(path, *args, **kwargs)
        self.algorithm = algorithm or DEFAULT_ALGORITHM
        if self.algorithm not in ALGORITHMS:
            hint = " (install the crc32c or google-crc32c package)" if self.algorithm == "crc32c" else ""
            raise CheckpointingException(
                f"ChecksummedFileSystemWriter({path}): checksum algorithm {self.algorithm!r} is not available{hint}; "
                f"available: {sorted(ALGORITHMS)}"
            )
        self.fs = _ChecksummingFileSystem(ALGORITHMS[self.algorithm])
        self.separation_hint = separation_hint

    def __getstate__(self):
        """Picklable (DCP's process-based async save sends the writer to its checkpoint process): the checksumming
        file system is rebuilt from ``algorithm`` on the other side."""
        state = dict(self.__dict__)
        state.pop("fs", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.fs = _ChecksummingFileSystem(ALGORITHMS[self.algorithm])

    def write_data(self, plan, planner) -> Future:
        self.fs.progress = _Progress(f"saving {self.path}", _planned_write_bytes(plan.items))
        written = self._write_separated(plan, planner) if self.separation_hint else super().write_data(plan, planner)
        results = written.wait()
        # torch's extra writer threads die silently on an error (their items just have no result): refuse that
        written = {wr.index for wr in results}
        lost = [item.index for item in plan.items if item.index not in written]
        if lost:
            raise CheckpointingException(
                f"writing checkpoint {self.path} failed: {len(lost)} item(s) were not written "
                f"(first: {describe_index(lost[0])}); see the writer thread's error above"
            )
        for wr in results:
            self._annotate(wr.storage_data)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _write_separated(self, plan, planner) -> Future:
        """torch's write, with the files split by ``separation_hint`` as upstream's writer splits them: the items
        cut into ``thread_count // 2`` size-balanced buckets, each bucket's items without the hint first, then
        with it; one file per non-empty part."""
        from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _split_by_size_and_type

        if not hasattr(self, "_write_data"):
            raise CheckpointingException(f"writing {self.path} with separation_hint={self.separation_hint!r} needs "
                                         f"a torch whose FileSystemWriter has _write_data (torch {torch.__version__})")
        prefix, hint = plan.storage_data.prefix, self.separation_hint
        buckets = _split_by_size_and_type(max(1, self.thread_count // 2), plan.items)
        file_queue: "queue.Queue" = queue.Queue()
        for group in ("", hint):
            for bucket in buckets:
                items = [item for item in bucket if item.index.fqn.startswith(hint) == bool(group)]
                if items:
                    name = f"{group}{prefix}{file_queue.qsize()}{DEFAULT_SUFFIX}"
                    file_queue.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, file_queue)

    def _annotate(self, info) -> None:
        """Set ``info.mcore_checksum`` from the segment its bytes were written as."""
        path = str(self.fs.concat_path(self.path, info.relative_path))
        start, end = int(info.offset), int(info.offset) + int(info.length)
        value = self.fs.segments.get(path, {}).get((start, end))
        if value is None:  # not written as one segment: checksum it from the file (once per item)
            _log_once(
                ("readback", type(self)),
                logging.WARNING,
                f"{path}: an item was not written as one piece; its checksum is computed by reading it back",
            )
            value = checksum_range(path, start, end, ALGORITHMS[self.algorithm])
        setattr(info, CHECKSUM_ATTR, format_checksum(self.algorithm, value))


# ---- read ------------------------------------------------------------------------------------------------------
class ChecksummedFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that reads ``.metadata`` with ``DcpMetadataUnpickler`` and verifies each item's checksum
    (when the checkpoint has them) as it reads the item; a mismatch is a ``CheckpointingException`` naming the key,
    the file and the byte range."""

    def __init__(self, path: Union[str, os.PathLike], *args, safe_objects: bool = True, verify: Optional[str] = None,
                 **kwargs):
        super().__init__(path, *args, **kwargs)
        self.safe_objects = safe_objects
        self.verify = _check_verify_mode(verify or _verify_mode)  # see ``checksum_verification``
        self._index_of: Dict[int, MetadataIndex] = {}
        self.last_read_stats = None  # staged_read.ReadStats of the last read_data

    def read_data(self, plan, planner):
        """As ``FileSystemReader.read_data`` (read items handled in plan order: ``resolve_tensor``, ``copy_``,
        ``commit_tensor``), through ``staged_read.read_staged``. With ``safe_objects`` (default) every bytes item is
        first unpickled with ``safe_torch_load`` (``weights_only=True`` + ``SAFE_GLOBALS``) before the planner sees
        it: DCP's ``DefaultLoadPlanner.load_bytes`` unpickles with full pickle, so a planted object would run there.
        An object refused here is a ``CheckpointingException`` naming the key, file and byte range. A checksum
        mismatch of a tensor item may be raised after its bytes were copied into the destination: the load fails
        either way."""
        from .staged_read import read_staged

        stored = sum(int(self.storage_data[item.storage_index].length) for item in plan.items)
        self._progress = _Progress(f"loading {self.path}", stored)
        self.last_read_stats = read_staged(self, plan.items,
                                           _SafeBytesPlanner(planner, self) if self.safe_objects else planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_item_unstaged(self, stream, req, planner, loaded: Optional[torch.Tensor] = None):
        """One read item the way torch's reader does it: the item's bytes (``_slice_file``: progress, checksum),
        DCP's stream transforms, then ``load_bytes`` or ``torch.load`` (weights only), narrow, ``copy_``. Returns
        the stored item's whole loaded tensor (None for a bytes item); ``loaded``: that tensor as an earlier call
        for the same stored item returned (then nothing is read, verified or unpickled again)."""
        if loaded is None:
            sinfo = self.storage_data[req.storage_index]
            data = self.transforms.transform_load_stream(req, sinfo.transform_descriptors or (),
                                                         self._slice_file(stream, sinfo))
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(data.read(-1)))
                return None
            if not data.seekable():
                data = io.BytesIO(data.read(-1))
            loaded = torch.load(data, map_location="cpu", weights_only=True)
        whole, loaded = loaded, narrow_tensor_by_index(loaded, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != loaded.size():
            raise CheckpointingException(
                f"{self._where(req.storage_index)}: the destination of the read item has shape "
                f"{tuple(target.size())}, the stored region {tuple(loaded.size())}")
        target.copy_(loaded)
        planner.commit_tensor(req, target)
        return whole

    def _progress_add(self, nbytes: int) -> None:
        if getattr(self, "_progress", None) is not None:
            self._progress.add(nbytes)

    def _item_check(self, sinfo, path) -> Optional[Tuple[str, int, Callable[[Any, int], int]]]:
        """(algorithm, stored value, update) of an item's checksum; None when it has none or its algorithm is not
        available here (said once in the log), or when verification is off. With ``verify="require"`` an item
        without a checksum this installation can verify is a CheckpointingException."""
        if self.verify == "off":
            return None
        expected = getattr(sinfo, CHECKSUM_ATTR, None)
        if expected is None:
            if self.verify == "require":
                raise CheckpointingException(f"--ckpt-verify require: {self._where_info(sinfo)} has no checksum")
            return None
        algorithm, value = parse_checksum(expected)
        update = ALGORITHMS.get(algorithm)
        if update is None and self.verify == "require":
            raise CheckpointingException(
                f"--ckpt-verify require: {self._where_info(sinfo)} has a {algorithm!r} checksum, which this "
                f"installation cannot compute{' (install the crc32c or google-crc32c package)' if algorithm == 'crc32c' else ''}")
        if update is None:
            _log_once(
                ("algorithm", algorithm),
                logging.WARNING,
                f"{self.path}: item checksums use {algorithm!r}, which is not available here (install the crc32c or "
                f"google-crc32c package): the items are read unverified",
                rank0=True,
            )
            return None
        return algorithm, value, update

    def _where(self, storage_index) -> str:
        sinfo = self.storage_data[storage_index]
        path = self.fs.concat_path(self.path, sinfo.relative_path)
        start = int(sinfo.offset)
        return f"checkpoint item {describe_index(storage_index)} in {path}, bytes [{start}, {start + int(sinfo.length)})"

    def _where_info(self, sinfo) -> str:
        index = self._index_of.get(id(sinfo))
        if index is not None:
            return self._where(index)
        return f"checkpoint item in {self.fs.concat_path(self.path, sinfo.relative_path)}, offset {int(sinfo.offset)}"

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata_file(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._index_of = {id(info): index for index, info in self.storage_data.items()}
        if self.verify == "require":  # every rank: the whole checkpoint, before any item is read
            missing = [index for index, info in (metadata.storage_data or {}).items()
                       if getattr(info, CHECKSUM_ATTR, None) is None]
            if missing:
                raise CheckpointingException(
                    f"--ckpt-verify require: checkpoint {self.path}: {len(missing)} of {len(metadata.storage_data)} "
                    f"items have no checksum (written by an older or upstream writer), e.g. "
                    f"{describe_index(missing[0])}; --ckpt-verify auto loads them unverified")
        elif is_coordinator and self.verify == "auto":
            report_unverified(metadata, str(self.path))

    def _slice_file(self, file, sinfo):
        self._progress_add(int(sinfo.length))
        path = getattr(file, "name", None) or str(self.fs.concat_path(self.path, sinfo.relative_path))
        check = self._item_check(sinfo, path)
        if check is not None:
            self._verify(file, sinfo, path, *check)
        return super()._slice_file(file, sinfo)

    def _verify(self, file, sinfo, path, algorithm, value, update) -> None:
        start, end = int(sinfo.offset), int(sinfo.offset) + int(sinfo.length)
        actual = checksum_range(path, start, end, update, stream=file)
        if actual != value:
            key = describe_index(self._index_of.get(id(sinfo)))
            raise CheckpointingException(checksum_message(key, path, start, end, algorithm, value, actual))


class _SafeBytesPlanner:
    """The load planner as the reader sees it: ``load_bytes`` checks the object with ``safe_torch_load`` first."""

    def __init__(self, planner, reader: "ChecksummedFileSystemReader"):
        self._planner = planner
        self._reader = reader

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        safe_torch_load(value, what=self._reader._where(read_item.storage_index))
        value.seek(0)
        self._planner.load_bytes(read_item, value)

    def __getattr__(self, name):
        return getattr(self._planner, name)


def report_unverified(metadata: Metadata, where: str) -> Tuple[int, int]:
    """Log once (per checkpoint, per process) when items of ``metadata`` carry no checksum; returns (items without a
    checksum, items)."""
    storage = metadata.storage_data or {}
    missing = sum(1 for info in storage.values() if getattr(info, CHECKSUM_ATTR, None) is None)
    if missing == len(storage) and storage:
        _log_once(
            ("unverified", where), logging.WARNING,
            f"checkpoint {where} has no item checksums (written by an older or upstream writer): its data is loaded "
            f"unverified",
        )
    elif missing:
        _log_once(
            ("unverified", where), logging.WARNING,
            f"checkpoint {where}: {missing} of {len(storage)} items have no checksum and are loaded unverified",
        )
    return missing, len(storage)


# ---- data-file checks and DCP errors (torch_dist load/save, async writes) ------------------------------------------
def check_data_files(checkpoint_dir: Path, metadata: Metadata, keys=None) -> Optional[str]:
    """An error naming the first missing or truncated data file referenced by ``metadata`` (for ``keys``)."""
    needed: Dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        if keys is not None and index.fqn not in keys:
            continue
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for rel, end in sorted(needed.items()):
        path = Path(checkpoint_dir) / rel
        if not path.is_file():
            return f"checkpoint data file {path} is missing"
        size = path.stat().st_size
        if size < end:
            return f"checkpoint data file {path} is truncated: {size} bytes, the metadata needs at least {end}"
    return None


def wrap_dcp_error(e: BaseException, checkpoint_dir: Path, metadata: Optional[Metadata], action: str):
    """A DCP failure (``CheckpointException`` with per-rank ``failures``) as one CheckpointingException naming the
    action, the directory and, when ``metadata`` is given, the first missing or truncated data file."""
    failures = getattr(e, "failures", None) or {}
    inner = []
    for rank, failure in sorted(failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, CheckpointingException):
            return CheckpointingException(str(exc))
        inner.append(f"rank {rank}: {type(exc).__name__}: {exc}")
    file_error = check_data_files(checkpoint_dir, metadata) if metadata is not None else None
    detail = "; ".join(inner) if inner else f"{type(e).__name__}: {e}"
    if file_error:
        return CheckpointingException(f"{action} of {checkpoint_dir} failed: {file_error} ({detail})")
    return CheckpointingException(f"{action} of {checkpoint_dir} failed: {detail}")
