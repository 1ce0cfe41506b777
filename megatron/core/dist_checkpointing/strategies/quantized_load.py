"""Loading a checkpoint into quantized destinations (Transformer Engine QuantizedTensor).

Two paths, chosen by ``stream_ckpt_dequant`` (``--stream-ckpt-dequant``):

- legacy upfront (default): ``dequantize_upfront`` swaps every quantized destination for a high-precision tensor
  before the read; the callable it returns quantizes the values back after the read. Transient memory: one
  high-precision copy of *every* quantized destination at once (2 bytes x sum(numel) for bf16).
- streaming: ``QuantizedLoadPlannerMixin`` (mixed into ``MCoreLoadPlanner``) hands DCP, in ``resolve_tensor``, a
  narrowed view of a high-precision scratch of the whole quantized destination (allocated at that destination's
  first read item) and counts, in ``commit_tensor``, the read items that landed. When the last read item of a
  destination landed, the scratch is quantized into the original tensor once (so per-tensor current/tensorwise
  scaling computes its scale over the whole destination, exactly as a plain ``copy_`` of the full tensor would),
  the delayed-scaling amax state is restored around that copy, and the scratch's memory is released at once
  (``untyped_storage().resize_(0)``, so a view the reader still holds does not keep it alive). DCP reads the items
  of one file destination by destination, so about one scratch is alive: peak about 2 bytes x max(numel).

Prepended singleton axes (``prepend_axis_num``): the strategy gives DCP ``view_keeping_base(data, shape)``; the
planner quantizes into that base (a TE Float8Tensor view that adds axes drops the cached transpose, so quantizing into
the view would leave the original's transpose stale), and ``strip_prepended_axes`` / the strategy's unwrap hand the
base back. Where a quantized tensor cannot add axes by view at all (TE blockwise), DCP gets a storage-free stand-in.

All knowledge of quantized tensors is in ``megatron.core.fp8_utils``; plain destinations get DCP's default behaviour.
"""
import logging
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch
from torch.distributed.checkpoint.planner import LoadItemType

from ... import fp8_utils

from ..core import CheckpointingException


logger = logging.getLogger(__name__)

DestKey = Tuple[str, Optional[Tuple[int, ...]]]


