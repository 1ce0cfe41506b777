"""``--stream-ckpt-dequant``: loading a checkpoint into quantized destinations (Transformer Engine QuantizedTensor).

Two paths; ``TorchDistLoadShardedStrategy`` picks one per load, from its ``stream_ckpt_dequant``, where it builds its
planner:

- legacy upfront (default): ``dequantize_upfront`` swaps every quantized destination for a high-precision tensor
  before the read; the callable it returns quantizes the values back after the read. Transient memory: one
  high-precision copy of *every* quantized destination at once (2 bytes x sum(numel) for bf16).
- streaming: the strategy loads with ``StreamingDequantLoadPlanner`` (an ``MCoreLoadPlanner``), which hands DCP, in
  ``resolve_tensor``, a narrowed view of a high-precision scratch of the whole quantized destination (allocated at
  that destination's first read item) and counts, in ``commit_tensor``, the read items that landed. When the last
  read item of a destination landed, the scratch is quantized into the original tensor once (so per-tensor
  current/tensorwise scaling computes its scale over the whole destination, exactly as a plain ``copy_`` of the full
  tensor would), the delayed-scaling amax state is restored around that copy, and the scratch's memory is released at
  once (``untyped_storage().resize_(0)``, so a view the reader still holds does not keep it alive). DCP reads the
  items of one file destination by destination, so about one scratch is alive: peak about 2 bytes x max(numel).

Chunked streaming (``stream_chunk_bytes``, ``--stream-ckpt-dequant-chunk-mb``, default 64 MiB): a quantized destination
whose high-precision bytes exceed the chunk, and whose kind has a row-range quantize (``fp8_utils.chunk_row_multiple``:
delayed, tensorwise, MXFP8, blockwise), never gets a whole scratch. Its leading axis (of the original tensor, after
any prepended axes) is cut into chunks of ``chunk_len`` indices, aligned to the kind's scaling blocks, each at most
``stream_chunk_bytes`` of high-precision scratch plus the adapter's temporaries (tensorwise: plus the scratch's one
extra row, see below). Direct chunks (the usual case: one saved item per destination, or resharding along rows at
chunk-aligned offsets): when every read item of the destination covers whole rows from one chunk boundary to
another, ``finish_plan`` splits the read items at the chunk boundaries; each resolves to its own chunk's scratch, a
plain tensor the reader copies into (from its pinned staging buffers), and its commit quantizes those rows and frees
the scratch. Otherwise (captured chunks) ``resolve_tensor`` hands DCP a ``_CaptureTarget`` (a storage-free tensor
whose ``copy_`` records the source the reader loaded, zero copy); ``commit_tensor`` cuts that source along the
leading axis into the chunks it covers (a read item may cover several chunks or part of one: resharding) and keeps
the pieces (host memory the reader already allocated; a piece of a much larger saved item is cloned so the item is
not kept alive). When all bytes of a chunk landed, the chunk's scratch is filled from its pieces, quantized into the
destination's rows (``fp8_utils.quantize_rows_into``) and freed.

Tensorwise (current) scaling needs the whole tensor's amax before any chunk is quantized. Its chunk scratches have one
extra row (n + 1 rows of the 2-D view; the reader gets a view of the first n): the adapter writes the whole amax
there and the quantizer, computing its scale from what it is given, computes the whole tensor's scale with no (n +
1)-row copy. Direct chunks: each chunk's commit takes its amax into a running maximum on the device (no host sync);
a chunk that is not the destination's last to land is kept until the whole amax is known and its scratch freed:
where the destination has an FP8 transpose cache, in the destination's own bytes (its FP8 data rows of that chunk
and the same range of the transpose buffer: 2 bytes per element, a device copy; only that chunk's own quantize writes
those data rows, after taking the chunk back, and the transpose is rebuilt at the end; ``parked_bytes``), else by an
asynchronous copy (current stream) into host memory (pinned for a CUDA destination; stream-ordered reuse keeps
freeing the scratch safe; ``host_roundtrip_bytes``). The chunk that lands last is quantized straight from its
scratch, then every other chunk is taken back into a fresh scratch and quantized. Captured chunks: a completed chunk
only contributes its amax (scratch filled, amax taken, freed) and keeps its host pieces; once every chunk landed,
each is filled again and quantized. Both give bit for bit one whole-tensor quantize. Peak scratch: one chunk.
Destinations up to one chunk, kinds without a chunked path (NVFP4) and ``stream_chunk_bytes=0`` keep the
whole-destination scratch.

Prepended singleton axes (``prepend_axis_num``): the strategy gives DCP ``view_keeping_base(data, shape)``; the
planner quantizes into that base (a TE Float8Tensor view that adds axes drops the cached transpose, so quantizing into
the view would leave the original's transpose stale), and ``strip_prepended_axes`` / the strategy's unwrap hand the
base back. Where a quantized tensor cannot add axes by view at all (TE blockwise), DCP gets a storage-free stand-in.

All knowledge of quantized tensors is in ``megatron.core.fp8_utils``; plain destinations get DCP's default behaviour.
"""
import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.planner import LoadItemType

