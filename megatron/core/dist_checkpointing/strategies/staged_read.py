"""The engine of ``ChecksummedFileSystemReader.read_data``: tensor items read at the storage's speed.

What a tensor item is on disk: DCP ``torch.save``s every stored chunk into its data file as one zip archive whose
records are *stored* (not compressed): ``<prefix>/data.pkl`` (a small pickle: ``torch._utils._rebuild_tensor_v2``
or ``_v3`` applied to one persistent storage id, the storage offset, size and stride), a few tiny records
(``byteorder``...), ``<prefix>/data/<key>`` (the storage's raw bytes, 64-byte aligned), the central directory.

``tensor_record`` finds the raw bytes without ``torch.load``: the zip directory (from the item's last bytes), each
record's local header (data offset = header offset + 30 + name length + extra length; a few KiB read; the zip's own
CRC-32s are not checked: our writer leaves them 0, torch never checks them, the item's checksum covers the bytes)
and ``data.pkl`` read with ``_RecordUnpickler`` (a ``SafeUnpickler``: the rebuild function, the storage id and the
storage type become a plain ``TensorRecord``; nothing from the pickle is called). Any other global (a parameter, a
tensor subclass, a planted payload) or anything unexpected (several storages, a compressed record, big-endian data,
an odd record) sends the item to the previous path, ``torch.load(weights_only=True)`` of the item (never wrong, only
slower; it refuses what is unsafe). Every read region is checked against the stored tensor's shape first: a
``.metadata`` that asks for more than the item holds is refused, naming the key.

How ``read_staged`` runs a load plan:

- Read items are handled on the calling thread strictly in plan order: ``resolve_tensor`` -> ``copy_`` ->
  ``commit_tensor``, one read item at a time (planners are not thread-safe; the streaming-dequant planner keeps one
  scratch per destination alive and relies on this order).
- ``IO_THREADS`` threads read ahead, in the same order, with ``os.preadv`` (the GIL is released): each stored item's
  header (an item of at most ``SMALL_ITEM_BYTES`` is read whole, in one read), then each read item's bytes into
  staging buffers of ``STAGING_BUFFER_BYTES`` (``STAGING_BUFFERS`` of them, allocated on first use; pinned when a
  destination is on CUDA, so its ``copy_`` is asynchronous; a buffer returns to the pool when its copy completed,
  a CUDA event per buffer). A read item whose region is one contiguous byte range of the stored tensor (the whole
  item, or a narrow on its leading non-singleton dim: resharding along dim 0, stacked layer axes) reads only its own
  bytes, in pieces of at most one buffer cut at rows of the target (``target[r0:r1].copy_(piece)``, deeper dims when
  one row is larger than a buffer); another region reads whole stored rows in blocks and narrows them.
- Targets that are not plain tensors (the chunked streaming planner's ``_CaptureTarget``, which keeps the source of
  its one ``copy_``; quantized tensors) get one whole tensor in a fresh host buffer (not pooled), read directly.
  Fresh buffers in flight are bounded by the pool's total (one at a time when bigger).
- Checksums (``mcore_checksum``): each stored item is verified once, over its whole byte range, from the bytes read:
  the header, the pieces, and the bytes no read item needs (read only for this) are checksummed in their threads,
  cut at common boundaries, and combined in byte order (``crc_combine``) when the item's last read item was
  handled. Each piece keeps the checksums of its own ranges: where read items overlap (the same bytes read twice,
  into two destinations), every read of a range must give the same checksum, so no read escapes verification,
  whatever order the threads finish in (no second pass over the bytes). A mismatch raises
  ``CheckpointingException`` naming key, file and byte range; it may come after the item's bytes were copied into
  the destination (the load fails either way).
- Object (bytes) items, items with DCP stream transforms and the fallback items take the previous per-item path
  (``ChecksummedFileSystemReader._read_item_unstaged``: checksum, ``torch.load``). A stored item split into several
  read items (the chunked streaming planner: one per chunk) is loaded once for its consecutive read items, which
  are served from it in plan order; it is dropped after its last read item or when the next fallback item is
  loaded (at most one loaded item is kept: read items of one stored item that are not consecutive in the plan load
  it again).

``last_read_stats`` on the reader (a ``ReadStats``) tells what a load did: bytes read, items staged and fallen back,
the staging pool's peak.
"""
import collections
import io
import logging
import math
import os
import pickle
import struct
import sys
import threading
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType

from ..safe_load import SafeUnpickler
from ..core import CheckpointingException
from .item_checks import checksum_message, checksum_range, describe_index, truncated_message

logger = logging.getLogger(__name__)

MiB = 1 << 20
STAGING_BUFFER_BYTES = 64 * MiB  # one staging buffer; pieces are at most this
STAGING_BUFFERS = 4  # the pool's fixed size: at most STAGING_BUFFERS x STAGING_BUFFER_BYTES staged at once
IO_THREADS = 4
SMALL_ITEM_BYTES = 1 * MiB  # items up to this size are read whole by their header read
HEAD_BYTES = 4096  # first read of a larger item: local headers + data.pkl
TAIL_BYTES = 4096  # and its last bytes: the zip central directory
MAX_HEAD_BYTES = 1 * MiB  # records this far from both ends of an item: fallback
HEADS_AHEAD = 16  # stored items whose header read may run ahead of the one being copied
GAP_CHUNK_BYTES = 8 * MiB  # bytes read only for the checksum are read in chunks of this (per thread)