# ---- helpers -------------------------------------------------------------------------------------------------
def _nested_values(obj) -> Iterable[Any]:
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _nested_values(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _nested_values(v)
    else:
        yield obj


def _is_sharded_tensor(obj) -> bool:
    try:
        from ..mapping import ShardedTensor
    except ImportError:  # pragma: no cover
        ShardedTensor = None
    if ShardedTensor is not None:
        return isinstance(obj, ShardedTensor)
    return hasattr(obj, "key") and hasattr(obj, "global_offset") and hasattr(obj, "data")


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


# ---- legacy upfront path ---------------------------------------------------------------------------------------
def dequantize_upfront(sharded_state_dict) -> Callable[[], None]:
    """Legacy path hook, called by TorchDistLoadShardedStrategy.load before the read when not streaming.

    Every ShardedTensor whose ``data`` is quantized gets a dequantized high-precision copy as its ``data`` (all of
    them at once). The returned callable, called after the read, quantizes each loaded value back into its original
    quantized tensor (delayed-scaling amax state snapshotted and restored around that copy) and puts the original
    back as the ShardedTensor's ``data``. Without quantized destinations it changes nothing.
    """
    swapped = []
    for sh_ten in _nested_values(sharded_state_dict):
        if _is_sharded_tensor(sh_ten) and fp8_utils.is_quantized_tensor(sh_ten.data):
            original = sh_ten.data
            sh_ten.data = fp8_utils.dequantize(original)
            swapped.append((sh_ten, original))

    def requantize() -> None:
        for sh_ten, original in swapped:
            loaded = sh_ten.data
            snap = fp8_utils.snapshot_amax(original)
            fp8_utils.quantize_into(original, loaded)
            fp8_utils.restore_amax(original, snap)
            sh_ten.data = original
        swapped.clear()

    requantize.num_dequantized = len(swapped)
    return requantize


# ---- streaming path --------------------------------------------------------------------------------------------
class _Scratch:
    __slots__ = ("dest", "buf", "nbytes")

    def __init__(self, dest: torch.Tensor, buf: torch.Tensor):
        self.dest, self.buf, self.nbytes = dest, buf, _nbytes(buf)


class QuantizedLoadPlannerMixin:
    """Mixed into MCoreLoadPlanner before DCP's DefaultLoadPlanner: ``class MCoreLoadPlanner(QuantizedLoadPlannerMixin,
    DefaultLoadPlanner)``. With ``stream_ckpt_dequant=False`` it changes nothing.

    Streaming bookkeeping (all keyed by the destination's ``(fqn, offset)`` from the read items' ``dest_index``):
    ``_quantized_pending`` counts the read items still to land per quantized destination (from the final local plan,
    in ``finish_plan``), ``_quantized_scratch`` holds the live scratches. Both are empty after a complete load;
    :meth:`finish_quantized_load` checks that. ``scratch_bytes_peak`` is the most scratch bytes alive at once;
    ``quantized_destinations_committed`` counts destinations quantized (once each).
    """

    def __init__(self, *args, stream_ckpt_dequant: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.stream_ckpt_dequant = stream_ckpt_dequant
        self._reset_quantized_state()

    def _reset_quantized_state(self) -> None:
        self._quantized_pending: Dict[DestKey, int] = {}
        self._quantized_scratch: Dict[DestKey, _Scratch] = {}
        self.scratch_bytes_live = 0
        self.scratch_bytes_peak = 0
        self.quantized_destinations_committed = 0

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
        if self.stream_ckpt_dequant:
            pending: Dict[DestKey, int] = {}
            for item in plan.items:
                if item.type == LoadItemType.BYTE_IO:
                    continue
                key = self._dest_key(item.dest_index)
                if key in pending:
                    pending[key] += 1
                elif self._is_quantized_destination(self.lookup_tensor(item.dest_index)):
                    pending[key] = 1
            self._quantized_pending = pending
        return plan

    @staticmethod
    def _is_quantized_destination(dest) -> bool:
        return fp8_utils.is_quantized_tensor(dest) or quantized_base(dest) is not None

    def resolve_tensor(self, read_item):
        if not self.stream_ckpt_dequant:
            return super().resolve_tensor(read_item)
        key = self._dest_key(read_item.dest_index)
        if key not in self._quantized_pending:
            return super().resolve_tensor(read_item)  # plain destination: DCP's default
        scratch = self._quantized_scratch.get(key)
        if scratch is None:
            dest = self.lookup_tensor(read_item.dest_index)
            base = quantized_base(dest)
            hp = fp8_utils.high_precision_dtype(base if base is not None else dest)
            buf = torch.empty(dest.shape, dtype=hp, device=dest.device)
            scratch = self._quantized_scratch[key] = _Scratch(dest, buf)
            self.scratch_bytes_live += scratch.nbytes
            self.scratch_bytes_peak = max(self.scratch_bytes_peak, self.scratch_bytes_live)
        return _narrow(scratch.buf, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor):
        if self.stream_ckpt_dequant:
            key = self._dest_key(read_item.dest_index)
            if key in self._quantized_pending:
                if key not in self._quantized_scratch:
                    raise CheckpointingException(
                        f"{key[0]}: read item committed for a quantized destination that has no scratch "
                        "(resolve_tensor was not called for it)"
                    )
                self._quantized_pending[key] -= 1
                if self._quantized_pending[key] == 0:
                    del self._quantized_pending[key]
                    self._quantize_and_free(key)
                return
        return super().commit_tensor(read_item, tensor)

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

    def finish_quantized_load(self) -> None:
        """Call after the read. Raises CheckpointingException naming the keys of quantized destinations that did
        not get all of their read items (their scratches are freed, the destinations are left untouched)."""
        if not self.stream_ckpt_dequant:
            return
        incomplete = sorted(set(self._quantized_pending) | set(self._quantized_scratch), key=str)
        for key in list(self._quantized_scratch):
            self._release(key).buf.untyped_storage().resize_(0)
        self._quantized_pending = {}
        if incomplete:
            raise CheckpointingException(
                "streaming load into quantized destinations did not complete for "
                + ", ".join(f"{fqn!r} (offset {off})" for fqn, off in incomplete)
                + ": not every read item of these destinations was committed; they were not quantized"
            )

    def quantized_load_state_is_empty(self) -> bool:
        return not self._quantized_pending and not self._quantized_scratch and self.scratch_bytes_live == 0