from ... import fp8_utils

from ..core import CheckpointingException
from ..dict_utils import nested_values
from ..mapping import ShardedTensor
from .planners import MCoreLoadPlanner


logger = logging.getLogger(__name__)

DestKey = Tuple[str, Optional[Tuple[int, ...]]]

DEFAULT_STREAM_CHUNK_MB = 64
MiB = 2**20
aten = torch.ops.aten


# ---- helpers -------------------------------------------------------------------------------------------------
def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The sub-box of ``t`` at ``offsets`` of size ``lengths`` (a view)."""
    for dim, (off, length) in enumerate(zip(offsets, lengths)):
        if off != 0 or length != t.shape[dim]:
            t = t.narrow(dim, int(off), int(length))
    return t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def strip_prepended_axes(ten: torch.Tensor, prepend_axis_num: int, key: str = "?") -> torch.Tensor:
    """``ten`` without its ``prepend_axis_num`` leading axes, each of which must have size 1.

    Uses ``view`` (never indexing or ``squeeze``), which TE's quantized tensors implement without dequantizing.
    Raises CheckpointingException naming ``key`` when a prepended axis has a size other than 1."""
    if prepend_axis_num <= 0:
        return ten
    if ten.dim() < prepend_axis_num:
        raise CheckpointingException(
            f"{key}: tensor of shape {tuple(ten.shape)} has fewer than prepend_axis_num={prepend_axis_num} axes"
        )
    for i in range(prepend_axis_num):
        if ten.shape[i] != 1:
            raise CheckpointingException(
                f"{key}: prepended axis {i} of the loaded tensor has size {ten.shape[i]}, expected 1 "
                f"(shape {tuple(ten.shape)}, prepend_axis_num={prepend_axis_num})"
            )
    base = quantized_base(ten)
    if base is not None and tuple(base.shape) == tuple(ten.shape[prepend_axis_num:]):
        return base
    return ten.view(tuple(ten.shape[prepend_axis_num:]))


_BASE_ATTR = "_mcore_quantized_base"


def view_keeping_base(ten: torch.Tensor, shape) -> torch.Tensor:
    """``ten.view(shape)``; for a quantized ``ten`` the view also remembers ``ten`` as its base.

    A view of a TE quantized tensor is a new tensor object sharing the data but not everything (a Float8Tensor view
    that changes the number of axes drops the cached transpose). The streaming planner therefore quantizes into the
    base, and ``quantized_base`` lets the strategy hand back the original tensor after the load."""
    shape = tuple(shape)
    if not fp8_utils.is_quantized_tensor(ten):
        return ten.view(shape)
    try:
        v = ten.view(shape)
    except (NotImplementedError, RuntimeError):
        # Some quantized tensors cannot change their number of axes by view (TE's Float8BlockwiseQTensor). Then
        # DCP gets a storage-free stand-in of the right shape (one element, expanded): only the streaming planner
        # touches it (reads go into a scratch, which is quantized into the base).
        v = torch.empty(1, dtype=fp8_utils.high_precision_dtype(ten), device=ten.device).expand(shape)
    if v is not ten:
        setattr(v, _BASE_ATTR, getattr(ten, _BASE_ATTR, ten))
    return v


def quantized_base(ten):
    """The quantized tensor ``ten`` was made from by :func:`view_keeping_base`, or None."""
    return getattr(ten, _BASE_ATTR, None) if isinstance(ten, torch.Tensor) else None


@dataclass
class LoadStats:
    """What one ``TorchDistLoadShardedStrategy.load`` did with quantized destinations (``strategy.last_load_stats``).

    ``streamed``: the streaming path was used. ``scratch_bytes_peak``: most high-precision scratch bytes alive at
    once on the streaming path (0 on the upfront path, whose transient is ``dequantized_upfront_bytes``: every
    quantized destination at once). ``quantized_destinations``: destinations quantized back (streaming) or
    dequantized upfront. ``chunked_destinations``: of those, streamed chunk by chunk; ``direct_chunked_destinations``:
    of those, read straight into each chunk's scratch (read items split at chunk boundaries). ``host_roundtrip_bytes``:
    high-precision bytes of direct tensorwise chunks kept in host memory until the whole amax was known (every chunk
    of such a destination but the one that landed last), ``parked_bytes``: those kept in the destination's own FP8
    data and transpose bytes instead (no host memory; destinations with a transpose cache).
    ``streaming_state_empty``: the
    streaming planner's bookkeeping (pending read items, scratches, chunk pieces, live scratch bytes) was empty after
    the load (always True on the upfront path). ``seconds``: wall time of the read (the DCP load and the copies after
    it) on this rank."""

    streamed: bool = False
    scratch_bytes_peak: int = 0
    quantized_destinations: int = 0
    chunked_destinations: int = 0
    direct_chunked_destinations: int = 0
    host_roundtrip_bytes: int = 0
    parked_bytes: int = 0
    dequantized_upfront_bytes: int = 0
    streaming_state_empty: bool = True
    seconds: float = 0.0


# ---- legacy upfront path ---------------------------------------------------------------------------------------
def dequantize_upfront(sharded_state_dict) -> Callable[[], None]:
    """Legacy path hook, called by TorchDistLoadShardedStrategy.load before the read when not streaming.

    Every ShardedTensor whose ``data`` is quantized gets a dequantized high-precision copy as its ``data`` (all of
    them at once). The returned callable, called after the read, quantizes each loaded value back into its original
    quantized tensor (delayed-scaling amax state snapshotted and restored around that copy) and puts the original
    back as the ShardedTensor's ``data``. Without quantized destinations it changes nothing.
    """
    swapped = []
    upfront_bytes = 0
    for sh_ten in nested_values(sharded_state_dict):
        if isinstance(sh_ten, ShardedTensor) and fp8_utils.is_quantized_tensor(sh_ten.data):
            original = sh_ten.data
            sh_ten.data = fp8_utils.dequantize(original)
            swapped.append((sh_ten, original))
            upfront_bytes += _nbytes(sh_ten.data)

    def requantize() -> None:
        for sh_ten, original in swapped:
            loaded = sh_ten.data
            snap = fp8_utils.snapshot_amax(original)
            fp8_utils.quantize_into(original, loaded)
            fp8_utils.restore_amax(original, snap)
            sh_ten.data = original
        swapped.clear()

    requantize.num_dequantized = len(swapped)
    requantize.dequantized_bytes = upfront_bytes
    return requantize


# ---- streaming path --------------------------------------------------------------------------------------------
class _Scratch:
    __slots__ = ("dest", "buf", "nbytes")

    def __init__(self, dest: torch.Tensor, buf: torch.Tensor):
        self.dest, self.buf, self.nbytes = dest, buf, _nbytes(buf)


class _CaptureTarget(torch.Tensor):
    """What ``resolve_tensor`` gives DCP for a chunked destination: a storage-free tensor of the read item's shape
    whose ``copy_(src)`` records ``src`` (the reader's loaded tensor) in ``capture`` instead of copying it; its
    ``detach`` shares the record. Anything else is refused with a clear error (a reader that writes into the
    target some other way cannot use the chunked path: set the chunk size to 0)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, shape, dtype, capture: list, what: str):
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device="cpu", requires_grad=False)
        t.capture, t.what = capture, what
        return t

    def __init__(self, shape, dtype, capture: list, what: str):
        pass

    def __repr__(self):
        return f"_CaptureTarget({self.what}, shape={tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        t = args[0] if args else None
        if func is aten.detach.default:
            return cls(t.shape, t.dtype, t.capture, t.what)
        if func is aten.copy_.default and isinstance(t, cls) and not isinstance(args[1], cls):
            src = args[1]
            if tuple(src.shape) != tuple(t.shape):
                raise CheckpointingException(f"{t.what}: read a tensor of shape {tuple(src.shape)} into a read item "
                                             f"of shape {tuple(t.shape)}")
            t.capture.append(src)
            return t
        what = t.what if isinstance(t, cls) else "?"
        raise CheckpointingException(
            f"{what}: the chunked streaming load only accepts copy_ into its read target, got {func}; this storage "
            "reader writes read items another way (use --stream-ckpt-dequant-chunk-mb 0 for whole-tensor scratches)"
        )