# ---- CRC combine ---------------------------------------------------------------------------------------------------
# Reflected generator polynomials of the checksum algorithms of ``filesystem.ALGORITHMS`` (standard init/xorout 0xFFFFFFFF).
CRC_POLYNOMIALS = {"crc32": 0xEDB88320, "crc32c": 0x82F63B78}
_POWERS: Dict[int, List[int]] = {}


def _mulmod(a: int, b: int, poly: int) -> int:
    """a * b modulo the polynomial, both in reflected order (bit 31 is x^0)."""
    product = 0
    for i in range(32):
        if a & (0x80000000 >> i):
            product ^= b
        b = (b >> 1) ^ poly if b & 1 else b >> 1  # b *= x
    return product


def _powers(poly: int) -> List[int]:
    """x^(2^k) mod poly for k = 0..63."""
    table = _POWERS.get(poly)
    if table is None:
        table = [0x40000000]  # x^1
        for _ in range(63):
            table.append(_mulmod(table[-1], table[-1], poly))
        _POWERS[poly] = table
    return table


def crc_combine(algorithm: str, crc1: int, crc2: int, len2: int) -> int:
    """The checksum of A + B from crc(A), crc(B) and len(B), for ``algorithm`` in ``CRC_POLYNOMIALS``."""
    poly = CRC_POLYNOMIALS[algorithm]
    table = _powers(poly)
    shift, bits, k = 0x80000000, 8 * int(len2), 0  # x^0, then times x^(8 len2)
    while bits:
        if bits & 1:
            shift = _mulmod(table[k], shift, poly)
        bits >>= 1
        k += 1
    return _mulmod(shift, crc1, poly) ^ crc2


# ---- where a tensor's bytes are in its item ------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorRecord:
    """A ``torch.save``d tensor: dtype, size, stride, storage offset (elements), and where its storage's raw bytes
    are (``data_start``, ``data_nbytes``: bytes from the item's first byte)."""

    dtype: torch.dtype
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    storage_offset: int
    data_start: int
    data_nbytes: int

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def is_c_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.size), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


class _Unsupported(Exception):
    """This item is not read here: the previous path (torch.load of the item) reads it."""


class _StorageKind:
    __slots__ = ("name",)

    def __init__(self, name: Optional[str]):
        self.name = name  # None: torch.storage.UntypedStorage (bytes)


class _StorageRef:
    __slots__ = ("kind", "key", "numel")

    def __init__(self, kind, key, numel):
        self.kind, self.key, self.numel = kind, key, numel


class _Rebuilt:
    __slots__ = ("storage", "offset", "size", "stride", "dtype", "hooks", "metadata")

    def __init__(self, storage, offset, size, stride, dtype, hooks, metadata):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride
        self.dtype, self.hooks, self.metadata = dtype, hooks, metadata


def _rebuild_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    return _Rebuilt(storage, storage_offset, size, stride, None, backward_hooks, metadata)


def _rebuild_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    return _Rebuilt(storage, storage_offset, size, stride, dtype, backward_hooks, metadata)


class _RecordUnpickler(SafeUnpickler):
    """Reads a tensor item's ``data.pkl`` into a ``_Rebuilt`` descriptor; calls nothing of the pickle's choosing.
    Globals torch's weights-only loader admits but this one does not know raise ``_Unsupported`` (fallback);
    anything else is refused (``pickle.UnpicklingError``, before it is called)."""

    _KNOWN = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
        ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
        ("collections", "OrderedDict"): collections.OrderedDict,
    }

    def __init__(self, file, *, what: str = "data.pkl"):
        super().__init__(file, what=what)
        self.storages: List[_StorageRef] = []

    def find_class(self, module: str, name: str):
        known = self._KNOWN.get((module, name))
        if known is not None:
            return known
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return _StorageKind(None)
        if module == "torch" and name.endswith("Storage"):
            return _StorageKind(name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        # anything else: torch.load(weights_only=True), the per-item path, decides (it refuses what is unsafe)
        raise _Unsupported(f"{module}.{name}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageKind)
                and isinstance(pid[2], str) and isinstance(pid[4], int)):
            raise _Unsupported("persistent id")
        ref = _StorageRef(pid[1], pid[2], pid[4])
        self.storages.append(ref)
        return ref


_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header: 30 bytes, then name and extra field
_LOCAL_SIG = 0x04034B50


class ItemBytes:
    """The bytes of one stored item as far as they were read: a prefix (``head``) and a suffix (``tail``), each grown
    on demand by ``fetch(pos, n)`` up to ``max_part`` bytes; ``at(pos, n)`` serves a range from them, a range in
    between is ``_Unsupported``. Also a read-only file object over the item (what ``zipfile`` needs)."""

    def __init__(self, length: int, fetch: Callable[[int, int], bytearray], head: int, tail: int, max_part: int):
        self.length, self._fetch, self.max_part = length, fetch, max_part
        head = min(length, head)
        self.head = fetch(0, head)
        tail = min(length - head, tail)
        self.tail = fetch(length - tail, tail) if tail else bytearray()
        self._pos = 0

    def _grow(self, part: str, n: int) -> None:
        n = min(self.length - len(self.head) - len(self.tail), n + 512)  # a little more: the next record's header
        if part == "head":
            self.head += self._fetch(len(self.head), n)
        else:
            self.tail = self._fetch(self.length - len(self.tail) - n, n) + self.tail

    def at(self, pos: int, n: int) -> memoryview:
        if pos < 0 or n < 0 or pos + n > self.length:
            raise _Unsupported(f"a record at bytes [{pos}, {pos + n}) outside the item")
        while True:
            if pos + n <= len(self.head):
                return memoryview(self.head)[pos:pos + n]
            tail_start = self.length - len(self.tail)
            if pos >= tail_start:
                return memoryview(self.tail)[pos - tail_start:pos - tail_start + n]
            if len(self.head) + len(self.tail) >= self.length:  # everything read: the head is the whole item
                self.head, self.tail = self.head + self.tail, bytearray()
                continue
            after_head, before_tail = pos + n - len(self.head), tail_start - pos
            if after_head <= before_tail and pos + n <= self.max_part:
                self._grow("head", after_head)
            elif pos >= self.length - self.max_part:
                self._grow("tail", before_tail)
            else:
                raise _Unsupported(f"a record at bytes [{pos}, {pos + n}) far from both ends of the item")

    # file object
    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset + (0, self._pos, self.length)[whence]
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self._pos if n is None or n < 0 else min(n, self.length - self._pos)
        out = bytes(self.at(self._pos, n))
        self._pos += n
        return out


def tensor_record(item: ItemBytes, what: str) -> TensorRecord:
    """Where the tensor of the ``torch.save`` archive ``item`` has its bytes: the central directory (``zipfile``,
    from the item's last bytes), ``data.pkl`` through ``_RecordUnpickler``, the storage record's local header.

    Raises ``_Unsupported`` for anything this reader does not read (fallback), ``CheckpointingException`` for a
    refused pickle (naming ``what``)."""
    try:
        archive = zipfile.ZipFile(item)
        infos = {info.filename: info for info in archive.infolist()}
        pkl = [name for name in infos if name.endswith("data.pkl") and name.count("/") == 1]
        if len(pkl) != 1:
            raise _Unsupported("no single data.pkl")
        prefix = pkl[0][: -len("data.pkl")]
        # not archive.read: it checks the record's zip CRC-32, which our writer leaves 0 (torch.save without it; no
        # torch checks it); the item's own checksum covers these bytes
        pickled = bytes(item.at(*_record_span(item, infos[pkl[0]])))
        byteorder = (bytes(item.at(*_record_span(item, infos[prefix + "byteorder"])))
                     if prefix + "byteorder" in infos else b"little")
    except (zipfile.BadZipFile, KeyError, ValueError, EOFError, NotImplementedError) as e:
        raise _Unsupported(f"{type(e).__name__}: {e}") from None
    unpickler = _RecordUnpickler(io.BytesIO(pickled), what=what)
    try:
        rebuilt = unpickler.load()
    except pickle.UnpicklingError as e:
        msg = str(e)
        raise CheckpointingException(msg if msg.startswith(what) else f"{what}: {msg}") from None
    except _Unsupported:
        raise
    except Exception as e:  # a malformed or unusual pickle: torch's loader decides
        raise _Unsupported(f"{type(e).__name__}: {e}") from None
    if not isinstance(rebuilt, _Rebuilt) or len(unpickler.storages) != 1 or rebuilt.storage is not unpickler.storages[0]:
        raise _Unsupported("not one tensor on one storage")
    if rebuilt.hooks or rebuilt.metadata:
        raise _Unsupported("tensor with hooks or metadata")
    ref = rebuilt.storage
    try:
        kind_dtype = (torch.uint8 if ref.kind.name is None
                      else torch.storage._get_dtype_from_pickle_storage_type(ref.kind.name))
    except (KeyError, AttributeError):
        raise _Unsupported(f"storage type {ref.kind.name}") from None
    dtype = rebuilt.dtype if rebuilt.dtype is not None else kind_dtype
    if not isinstance(dtype, torch.dtype) or (rebuilt.dtype is not None and ref.kind.name is not None):
        raise _Unsupported("dtype")
    ints = lambda v: isinstance(v, tuple) and all(isinstance(x, int) and x >= 0 for x in v)  # noqa: E731
    if not (ints(rebuilt.size) and ints(rebuilt.stride) and len(rebuilt.size) == len(rebuilt.stride)
            and isinstance(rebuilt.offset, int) and rebuilt.offset >= 0):
        raise _Unsupported("size/stride/offset")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = ref.numel * torch.empty((), dtype=kind_dtype).element_size()
    if nbytes % itemsize:
        raise _Unsupported("storage bytes not a whole number of elements")
    if math.prod(rebuilt.size) and (
            rebuilt.offset + sum((s - 1) * st for s, st in zip(rebuilt.size, rebuilt.stride)) >= nbytes // itemsize):
        raise _Unsupported("tensor outside its storage")
    if bytes(byteorder) != b"little" or sys.byteorder != "little":
        raise _Unsupported("byte order")
    info = infos.get(f"{prefix}data/{ref.key}")
    if info is None or info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1:
        raise _Unsupported("storage record missing, compressed or encrypted")
    if info.file_size != nbytes or info.compress_size != nbytes:
        raise _Unsupported("storage record size")
    start, _ = _record_span(item, info)
    if start % itemsize:
        raise _Unsupported("storage record alignment")
    return TensorRecord(dtype, tuple(rebuilt.size), tuple(rebuilt.stride), rebuilt.offset, start, nbytes)


def _record_span(item: ItemBytes, info: zipfile.ZipInfo) -> Tuple[int, int]:
    """(start, length) of the bytes of the uncompressed zip record ``info`` within ``item``, from its local header."""
    if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1 or info.file_size != info.compress_size:
        raise _Unsupported(f"record {info.filename} compressed or encrypted")
    header = info.header_offset
    sig, *_rest, nlen, elen = _LOCAL_HEADER.unpack(item.at(header, _LOCAL_HEADER.size))
    name = bytes(item.at(header + _LOCAL_HEADER.size, nlen))
    start = header + _LOCAL_HEADER.size + nlen + elen
    if sig != _LOCAL_SIG or name != info.filename.encode() or start + info.file_size > item.length:
        raise _Unsupported(f"record {info.filename}: local header or bounds")
    return start, info.file_size


# ---- reading ------------------------------------------------------------------------------------------------------
def _pread_into(fd: int, mv: memoryview, offset: int, path: str, item: Tuple[int, int]) -> None:
    """Fill ``mv`` from file bytes at ``offset`` (GIL released); a short file is a CheckpointingException."""
    done = 0
    while done < len(mv):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [mv[done:]], offset + done)
        else:  # pragma: no cover - platforms without preadv
            data = os.pread(fd, len(mv) - done, offset + done)
            mv[done:done + len(data)] = data
            n = len(data)
        if not n:
            raise CheckpointingException(truncated_message(path, offset + done, *item))
        done += n


def _advise_sequential(fd: int, offset: int, length: int) -> None:
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            pass


def _boxes(shape: Tuple[int, ...], cap: int):
    """Sub-boxes (offsets, lengths) of ``shape`` that are contiguous in its row-major order, in order, each at most
    ``cap`` elements: whole rows of dim 0 where a row fits, else one index of dim 0 at a time, recursively."""
    if not shape:
        yield (), ()
        return
    inner = math.prod(shape[1:])
    if inner <= cap:
        rows = max(1, cap // max(inner, 1))
        for r0 in range(0, shape[0], rows):
            yield (r0,) + (0,) * (len(shape) - 1), (min(rows, shape[0] - r0),) + tuple(shape[1:])
        return
    for i in range(shape[0]):
        for off, lens in _boxes(shape[1:], cap):
            yield (i,) + off, (1,) + lens


@dataclass
class _Piece:
    """Bytes [start, start + nbytes) of a stored item (item-relative), and how they land in the read item's target:
    viewed as ``src_shape`` of the record's dtype, narrowed by ``src_box`` (or, with ``strided``, rebuilt with
    as_strided(size, stride, offset) first), into the target's ``tgt_box`` (None: the whole target)."""

    start: int
    nbytes: int
    src_shape: Tuple[int, ...]
    src_box: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]] = None
    tgt_box: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]] = None
    strided: Optional[Tuple[Tuple[int, ...], Tuple[int, ...], int]] = None
    fresh: bool = False  # a fresh (not pooled) buffer of its own
    future: Optional[Future] = None
    buf: Optional[torch.Tensor] = None
    cuts: Tuple[Tuple[int, int], ...] = ()  # checksum sub-ranges (item-relative) this piece computes
    crcs: Tuple[int, ...] = ()  # their checksums, set by the piece's read task

    def source(self, buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        t = buf[: self.nbytes].view(dtype)
        if self.strided is not None:
            size, stride, offset = self.strided
            t = t.as_strided(size, stride, t.storage_offset() + offset)
        else:
            t = t.view(self.src_shape)
        if self.src_box is not None:
            t = narrow_tensor_by_index(t, *self.src_box)
        return t


def plan_pieces(rec: TensorRecord, offsets, lengths, cap_bytes: int, whole: bool) -> List[_Piece]:
    """The pieces that read region (``offsets``, ``lengths``) of ``rec``'s tensor; ``whole``: one fresh piece."""
    offsets, lengths = tuple(int(o) for o in offsets), tuple(int(n) for n in lengths)
    size, es, nd = rec.size, rec.itemsize, len(rec.size)
    if math.prod(lengths) == 0:
        return []
    if nd == 0 or not rec.is_c_contiguous():  # the whole storage, as stored
        return [_Piece(rec.data_start, rec.data_nbytes, (), src_box=(offsets, lengths), fresh=True,
                       strided=(size, rec.stride, rec.storage_offset))]
    cstride = [math.prod(size[j + 1:]) for j in range(nd)]
    k = next((j for j in range(nd) if lengths[j] > 1), nd - 1)
    base = rec.storage_offset + sum(offsets[j] * cstride[j] for j in range(k))
    lead = (1,) * k
    if all(lengths[j] == size[j] for j in range(k + 1, nd)):  # one contiguous byte range
        first = base + offsets[k] * cstride[k]
        if whole:
            return [_Piece(rec.data_start + first * es, math.prod(lengths) * es, lengths, fresh=True)]
        sub_strides = [math.prod(lengths[j + 1:]) for j in range(k, nd)]
        pieces = []
        for off, lens in _boxes(lengths[k:], max(1, cap_bytes // es)):
            lin = sum(o * s for o, s in zip(off, sub_strides))
            box = ((0,) * k + off, lead + lens)
            pieces.append(_Piece(rec.data_start + (first + lin) * es, math.prod(lens) * es, box[1], tgt_box=box))
        return pieces
    row = cstride[k]  # whole stored rows of dim k, narrowed on the trailing dims
    trailing_off, trailing_len = offsets[k + 1:], lengths[k + 1:]
    if whole or row * es > cap_bytes:
        rows = lengths[k]
        return [_Piece(rec.data_start + (base + offsets[k] * row) * es, rows * row * es, lead + (rows,) + size[k + 1:],
                       src_box=((0,) * (k + 1) + trailing_off, lead + (rows,) + trailing_len), fresh=True)]
    block = max(1, cap_bytes // (row * es))
    pieces = []
    for r0 in range(0, lengths[k], block):
        n = min(block, lengths[k] - r0)
        pieces.append(_Piece(
            rec.data_start + (base + (offsets[k] + r0) * row) * es, n * row * es, lead + (n,) + size[k + 1:],
            src_box=((0,) * (k + 1) + trailing_off, lead + (n,) + trailing_len),
            tgt_box=((0,) * k + (r0,) + (0,) * (nd - k - 1), lead + (n,) + trailing_len),
        ))
    return pieces


@dataclass
class ReadStats:
    """What one ``read_data`` did (``ChecksummedFileSystemReader.last_read_stats``)."""

    bytes_read: int = 0
    items_staged: int = 0  # read items read by this module
    items_fallback: int = 0  # tensor read items read by the previous path (torch.load of the item)
    fallback_loads: int = 0  # stored items loaded (read, checksummed, torch.load) by that path
    pool_buffers: int = 0  # staging buffers allocated (at most STAGING_BUFFERS)
    pool_peak_in_use: int = 0
    pool_buffer_bytes: int = 0
    pinned: bool = False


class _Pool:
    """A fixed number of staging buffers of one size, allocated on first use."""

    def __init__(self, count: int, nbytes: int, pinned: bool, stats: ReadStats):
        self.count, self.nbytes, self.pinned, self.stats = count, nbytes, pinned, stats
        self.free: List[torch.Tensor] = []
        self.in_use = 0
        stats.pool_buffer_bytes, stats.pinned = nbytes, pinned

    def try_acquire(self) -> Optional[torch.Tensor]:
        if not self.free and self.stats.pool_buffers < self.count:
            self.free.append(torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.pinned))
            self.stats.pool_buffers += 1
        if not self.free:
            return None
        self.in_use += 1
        self.stats.pool_peak_in_use = max(self.stats.pool_peak_in_use, self.in_use)
        if self.in_use > self.count:  # never: the counter the tests assert on
            raise AssertionError("staging pool over its size")
        return self.free.pop()

    def release(self, buf: torch.Tensor) -> None:
        self.in_use -= 1
        self.free.append(buf)


class _Stored:
    """One stored item needed by the plan: its read items (plan positions), record, pieces and checksum parts."""

    def __init__(self, index, sinfo, path: str):
        self.index, self.sinfo, self.path = index, sinfo, path
        self.offset, self.length = int(sinfo.offset), int(sinfo.length)
        self.positions: List[int] = []
        self.order = -1  # first appearance among the staged stored items
        self.fd = -1
        self.check: Optional[Tuple[str, int, Callable]] = None  # (algorithm, stored value, update)
        self.head: Optional[Future] = None
        self.rec: Optional[TensorRecord] = None
        self.whole: Optional[bytearray] = None  # the whole item (small items)
        self.planned = False
        self.legacy = False
        self.pieces: Dict[int, List[_Piece]] = {}
        self.crcs: Dict[Tuple[int, int], int] = {}  # the header's and tail's checksums (set by the header read)
        self.intervals: List[Tuple[int, int]] = []
        self.tail_start = self.length  # the item's last bytes [tail_start, length) were read with its header
        self.gaps: List[Tuple[Tuple[int, int], Future]] = []  # (range, future of its checksum)

    @property
    def span(self) -> Tuple[int, int]:
        return self.offset, self.offset + self.length


def _is_plain(t) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


class _Run:
    def __init__(self, reader, items, planner):
        self.reader, self.items, self.planner = reader, list(items), planner
        self.stats = ReadStats()
        self.closing = False  # set by close(): running gap reads stop early
        self._lock = threading.Lock()
        self._local = threading.local()
        self.stored: Dict[Any, _Stored] = {}
        self.order: List[_Stored] = []
        self.plain_guess: Dict[int, bool] = {}
        cuda = False
        for pos, req in enumerate(self.items):
            if req.type == LoadItemType.BYTE_IO:
                continue
            st = self.stored.get(req.storage_index)
            if st is None:
                sinfo = reader.storage_data[req.storage_index]
                st = self.stored[req.storage_index] = _Stored(
                    req.storage_index, sinfo, str(reader.fs.concat_path(reader.path, sinfo.relative_path)))
                st.legacy = bool(getattr(sinfo, "transform_descriptors", None))
                if not st.legacy:
                    st.order = len(self.order)
                    self.order.append(st)
            st.positions.append(pos)
            dest = self._lookup(req)
            # what resolve_tensor will hand over: the planner says where it knows (the streaming planner's scratches
            # are plain tensors for quantized destinations); else the destination's own type
            plain = getattr(planner, "resolves_to_plain_tensor", None)
            self.plain_guess[pos] = plain(req) if plain is not None else (dest is None or _is_plain(dest))
            cuda = cuda or (dest is not None and getattr(dest, "is_cuda", False))
        if not cuda and torch.cuda.is_available() and not hasattr(planner, "lookup_tensor"):
            cuda = True
        self.pool = _Pool(STAGING_BUFFERS, STAGING_BUFFER_BYTES, cuda and torch.cuda.is_available(), self.stats)
        self.fresh_budget = STAGING_BUFFERS * STAGING_BUFFER_BYTES
        self.fresh_in_flight = 0
        self.copies: collections.deque = collections.deque()  # (event, buffer) of asynchronous copies
        self.fds: Dict[str, int] = {}
        self.heads_next = 0  # next stored item (in self.order) whose header read is submitted
        self.consumed_order = -1
        self.plan_pos = 0
        self.sub_next: Dict[int, int] = {}  # plan position -> next piece to submit
        self.executor = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="mcore-ckpt-read")
        self.loaded: Optional[Tuple[_Stored, Any]] = None  # the fallback item loaded last, while it has read items

    def _lookup(self, req):
        lookup = getattr(self.planner, "lookup_tensor", None)
        if lookup is None:
            return None
        try:
            return lookup(req.dest_index)
        except Exception:
            return None

    # ---- I/O tasks (threads) -----------------------------------------------------------------------------------
    def _count(self, n: int) -> None:
        with self._lock:
            self.stats.bytes_read += n

    def _read(self, st: _Stored, mv: memoryview, rel: int) -> None:
        _pread_into(st.fd, mv, st.offset + rel, st.path, st.span)
        self._count(len(mv))

    def _head_task(self, st: _Stored) -> Optional[TensorRecord]:
        _advise_sequential(st.fd, st.offset, st.length)

        def fetch(pos: int, n: int) -> bytearray:
            buf = bytearray(n)
            self._read(st, memoryview(buf), pos)
            return buf

        small = st.length <= SMALL_ITEM_BYTES
        item = ItemBytes(st.length, fetch, st.length if small else HEAD_BYTES, 0 if small else TAIL_BYTES,
                         MAX_HEAD_BYTES)
        what = self.reader._where(st.index)
        try:
            rec = tensor_record(item, what)
            if st.check is not None and not small:  # the bytes before the data and after it, as far as they were read
                end = rec.data_start + rec.data_nbytes
                update = st.check[2]
                head_crc = update(item.at(0, rec.data_start), 0)
                tail_start = max(end, st.length - len(item.tail))
                tail_crc = update(item.at(tail_start, st.length - tail_start), 0)
        except CheckpointingException:
            self._verify_whole(st)  # a damaged header is reported as what it is: a checksum mismatch
            raise
        except Exception as e:  # _Unsupported, or an odd record: torch.load decides (after verifying the checksum)
            logger.debug("%s: read by torch.load (%s: %s)", what, type(e).__name__, e)
            return None
        if st.check is not None:
            algorithm, value, update = st.check
            if small:
                actual = update(memoryview(item.head), 0)
                if actual != value:
                    raise CheckpointingException(
                        checksum_message(describe_index(st.index), st.path, *st.span, algorithm, value,
                                               actual))
            else:
                st.crcs[(0, rec.data_start)] = head_crc
                st.tail_start = tail_start
                st.crcs[(tail_start, st.length)] = tail_crc
        if small:
            st.whole = item.head
        return rec

    def _verify_whole(self, st: _Stored) -> None:
        """Raise the checksum error of ``st`` if its bytes fail their checksum (read once more, whole)."""
        if st.check is None:
            return
        algorithm, value, update = st.check
        actual = checksum_range(st.path, st.offset, st.offset + st.length, update)
        if actual != value:
            raise CheckpointingException(checksum_message(describe_index(st.index), st.path, *st.span,
                                                                algorithm, value, actual))

    def _piece_task(self, st: _Stored, p: _Piece, buf: Optional[torch.Tensor]) -> torch.Tensor:
        if buf is None:
            buf = torch.empty(p.nbytes, dtype=torch.uint8)
        mv = memoryview(buf.numpy()).cast("B")[: p.nbytes]
        self._read(st, mv, p.start)
        if st.check is not None:
            update = st.check[2]
            p.crcs = tuple(update(mv[a - p.start:b - p.start], 0) for a, b in p.cuts)
        return buf

    def _gap_task(self, st: _Stored, a: int, b: int) -> Optional[int]:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = memoryview(bytearray(GAP_CHUNK_BYTES))
        update, value, pos = st.check[2], 0, a
        while pos < b:
            if self.closing:  # the load failed: do not read on (a gap may be gigabytes)
                return None
            n = min(len(scratch), b - pos)
            self._read(st, scratch[:n], pos)
            value = update(scratch[:n], value)
            pos += n
        return value

    # ---- scheduling (calling thread) -------------------------------------------------------------------------
    def _fd(self, path: str) -> int:
        fd = self.fds.get(path)
        if fd is None:
            try:
                fd = self.fds[path] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointingException(f"cannot read checkpoint data file {path}: {e.strerror or e}") from e
        return fd

    def _submit_heads(self) -> None:
        while self.heads_next < len(self.order) and self.heads_next <= self.consumed_order + HEADS_AHEAD:
            st = self.order[self.heads_next]
            self.heads_next += 1
            st.fd = self._fd(st.path)
            st.check = self.reader._item_check(st.sinfo, st.path)
            st.head = self.executor.submit(self._head_task, st)

    def _plan_stored(self, st: _Stored) -> None:
        """Header read done: the pieces of all its read items, the checksum's intervals, the gap reads."""
        st.planned = True
        st.rec = st.head.result()
        if st.rec is None:
            st.legacy = True
            return
        for pos in st.positions:  # the metadata's regions must lie inside the stored tensor (never read past it)
            req = self.items[pos]
            offs, lens, size = tuple(req.storage_offsets), tuple(req.lengths), st.rec.size
            if len(offs) != len(size) or len(lens) != len(size) or any(
                    o < 0 or n < 0 or o + n > d for o, n, d in zip(offs, lens, size)):
                raise CheckpointingException(
                    f"{self.reader._where(st.index)}: the checkpoint metadata asks for offsets {list(offs)}, lengths "
                    f"{list(lens)} of a stored tensor of shape {list(size)}: metadata and data file disagree")
        if st.whole is not None:
            return
        if st.check is not None and st.check[0] not in CRC_POLYNOMIALS:
            st.legacy = True  # cannot combine partial checksums of this algorithm
            return
        for pos in st.positions:
            req = self.items[pos]
            st.pieces[pos] = plan_pieces(st.rec, req.storage_offsets, req.lengths, STAGING_BUFFER_BYTES,
                                         whole=not self.plain_guess[pos])
        if st.check is None:
            return
        cuts = {0, st.rec.data_start, st.rec.data_start + st.rec.data_nbytes, st.tail_start, st.length}
        for pieces in st.pieces.values():
            for p in pieces:
                cuts.update((p.start, p.start + p.nbytes))
        bounds = sorted(cuts)
        st.intervals = list(zip(bounds[:-1], bounds[1:]))
        covered = {(0, st.rec.data_start), (st.tail_start, st.length)}
        for pieces in st.pieces.values():
            for p in pieces:
                p.cuts = tuple(iv for iv in st.intervals if p.start <= iv[0] and iv[1] <= p.start + p.nbytes)
                covered.update(p.cuts)
        st.gaps = [((a, b), self.executor.submit(self._gap_task, st, a, b)) for a, b in st.intervals
                   if (a, b) not in covered]

    def _release_done_copies(self, wait_one: bool = False) -> bool:
        released = False
        while self.copies and (wait_one or self.copies[0][0].query()):
            event, buf = self.copies.popleft()
            event.synchronize()
            self.pool.release(buf)
            released, wait_one = True, False
        return released

    def _try_submit(self, st: _Stored, p: _Piece) -> bool:
        if p.fresh:
            if self.fresh_in_flight and self.fresh_in_flight + p.nbytes > self.fresh_budget:
                return False
            self.fresh_in_flight += p.nbytes
            buf = None
        else:
            self._release_done_copies()
            buf = self.pool.try_acquire()
            if buf is None:
                return False
        p.future = self.executor.submit(self._piece_task, st, p, buf)
        return True

    def _advance(self, consume_pos: int) -> None:
        """Submit header reads and pieces ahead, in plan order, as far as the buffers allow."""
        self._submit_heads()
        while self.plan_pos < len(self.items):
            pos = self.plan_pos
            req = self.items[pos]
            st = None if req.type == LoadItemType.BYTE_IO else self.stored[req.storage_index]
            if st is not None and not st.legacy and not st.planned:
                if st.head is None or (pos != consume_pos and not st.head.done()):
                    return
                self._plan_stored(st)
            if st is not None and not st.legacy and st.whole is None:
                pieces = st.pieces[pos]
                i = self.sub_next.get(pos, 0)
                while i < len(pieces):
                    if not self._try_submit(st, pieces[i]):
                        self.sub_next[pos] = i
                        return
                    i += 1
                self.sub_next[pos] = i
            self.plan_pos += 1

    def _wait_piece(self, st: _Stored, p: _Piece, pos: int) -> torch.Tensor:
        while p.future is None:
            self._advance(pos)
            if p.future is None and not self._release_done_copies(wait_one=True):
                raise AssertionError("staged read: a piece cannot be scheduled")  # never: all buffers are free
        return p.future.result()

    # ---- consuming (calling thread, plan order) -------------------------------------------------------------
    def _copy_piece(self, st, p: _Piece, target: torch.Tensor) -> None:
        buf = self._wait_piece(st, p, self._pos)
        src = p.source(buf, st.rec.dtype)
        dst = target if p.tgt_box is None else narrow_tensor_by_index(target, *p.tgt_box)
        asynchronous = (not p.fresh) and self.pool.pinned and dst.is_cuda
        dst.copy_(src, non_blocking=asynchronous)
        p.buf = p.future = None
        if p.fresh:
            self.fresh_in_flight -= p.nbytes
        elif asynchronous:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dst.device))
            self.copies.append((event, buf))
        else:
            self.pool.release(buf)

    def _consume_staged(self, pos: int, req, st: _Stored) -> None:
        target = self.planner.resolve_tensor(req).detach()
        lengths = tuple(int(n) for n in req.lengths)
        if tuple(target.size()) != lengths:
            raise CheckpointingException(
                f"{self.reader._where(st.index)}: the destination of the read item has shape {tuple(target.size())}, "
                f"the read item {lengths}")
        rec = st.rec
        if st.whole is not None:
            src = torch.frombuffer(st.whole, dtype=torch.uint8)[rec.data_start:rec.data_start + rec.data_nbytes]
            src = src.view(rec.dtype)
            src = src.as_strided(rec.size, rec.stride, src.storage_offset() + rec.storage_offset)
            target.copy_(narrow_tensor_by_index(src, req.storage_offsets, lengths))
        else:
            pieces = st.pieces[pos]
            if not pieces:
                target.copy_(torch.empty(lengths, dtype=rec.dtype))
            elif _is_plain(target) or (len(pieces) == 1 and pieces[0].tgt_box is None):
                for p in pieces:
                    self._copy_piece(st, p, target)
            else:  # a target that takes one whole copy_: assemble the staged pieces on the host first
                assembled = torch.empty(lengths, dtype=rec.dtype)
                for p in pieces:
                    self._copy_piece(st, p, assembled)
                target.copy_(assembled)
        self.planner.commit_tensor(req, target)
        self.stats.items_staged += 1
        if pos == st.positions[-1]:
            self._finish_stored(st)

    def _finish_stored(self, st: _Stored) -> None:
        readings = {iv: [crc] for iv, crc in st.crcs.items()}  # every checksum of each range, as read
        for iv, fut in st.gaps:
            readings[iv] = [fut.result()]
        if st.check is not None and st.whole is None:
            for pos in st.positions:  # plan order (not the order the threads finished in)
                for p in st.pieces.get(pos, ()):
                    for iv, crc in zip(p.cuts, p.crcs):
                        readings.setdefault(iv, []).append(crc)
            self._verify_readings(st, readings)
        st.whole, st.crcs, st.pieces, st.gaps = None, {}, {}, []

    def _verify_readings(self, st: _Stored, readings: Dict[Tuple[int, int], List[int]]) -> None:
        """Raise the checksum error of ``st`` unless every read of each of its ranges gave the same checksum and
        their combination is the stored one."""
        algorithm, value, _ = st.check
        missing = [iv for iv in st.intervals if not readings.get(iv)]
        if missing:  # never: every range is read by the header, a piece or a gap read
            raise AssertionError(f"staged read: bytes {missing[0]} of {self.reader._where(st.index)} not checksummed")

        def combined(pick) -> int:
            actual = None
            for a, b in st.intervals:
                crc = pick(readings[(a, b)])
                actual = crc if actual is None else crc_combine(algorithm, actual, crc, b - a)
            return actual

        actual = combined(lambda crcs: crcs[0])
        differ = [iv for iv in st.intervals if len(set(readings[iv])) > 1]
        if differ and actual == value:  # report the checksum with the other reading(s)
            actual = combined(lambda crcs: next((c for c in crcs if c != crcs[0]), crcs[0]))
        if actual == value and not differ:
            return
        msg = checksum_message(describe_index(st.index), st.path, *st.span, algorithm, value, actual)
        if differ:
            a, b = differ[0]
            msg += (f" (read items overlapping at bytes [{st.offset + a}, {st.offset + b}) of the file read them "
                    f"differently)")
        raise CheckpointingException(msg)

    def run(self, stack: ExitStack) -> None:
        streams: Dict[str, Any] = {}
        for pos, req in enumerate(self.items):
            self._pos = pos
            st = None if req.type == LoadItemType.BYTE_IO else self.stored[req.storage_index]
            if st is not None and not st.legacy:
                self.consumed_order = max(self.consumed_order, st.order)
            self._advance(pos)
            if st is not None and not st.legacy:
                if not st.planned:
                    raise AssertionError("staged read: item not planned in order")  # never
                if not st.legacy:
                    self.reader._progress_add(st.length)
                    self._consume_staged(pos, req, st)
                    continue
            sinfo = self.reader.storage_data[req.storage_index]
            path = str(self.reader.fs.concat_path(self.reader.path, sinfo.relative_path))
            if path not in streams:
                streams[path] = stack.enter_context(self.reader.fs.create_stream(path, "rb"))
            self._read_fallback(pos, req, st, streams[path])
        self._release_all()

    def _read_fallback(self, pos: int, req, st: Optional[_Stored], stream) -> None:
        """One read item by the per-item path; a tensor item is loaded once for its consecutive read items."""
        loaded = self.loaded[1] if st is not None and self.loaded is not None and self.loaded[0] is st else None
        if loaded is None and st is not None:
            self.loaded = None  # at most one loaded item: the previous one goes before the next is loaded
        elif loaded is not None:
            self.reader._progress_add(st.length)  # as a load of it would
        whole = self.reader._read_item_unstaged(stream, req, self.planner, loaded)
        if st is not None:
            self.stats.items_fallback += 1
            self.stats.fallback_loads += loaded is None
            self.loaded = None if pos == st.positions[-1] else (st, whole)

    def _release_all(self) -> None:
        while self.copies:
            self._release_done_copies(wait_one=True)

    def close(self) -> None:
        self.closing = True
        self.executor.shutdown(wait=True, cancel_futures=True)
        try:
            self._release_all()
        finally:
            for fd in self.fds.values():
                os.close(fd)
            self.fds = {}


def read_staged(reader, items, planner) -> ReadStats:
    """Read the load plan's ``items`` for ``reader`` (a ``ChecksummedFileSystemReader``) into ``planner``'s
    destinations (see the module docstring); returns what it did."""
    run = _Run(reader, items, planner)
    with ExitStack() as stack:
        try:
            run.run(stack)
        finally:
            run.close()
    return run.stats