class _ChunkedDest:
    """Bookkeeping of one chunked quantized destination (see the module docstring)."""

    def __init__(self, key: DestKey, dest: torch.Tensor, lead: int, chunk_len: int):
        self.key, self.dest, self.lead, self.chunk_len = key, dest, lead, chunk_len
        self.dim0 = int(dest.shape[0])
        self.inner = math.prod(int(d) for d in dest.shape[1:])  # elements per leading index
        self.cols = int(dest.shape[-1])
        self.rows_per_index = self.inner // self.cols
        self.n_chunks = -(-self.dim0 // chunk_len)
        self.pieces: Dict[int, List[Tuple[Tuple[int, ...], torch.Tensor]]] = {}
        self.landed: Dict[int, int] = {}
        self.done = 0  # chunks quantized (or, tensorwise, whose amax is in)
        # tensorwise: the whole tensor's amax comes first; each chunk's scratch has one extra row, where the adapter
        # puts that amax (fp8_utils.quantize_rows_into(padded=True))
        self.whole_amax = fp8_utils.needs_whole_tensor_amax(dest)
        self.direct = False  # read items split at chunk boundaries: the reader fills each chunk's scratch itself
        self.bufs: Dict[int, torch.Tensor] = {}  # direct: the live scratch of chunk i
        self.host: Dict[int, torch.Tensor] = {}  # direct tensorwise: chunks landed before the last, in host memory
        self.parked: set = set()  # direct tensorwise: chunks landed before the last, in the destination's own bytes
        self.transpose_valid = fp8_utils.transpose_is_valid(dest)  # before any parking (which marks it invalid)
        self.amax: Optional[torch.Tensor] = None
        self.snap = fp8_utils.snapshot_amax(dest)
        self.hp = fp8_utils.high_precision_dtype(dest)

    def chunk_bounds(self, i: int) -> Tuple[int, int]:
        return i * self.chunk_len, min((i + 1) * self.chunk_len, self.dim0)

    def chunk_numel(self, i: int) -> int:
        a, b = self.chunk_bounds(i)
        return (b - a) * self.inner

    def scratch_numel(self, i: int) -> int:
        """Elements of chunk ``i``'s scratch: its rows, plus one row (tensorwise) for the amax."""
        return self.chunk_numel(i) + (self.cols if self.whole_amax else 0)

    def rows(self, i: int, buf: torch.Tensor) -> torch.Tensor:
        """The rows of chunk ``i`` in its scratch ``buf`` (without the amax row), shaped like the destination's."""
        a, b = self.chunk_bounds(i)
        return buf[:self.chunk_numel(i)].view((b - a,) + tuple(self.dest.shape[1:]))


class StreamingDequantLoadPlanner(MCoreLoadPlanner):
    """The streaming load planner: quantized destinations are read into high-precision scratches (whole destination
    or chunks of ``stream_chunk_bytes``) and quantized into place as their read items land; plain destinations get
    DCP's default behaviour. After the read, call :meth:`finish_quantized_load`.

    Bookkeeping (all keyed by the destination's ``(fqn, offset)`` from the read items' ``dest_index``):
    ``_quantized_pending`` counts the read items still to land per quantized destination (from the final local plan,
    in ``finish_plan``), ``_quantized_scratch`` holds the live scratches. Both are empty after a complete load;
    :meth:`finish_quantized_load` checks that. ``scratch_bytes_peak`` is the most scratch bytes alive at once;
    ``quantized_destinations_committed`` counts destinations quantized (once each); ``host_roundtrip_bytes`` /
    ``parked_bytes``
    the bytes of direct tensorwise chunks kept in host memory / in the destination's own bytes until their
    destination's whole amax was known.
    """

    def __init__(self, *args, stream_chunk_bytes: Optional[int] = DEFAULT_STREAM_CHUNK_MB * MiB, **kwargs):
        super().__init__(*args, **kwargs)
        if stream_chunk_bytes is not None and stream_chunk_bytes < 0:
            raise CheckpointingException(f"stream_chunk_bytes must be >= 0 (0: no chunking), got {stream_chunk_bytes}")
        self.stream_chunk_bytes = int(stream_chunk_bytes or 0)
        self._reset_quantized_state()

    def _reset_quantized_state(self) -> None:
        self._quantized_pending: Dict[DestKey, int] = {}
        self._quantized_scratch: Dict[DestKey, _Scratch] = {}
        self._chunked: Dict[DestKey, _ChunkedDest] = {}
        self.chunked_destinations_committed = 0
        self.direct_chunked_destinations_committed = 0
        self.scratch_bytes_live = 0
        self.scratch_bytes_peak = 0
        self.quantized_destinations_committed = 0
        self.host_roundtrip_bytes = 0
        self.parked_bytes = 0

    @staticmethod
    def _dest_key(index) -> DestKey:
        off = getattr(index, "offset", None)
        return (index.fqn, None if off is None else tuple(int(o) for o in off))

    # ---- planner hooks -------------------------------------------------------------------------------------
    def set_up_planner(self, *args, **kwargs):
        self._reset_quantized_state()
        return super().set_up_planner(*args, **kwargs)

    def finish_plan(self, new_plan):
        plan = super().finish_plan(new_plan)
        quantized: Dict[DestKey, List] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                continue
            key = self._dest_key(item.dest_index)
            if key in quantized:
                quantized[key].append(item)
                continue
            dest = self.lookup_tensor(item.dest_index)
            if self._is_quantized_destination(dest):
                quantized[key] = [item]
                chunked = self._chunked_destination(key, dest)
                if chunked is not None:
                    self._chunked[key] = chunked
        for key, c in self._chunked.items():
            c.direct = all(self._splits_at_chunks(c, item) for item in quantized[key])
        if any(c.direct for c in self._chunked.values()):
            items = []
            for item in plan.items:
                c = None if item.type == LoadItemType.BYTE_IO else self._chunked.get(self._dest_key(item.dest_index))
                items.extend(self._split_at_chunks(c, item) if c is not None and c.direct else [item])
            plan = dataclasses.replace(plan, items=items)
        pending: Dict[DestKey, int] = {}
        for item in plan.items:
            key = None if item.type == LoadItemType.BYTE_IO else self._dest_key(item.dest_index)
            if key in quantized:
                pending[key] = pending.get(key, 0) + 1
        self._quantized_pending = pending
        return plan

    @staticmethod
    def _splits_at_chunks(c: "_ChunkedDest", item) -> bool:
        """True when ``item`` covers whole rows of the destination (every trailing axis in full) from one chunk
        boundary to another (or to the end): cut at the chunk boundaries, each piece is exactly one chunk."""
        lens = [int(n) for n in item.lengths][c.lead:]
        o = int(item.dest_offsets[c.lead])
        e = o + lens[0]
        full_rows = lens[1:] == [int(d) for d in c.dest.shape[1:]]
        return full_rows and o % c.chunk_len == 0 and (e % c.chunk_len == 0 or e == c.dim0)

    @staticmethod
    def _split_at_chunks(c: "_ChunkedDest", item) -> List:
        """``item`` as one read item per chunk it covers (same storage item, offsets shifted along the row axis)."""
        ax = c.lead
        o = int(item.dest_offsets[ax])
        e = o + int(item.lengths[ax])
        out = []
        for i in range(o // c.chunk_len, -(-e // c.chunk_len)):
            a, b = c.chunk_bounds(i)

            def at(v, x, ax=ax):
                v = list(v)
                v[ax] = x
                return torch.Size(v)

            out.append(dataclasses.replace(
                item, dest_offsets=at(item.dest_offsets, a),
                storage_offsets=at(item.storage_offsets, int(item.storage_offsets[ax]) + a - o),
                lengths=at(item.lengths, b - a),
            ))
        return out

    def _chunked_destination(self, key: DestKey, dest) -> Optional[_ChunkedDest]:
        """A _ChunkedDest when ``dest`` (as DCP sees it) takes the chunked path, else None."""
        if not self.stream_chunk_bytes:
            return None
        base = quantized_base(dest)
        base = dest if base is None else base
        lead = dest.dim() - base.dim()
        if lead < 0 or tuple(dest.shape[lead:]) != tuple(base.shape) or any(int(d) != 1 for d in dest.shape[:lead]):
            return None
        mult = fp8_utils.chunk_row_multiple(base)
        if mult is None or base.numel() == 0:
            return None
        hp_bytes = torch.empty((), dtype=fp8_utils.high_precision_dtype(base)).element_size()
        if base.numel() * hp_bytes <= self.stream_chunk_bytes:
            return None  # fits one chunk: today's whole-destination scratch
        inner = math.prod(int(d) for d in base.shape[1:])
        cols = int(base.shape[-1])
        rows_per_index = inner // cols
        step = mult // math.gcd(mult, rows_per_index)  # leading indices per aligned unit
        # scratch + what the adapter allocates per element of it (+ tensorwise: the scratch's amax row) <= the chunk
        per_element = hp_bytes + fp8_utils.chunk_extra_bytes_per_element(base)
        budget = self.stream_chunk_bytes - (cols * per_element if fp8_utils.needs_whole_tensor_amax(base) else 0)
        chunk_len = max(step, (budget // (inner * per_element)) // step * step)
        return _ChunkedDest(key, base, lead, min(chunk_len, int(base.shape[0])))

    def resolves_to_plain_tensor(self, read_item) -> bool:
        """Whether ``resolve_tensor(read_item)`` will be a plain tensor (a scratch view, a direct chunk's scratch or a
        plain destination) a reader can copy row pieces into, or a ``_CaptureTarget`` (captured chunks) that takes
        one whole ``copy_``. Asked by the staged reader (``staged_read.py``) after the plan is final."""
        key = self._dest_key(read_item.dest_index)
        chunked = self._chunked.get(key)
        if chunked is not None:
            return chunked.direct
        if key in self._quantized_pending:
            return True
        return type(self.lookup_tensor(read_item.dest_index)) in (torch.Tensor, torch.nn.Parameter)

    @staticmethod
    def _is_quantized_destination(dest) -> bool:
        return fp8_utils.is_quantized_tensor(dest) or quantized_base(dest) is not None

    def resolve_tensor(self, read_item):
        key = self._dest_key(read_item.dest_index)
        if key not in self._quantized_pending:
            return super().resolve_tensor(read_item)  # plain destination: DCP's default
        chunked = self._chunked.get(key)
        if chunked is not None and chunked.direct:
            i = int(read_item.dest_offsets[chunked.lead]) // chunked.chunk_len
            buf = chunked.bufs[i] = self._new_chunk(chunked, i)
            return chunked.rows(i, buf).view(tuple(read_item.lengths))
        if chunked is not None:
            return _CaptureTarget(read_item.lengths, chunked.hp, [], f"{key[0]} (offset {key[1]})")
        scratch = self._quantized_scratch.get(key)
        if scratch is None:
            dest = self.lookup_tensor(read_item.dest_index)
            base = quantized_base(dest)
            hp = fp8_utils.high_precision_dtype(base if base is not None else dest)
            buf = torch.empty(dest.shape, dtype=hp, device=dest.device)
            scratch = self._quantized_scratch[key] = _Scratch(dest, buf)
            self._add_live(scratch.nbytes)
        return _narrow(scratch.buf, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor):
        key = self._dest_key(read_item.dest_index)
        if key not in self._quantized_pending:
            return super().commit_tensor(read_item, tensor)  # plain destination: DCP's default
        chunked = self._chunked.get(key)
        if chunked is not None and chunked.direct:
            self._commit_direct(chunked, read_item)
        elif chunked is not None:
            self._commit_chunked(chunked, read_item, tensor)
        elif key not in self._quantized_scratch:
            raise CheckpointingException(
                f"{key[0]}: read item committed for a quantized destination that has no scratch "
                "(resolve_tensor was not called for it)"
            )
        self._quantized_pending[key] -= 1
        if self._quantized_pending[key] == 0:
            del self._quantized_pending[key]
            if chunked is not None:
                self._finish_chunked(chunked)
            else:
                self._quantize_and_free(key)

    # ---- streaming internals -------------------------------------------------------------------------------
    def _release(self, key: DestKey) -> _Scratch:
        scratch = self._quantized_scratch.pop(key)
        self.scratch_bytes_live -= scratch.nbytes
        return scratch

    def _quantize_and_free(self, key: DestKey) -> None:
        scratch = self._release(key)
        dest, buf = scratch.dest, scratch.buf
        base = quantized_base(dest)
        if base is not None:  # a view made for DCP (prepended axes): quantize into the original tensor
            dest = base
        snap = fp8_utils.snapshot_amax(dest)
        fp8_utils.quantize_into(dest, buf)
        fp8_utils.restore_amax(dest, snap)
        self.quantized_destinations_committed += 1
        # Free the memory now: the reader may still hold a narrowed view of ``buf`` until its next item.
        buf.untyped_storage().resize_(0)

    # ---- chunked internals ---------------------------------------------------------------------------------
    def _commit_chunked(self, c: _ChunkedDest, read_item, target) -> None:
        capture = getattr(target, "capture", None)
        if not isinstance(target, _CaptureTarget) or len(capture) != 1:
            raise CheckpointingException(
                f"{c.key[0]}: read item committed without exactly one copy_ into its chunked target "
                f"({0 if capture is None else len(capture)} seen)"
            )
        src = capture.pop()
        offs = [int(o) for o in read_item.dest_offsets][c.lead:]
        lens = [int(n) for n in read_item.lengths][c.lead:]
        src = src.reshape(lens)
        o0 = offs[0]
        for i in range(o0 // c.chunk_len, -(-(o0 + lens[0]) // c.chunk_len)):
            a, b = c.chunk_bounds(i)
            lo, hi = max(a, o0), min(b, o0 + lens[0])
            if lo >= hi:
                continue
            piece = src.narrow(0, lo - o0, hi - lo)
            if piece.untyped_storage().nbytes() > 2 * _nbytes(piece):
                piece = piece.clone()  # do not keep a much larger loaded item alive
            c.pieces.setdefault(i, []).append(((lo - a,) + tuple(offs[1:]), piece))
            c.landed[i] = c.landed.get(i, 0) + piece.numel()
            if c.landed[i] > c.chunk_numel(i):
                raise CheckpointingException(f"{c.key[0]}: read items overlap in chunk {i} (rows {a}..{b})")
            if c.landed[i] == c.chunk_numel(i):
                self._chunk_complete(c, i)

    def _commit_direct(self, c: _ChunkedDest, read_item) -> None:
        i = int(read_item.dest_offsets[c.lead]) // c.chunk_len
        buf = c.bufs.pop(i, None)
        if buf is None:
            raise CheckpointingException(f"{c.key[0]}: chunk {i} committed without a scratch (resolve_tensor was "
                                         "not called for it)")
        try:
            if c.landed.get(i):
                raise CheckpointingException(f"{c.key[0]}: chunk {i} (rows {c.chunk_bounds(i)}) read twice")
            c.landed[i] = c.chunk_numel(i)
            c.done += 1
            if not c.whole_amax:
                self._quantize_rows(c, i, buf)
                return
            self._add_amax(c, c.rows(i, buf))
            if c.done < c.n_chunks:  # the whole amax is not known yet: keep the rows (destination or host memory)
                self._keep(c, i, c.rows(i, buf))
                return
            self._quantize_rows(c, i, buf)  # the chunk that landed last: quantized from its scratch, no round trip
        finally:
            self._free_chunk(buf)
        for j in sorted(set(c.host) | c.parked):
            buf = self._new_chunk(c, j)
            try:
                rows = c.rows(j, buf)
                if j in c.parked:
                    c.parked.discard(j)
                    fp8_utils.unpark_rows(c.dest, c.chunk_bounds(j)[0] * c.inner, rows)
                else:
                    rows.copy_(c.host.pop(j), non_blocking=True)
                self._quantize_rows(c, j, buf)
            finally:
                self._free_chunk(buf)

    def _keep(self, c: _ChunkedDest, i: int, rows: torch.Tensor) -> None:
        """Keep chunk ``i``'s ``rows`` until the whole amax is known, so its scratch can be freed now: in the
        destination's own FP8 data and transpose bytes where it has both (``fp8_utils.park_rows``: a device copy,
        safe because only chunk ``i``'s own quantize writes those data rows, after taking them back, and the
        transpose is rebuilt at the end), else by an asynchronous copy into host memory (pinned for a CUDA scratch;
        ordered on the current stream, so the scratch can be freed at once and the copy back needs no wait)."""
        if fp8_utils.parking_buffers(c.dest) is not None:
            fp8_utils.park_rows(c.dest, c.chunk_bounds(i)[0] * c.inner, rows)
            c.parked.add(i)
            self.parked_bytes += _nbytes(rows)
            return
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=rows.is_cuda)
        host.copy_(rows, non_blocking=True)
        self.host_roundtrip_bytes += _nbytes(host)
        c.host[i] = host

    @staticmethod
    def _add_amax(c: _ChunkedDest, rows: torch.Tensor) -> None:
        m = fp8_utils.amax_of(rows)
        c.amax = m if c.amax is None else torch.maximum(c.amax, m)

    def _new_chunk(self, c: _ChunkedDest, i: int) -> torch.Tensor:
        """Chunk ``i``'s scratch, flat (``c.rows(i, buf)``: its rows; tensorwise: one more row for the amax)."""
        buf = torch.empty(c.scratch_numel(i), dtype=c.hp, device=c.dest.device)
        self._add_live(_nbytes(buf))
        return buf

    def _add_live(self, nbytes: int) -> None:
        self.scratch_bytes_live += nbytes
        self.scratch_bytes_peak = max(self.scratch_bytes_peak, self.scratch_bytes_live)

    def _fill_chunk(self, c: _ChunkedDest, i: int) -> torch.Tensor:
        buf = self._new_chunk(c, i)
        rows = c.rows(i, buf)
        for offsets, piece in c.pieces[i]:
            _narrow(rows, offsets, piece.shape).copy_(piece)
        return buf

    def _free_chunk(self, buf: torch.Tensor) -> None:
        self.scratch_bytes_live -= _nbytes(buf)
        buf.untyped_storage().resize_(0)

    def _quantize_rows(self, c: _ChunkedDest, i: int, buf: torch.Tensor) -> None:
        """Quantize chunk ``i`` from its scratch ``buf`` (tensorwise: with ``c.amax``, in the scratch's amax row);
        what the adapter allocates meanwhile counts as scratch."""
        extra = buf.numel() * fp8_utils.chunk_extra_bytes_per_element(c.dest)
        self._add_live(extra)
        try:
            fp8_utils.quantize_rows_into(c.dest, c.chunk_bounds(i)[0] * c.rows_per_index, buf, c.amax,
                                         padded=c.whole_amax)
        finally:
            self.scratch_bytes_live -= extra

    def _quantize_chunk(self, c: _ChunkedDest, i: int) -> None:
        buf = self._fill_chunk(c, i)
        try:
            self._quantize_rows(c, i, buf)
        finally:
            self._free_chunk(buf)
        del c.pieces[i]

    def _chunk_complete(self, c: _ChunkedDest, i: int) -> None:
        c.done += 1
        if not c.whole_amax:
            self._quantize_chunk(c, i)
            return
        buf = self._fill_chunk(c, i)  # first pass: the chunk's amax only; its pieces stay (host) for the second
        try:
            self._add_amax(c, c.rows(i, buf))
        finally:
            self._free_chunk(buf)

    def _finish_chunked(self, c: _ChunkedDest) -> None:
        if c.done != c.n_chunks:
            raise CheckpointingException(
                f"{c.key[0]}: all read items committed but only {c.done} of {c.n_chunks} chunks complete"
            )
        if c.whole_amax:
            for i in sorted(c.pieces):
                self._quantize_chunk(c, i)
        fp8_utils.finish_rows_quantize(c.dest, rebuild_transpose=c.transpose_valid)
        fp8_utils.restore_amax(c.dest, c.snap)
        del self._chunked[c.key]
        self.quantized_destinations_committed += 1
        self.chunked_destinations_committed += 1
        self.direct_chunked_destinations_committed += int(c.direct)

    def finish_quantized_load(self) -> None:
        """Call after the read. Raises CheckpointingException naming the keys of quantized destinations that did
        not get all of their read items (their scratches are freed; they were not quantized whole: a chunked
        destination may hold some quantized chunks and, tensorwise, parked bytes, with its transpose cache marked
        invalid)."""
        incomplete = sorted(set(self._quantized_pending) | set(self._quantized_scratch) | set(self._chunked), key=str)
        for key in list(self._quantized_scratch):
            self._release(key).buf.untyped_storage().resize_(0)
        for c in self._chunked.values():
            for buf in c.bufs.values():
                self._free_chunk(buf)
        self._quantized_pending = {}
        self._chunked = {}
        if incomplete:
            raise CheckpointingException(
                "streaming load into quantized destinations did not complete for "
                + ", ".join(f"{fqn!r} (offset {off})" for fqn, off in incomplete)
                + ": not every read item of these destinations was committed; they were not quantized"
            )

    def quantized_load_state_is_empty(self) -> bool:
        return (not self._quantized_pending and not self._quantized_scratch and not self._chunked
                and self.scratch_bytes_live == 0)
