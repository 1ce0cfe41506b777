"""Adapter for quantized tensors (Transformer Engine QuantizedTensor, or anything following the same protocol).

Everything that needs to know what a quantized tensor is goes through this module; the checkpoint code
(``dist_checkpointing/strategies/stream_ckpt_dequant.py``) only calls the functions below.

Recognized tensors:

- Transformer Engine ``QuantizedTensor`` of any kind (``Float8Tensor`` with a delayed-scaling ``Float8Quantizer``
  or a ``Float8CurrentScalingQuantizer``, ``MXFP8Tensor``, ``Float8BlockwiseQTensor``, ``NVFP4Tensor``), when TE is
  installed (imported only through ``megatron.core.extensions.transformer_engine``).
- Any ``torch.Tensor`` whose class sets ``__mcore_quantized_tensor__ = True`` and provides the small protocol TE's
  tensors provide: ``dequantize(dtype=None)`` returns a plain high-precision tensor; ``copy_(src)`` quantizes ``src``
  into the tensor with its own quantizer; ``view(*shape)`` stays quantized; ``quantization_kind`` names one of
  :data:`KINDS`; delayed scaling keeps its state on ``_quantizer`` (``amax``, ``scale``, and optionally
  ``amax_history``). The tests' ``FakeQuantizedTensor`` is one.

Plain tensors pass through every function unchanged, so callers need no ``if``.
"""
import contextlib
import contextvars
import functools
import inspect
from typing import Dict, Optional

import torch

from .dist_utils import is_distributed
from .extensions import transformer_engine as _te

DELAYED = "delayed"  # FP8 per-tensor delayed scaling (Float8Quantizer: scale from an amax history)
TENSORWISE = "tensorwise"  # FP8 per-tensor current scaling (Float8CurrentScalingQuantizer)
MXFP8 = "mxfp8"  # MXFP8 block scaling (1x32 blocks, E8M0 scales)
BLOCKWISE = "blockwise"  # FP8 blockwise scaling (Float8BlockQuantizer, 128x128 / 1x128 blocks)
NVFP4 = "nvfp4"  # NVFP4 (FP4 E2M1 with FP8 block scales and a per-tensor amax)
KINDS = (DELAYED, TENSORWISE, MXFP8, BLOCKWISE, NVFP4)

_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _te_cls(name: str):
    return getattr(_te, name, None)


def _is_te_quantized(t) -> bool:
    qt = _te_cls("QuantizedTensor")
    return qt is not None and isinstance(t, qt)


def is_quantized_tensor(t) -> bool:
    """True for a TE QuantizedTensor of any kind, or a tensor implementing the quantized-tensor protocol."""
    if not isinstance(t, torch.Tensor):
        return False
    if getattr(type(t), "__mcore_quantized_tensor__", False):
        return True
    return _is_te_quantized(t)


def quantization_kind(t) -> Optional[str]:
    """One of :data:`KINDS` for a quantized tensor, ``None`` for a plain tensor (or a quantized kind not known)."""
    if not is_quantized_tensor(t):
        return None
    kind = getattr(t, "quantization_kind", None)
    if isinstance(kind, str):
        return kind
    # Transformer Engine: by class, and for Float8Tensor by the quantizer that made it.
    checks = (("MXFP8Tensor", MXFP8), ("Float8BlockwiseQTensor", BLOCKWISE), ("NVFP4Tensor", NVFP4))
    for cls_name, k in checks:
        cls = _te_cls(cls_name)
        if cls is not None and isinstance(t, cls):
            return k
    f8 = _te_cls("Float8Tensor")
    if f8 is not None and isinstance(t, f8):
        q = getattr(t, "_quantizer", None)
        cur = _te_cls("Float8CurrentScalingQuantizer")
        if cur is not None and isinstance(q, cur):
            return TENSORWISE
        delayed = _te_cls("Float8Quantizer")
        if delayed is not None and isinstance(q, delayed):
            return DELAYED
        return None  # a Float8Tensor without a quantizer (cannot be re-quantized in place)
    return None


def is_delayed_scaling(t) -> bool:
    return quantization_kind(t) == DELAYED


def high_precision_dtype(t) -> torch.dtype:
    """The dtype a dequantized ``t`` has: the nominal dtype of a quantized tensor (bf16 if it reports none)."""
    if is_quantized_tensor(t):
        dt = t.dtype
        return dt if dt in _HIGH_PRECISION else torch.bfloat16
    return t.dtype


def dequantize(t, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A plain high-precision copy of a quantized tensor; a plain tensor is returned as is (or cast to ``dtype``)."""
    if not is_quantized_tensor(t):
        return t if dtype is None or t.dtype == dtype else t.to(dtype)
    with torch.no_grad():
        out = t.dequantize(dtype=dtype or high_precision_dtype(t))
    return out


def quantize_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Write ``src`` into ``dst`` in place. A quantized ``dst`` quantizes ``src`` with its own quantizer (TE:
    ``dst.copy_(src)``); a plain ``dst`` is a plain copy. ``src`` may differ from ``dst`` in shape only by a
    reshape (same numel). Amax bookkeeping is the caller's: see :func:`snapshot_amax`."""
    if tuple(src.shape) != tuple(dst.shape):
        if src.numel() != dst.numel():
            raise ValueError(f"quantize_into: shapes {tuple(src.shape)} and {tuple(dst.shape)} differ in numel")
        src = src.reshape(dst.shape)
    with torch.no_grad():
        if is_quantized_tensor(dst) and src.device != dst.device:
            src = src.to(dst.device)
        dst.copy_(src)
    return dst


def _delayed_state(t) -> Dict[str, torch.Tensor]:
    """The tensors that a quantizing copy_ into a delayed-scaling tensor may change (besides its data/scale_inv)."""
    if not is_delayed_scaling(t):
        return {}
    q = getattr(t, "_quantizer", None)
    if q is None:
        return {}
    state = {}
    for name in ("amax_history", "amax", "scale"):
        v = getattr(q, name, None)
        if isinstance(v, torch.Tensor):
            state[name] = v
    return state


def get_amax_history(t) -> Optional[torch.Tensor]:
    """The amax history a delayed-scaling tensor's next scale is computed from; ``None`` for other tensors.

    TE: the quantizer's ``amax`` (in a TE module it is a view into the recipe's amax history row that
    the next cast writes); the protocol's ``_quantizer.amax_history`` where it has one."""
    state = _delayed_state(t)
    return state.get("amax_history", state.get("amax"))


def snapshot_amax(t):
    """A snapshot of the delayed-scaling state of ``t`` (amax history / amax and scale), or ``None``.

    The snapshot holds clones; :func:`restore_amax` writes them back in place, so views of these tensors (TE
    modules keep the quantizer's amax as a view into the recipe state) see the restored values too."""
    state = _delayed_state(t)
    if not state:
        return None
    return {name: (v, v.detach().clone()) for name, v in state.items()}


def restore_amax(t, snap) -> None:
    """Undo what a quantizing copy did to the delayed-scaling state of ``t`` (see :func:`snapshot_amax`)."""
    if not snap:
        return
    with torch.no_grad():
        for live, saved in snap.values():
            live.copy_(saved)


# ---- Transformer Engine: recipe availability and building quantized tensors (tests, benchmarks) -------------
_TE_AVAILABILITY = {
    DELAYED: "te_is_fp8_available",
    TENSORWISE: "te_is_fp8_available",
    BLOCKWISE: "te_is_fp8_block_scaling_available",
    MXFP8: "te_is_mxfp8_available",
    NVFP4: "te_is_nvfp4_available",
}


def te_recipe_available(kind: str):
    """``(available, reason)`` for building TE quantized tensors of ``kind`` on this machine."""
    if kind not in KINDS:
        raise ValueError(f"unknown quantization kind {kind!r}; expected one of {KINDS}")
    if not _te.HAVE_TE:
        return False, "Transformer Engine is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    fn = getattr(_te, _TE_AVAILABILITY[kind], None)
    if fn is None:
        return False, f"this Transformer Engine has no {_TE_AVAILABILITY[kind][3:]}"
    ok, reason = fn(return_reason=True)
    return bool(ok), str(reason or "")


def te_quantize(x: torch.Tensor, kind: str, *, scale: Optional[torch.Tensor] = None,
                amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A TE quantized tensor of ``kind`` holding ``x`` (nominal dtype ``x.dtype``), made with a fresh quantizer.

    ``delayed``: ``Float8Quantizer(scale, amax)`` (default scale 1, amax a zero; pass views into an amax history to
    mimic a TE module); ``tensorwise``: ``Float8CurrentScalingQuantizer``; ``blockwise``: ``Float8BlockQuantizer``
    (2-D 128x128 blocks); ``mxfp8``: ``MXFP8Quantizer``; ``nvfp4``: ``NVFP4Quantizer``."""
    _te.require_te(f"te_quantize({kind!r})")
    dt = _te.te_DType
    e4m3 = dt.kFloat8E4M3
    dev = x.device
    if kind == DELAYED:
        q = _te.Float8Quantizer(
            scale=scale if scale is not None else torch.ones(1, dtype=torch.float32, device=dev),
            amax=amax if amax is not None else torch.zeros(1, dtype=torch.float32, device=dev),
            fp8_dtype=e4m3,
        )
    elif kind == TENSORWISE:
        q = _te.Float8CurrentScalingQuantizer(e4m3, dev)
    elif kind == BLOCKWISE:
        q = _te.Float8BlockQuantizer(e4m3, rowwise=True, columnwise=True, block_scaling_dim=2)
    elif kind == MXFP8:
        q = _te.MXFP8Quantizer(e4m3)
    elif kind == NVFP4:
        q = _te.NVFP4Quantizer()
    else:
        raise ValueError(f"unknown quantization kind {kind!r}; expected one of {KINDS}")
    with torch.no_grad():
        return q(x)


# ---- chunked quantization: the streaming load's bounded-memory path ---------------------------------------------
# A quantized tensor is seen here as 2-D: rows = numel // shape[-1], cols = shape[-1] (row-major, so a range of rows
# is a range of the leading axis for 2-D weights). ``quantize_rows_into`` quantizes a range of rows into the
# tensor's own raw buffers, giving exactly the bytes (data and scales) a whole-tensor quantize gives for those rows
# when the range starts (and, except for the last one, ends) on a multiple of ``chunk_row_multiple``:
# - delayed: the quantizer's fixed per-tensor scale is used for every range (TE: a Float8Quantizer over that scale,
#   writing into row views of ``_data``); scale_inv is set from it.
# - tensorwise: the caller passes the whole tensor's amax (max |x| over all ranges, exact in the source's dtype);
#   the rows are quantized together with one extra row holding that amax, so the quantizer, computing its scale
#   from the amax of what it is given (current scaling), computes the whole tensor's scale, and the cast is
#   elementwise (TE: a fresh current-scaling quantizer of the destination's settings, so TE computes the scale
#   itself). A caller that allocates its source with that extra row (``padded=True``, n + 1 rows, the last one free)
#   saves the (n + 1)-row copy; the amax row is always written here.
# - mxfp8 (1x32 rowwise, 32x1 columnwise blocks) and blockwise (128x128 blocks): ranges aligned to the blocks are
#   independent; TE: the range is quantized by the tensor's quantizer into a temporary and its buffers copied into
#   the destination's rows (rowwise data/scales) and columns (blockwise's transposed columnwise data/scales).
# After the last range ``finish_rows_quantize`` makes derived caches consistent (TE Float8Tensor: a ``_transpose``
# that exists is recomputed from ``_data`` into its own buffer, no new memory).
# Protocol tensors provide ``chunk_row_multiple`` (int), ``quantize_rows_(row_start, src2d, padded=False)``
# (tensorwise: always ``padded``: ``src2d`` has n + 1 rows, the last holding the whole tensor's amax; the tensor
# computes its scale from max |src2d| and writes the first n rows) and optionally ``finish_rows_quantize_()``; a
# protocol tensor opts in to :func:`parking_buffers` with the class attribute ``parks_rows_in_own_bytes = True``
# (its ``quantize_rows_`` then never writes ``_transpose`` and ``finish_rows_quantize_`` rebuilds it whole). Kinds
# without a chunked path here (nvfp4: global amax plus 16-element blocks and a random Hadamard transform; MXFP8
# with GEMM-swizzled scales; unknown layouts) return None from ``chunk_row_multiple``: the caller quantizes them
# whole.
_TE_ROW_MULTIPLE = {DELAYED: 1, TENSORWISE: 1, MXFP8: 128, BLOCKWISE: 128}


def rows_cols(t) -> tuple:
    """``(rows, cols)`` of the 2-D view of ``t`` the chunked path works on."""
    if t.dim() == 0:
        return 1, 1
    cols = int(t.shape[-1])
    return (t.numel() // cols if cols else 0), cols


def chunk_row_multiple(t) -> Optional[int]:
    """Row ranges of ``t`` quantized by :func:`quantize_rows_into` must start on a multiple of this (MXFP8: 128 for
    TE, the scale padding granule; blockwise: 128). ``None``: ``t`` has no chunked path (quantize it whole)."""
    if not is_quantized_tensor(t) or t.dim() < 2:
        return None
    if not _is_te_quantized(t):
        m = getattr(t, "chunk_row_multiple", None)
        return int(m) if isinstance(m, int) and m > 0 and hasattr(t, "quantize_rows_") else None
    kind = quantization_kind(t)
    if kind not in _TE_ROW_MULTIPLE:
        return None
    if kind == MXFP8 and getattr(t, "_with_gemm_swizzled_scales", False):
        return None  # swizzled scales: a row range is not a slice of the scale buffers
    if kind == BLOCKWISE and not getattr(t, "_is_2D_scaled", True):
        return None  # 1x128 blocks: scales stored transposed and padded; not handled
    return _TE_ROW_MULTIPLE[kind]


def chunk_extra_bytes_per_element(t) -> int:
    """Transient bytes per element of the source that :func:`quantize_rows_into` allocates besides the caller's
    high-precision source (TE MXFP8/blockwise: the temporary rowwise + columnwise FP8 data; TE tensorwise: the FP8
    cast of the padded source, which the caller allocates with its extra row: ``padded=True``)."""
    if not _is_te_quantized(t):
        return 0
    kind = quantization_kind(t)
    if kind in (MXFP8, BLOCKWISE):
        return 2
    if kind == TENSORWISE:
        return 1
    return 0


def needs_whole_tensor_amax(t) -> bool:
    """True when a range cannot be quantized before the amax of the whole tensor is known (tensorwise)."""
    return quantization_kind(t) == TENSORWISE


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a one-element float32 tensor on ``x``'s device (exact: the largest element's magnitude). One
    min/max reduction, no temporary of ``x``'s size (``abs()`` would allocate one), no host sync."""
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x.detach().reshape(-1))
    return torch.maximum(hi, lo.neg()).to(torch.float32).reshape(1)


def quantize_rows_into(dst: torch.Tensor, row_start: int, src: torch.Tensor,
                       amax: Optional[torch.Tensor] = None, *, padded: bool = False) -> None:
    """Quantize ``src`` (high precision, ``n`` rows of ``dst``'s 2-D view, any shape of that numel) into rows
    ``[row_start, row_start + n)`` of ``dst`` in place. ``amax``: the whole tensor's (tensorwise only; exact in the
    source's dtype, as max |x| of values of that dtype is). ``padded``: ``src`` holds ``n + 1`` rows (contiguous),
    the last one free: this function writes the amax row there (tensorwise) instead of copying the rows into a new
    (n + 1)-row buffer, and quantizes the first ``n``. Amax bookkeeping of delayed scaling is untouched by this path
    (callers snapshot/restore anyway)."""
    rows, cols = rows_cols(dst)
    mult = chunk_row_multiple(dst)
    if mult is None:
        raise ValueError(f"quantize_rows_into: {type(dst).__name__} ({quantization_kind(dst)}) has no chunked path")
    total = src.numel() // cols if cols else 0
    n = total - int(padded)
    if src.numel() != total * cols or n < 0 or row_start < 0 or row_start + n > rows:
        raise ValueError(f"quantize_rows_into: rows [{row_start}, {row_start + n}) (src shape {tuple(src.shape)}"
                         f"{', padded' if padded else ''}) outside a {rows}x{cols} destination")
    if row_start % mult or (row_start + n != rows and n % mult):
        raise ValueError(f"quantize_rows_into: rows [{row_start}, {row_start + n}) not aligned to {mult} rows")
    whole_amax = needs_whole_tensor_amax(dst)
    if whole_amax and amax is None:
        raise ValueError("quantize_rows_into: a tensorwise destination needs the whole tensor's amax")
    with torch.no_grad():
        src2d = src.reshape(total, cols)
        if whole_amax:  # n rows + the amax row: the quantizer computes the whole tensor's scale (see above)
            if not padded:
                src2d = torch.empty((n + 1, cols), dtype=high_precision_dtype(dst), device=dst.device)
                src2d[:n].copy_(src.reshape(n, cols))
            src2d[n:].copy_(amax.reshape(1, 1).expand(1, cols))
        elif padded:
            src2d = src2d[:n]
        if not _is_te_quantized(dst):
            dst.quantize_rows_(row_start, src2d, padded=whole_amax)
        else:
            _te_quantize_rows(dst, row_start, src2d.to(dst.device))


def parking_buffers(t) -> Optional[tuple]:
    """Two flat byte views of ``t``'s own storage, ``numel`` bytes each, that the row-range quantize
    (:func:`quantize_rows_into`) of a row range writes only in that range's rows of the first, and that
    :func:`finish_rows_quantize` rewrites whole: the rowwise FP8 data and the FP8 transpose cache of a per-tensor
    (delayed / tensorwise) tensor that has one (TE Float8Tensor ``_data`` / ``_transpose``; the protocol's same
    names). Together they hold 2 bytes per element: a bf16/fp16 row range can wait there for the whole tensor's
    amax (:func:`park_rows` / :func:`unpark_rows`) instead of in host memory. ``None`` when ``t`` has no such pair
    (no transpose cache, a 4-byte high-precision dtype, other kinds, a protocol tensor that did not opt in)."""
    if quantization_kind(t) not in (DELAYED, TENSORWISE) or high_precision_dtype(t).itemsize != 2:
        return None
    if not _is_te_quantized(t) and not getattr(type(t), "parks_rows_in_own_bytes", False):
        return None  # its row-range quantize might keep the transpose in step, over other chunks' parked bytes
    bufs = (getattr(t, "_data", None), getattr(t, "_transpose", None))
    n = t.numel()
    if not all(isinstance(b, torch.Tensor) and b.is_contiguous() and b.element_size() == 1 and b.numel() == n
               for b in bufs):
        return None
    return tuple(b.view(torch.uint8).view(-1) for b in bufs)


def park_rows(dst: torch.Tensor, start: int, rows: torch.Tensor) -> None:
    """Keep ``rows`` (contiguous, 2-byte elements: elements ``[start, start + rows.numel())`` of ``dst``) in
    ``dst``'s own :func:`parking_buffers`, at the same element range of each (a device-side copy, no host memory).
    The transpose cache is marked invalid meanwhile (``_transpose_invalid``), so a load that fails before
    :func:`finish_rows_quantize` never leaves parked bytes posing as a valid transpose (TE recomputes an invalid one
    when it is needed); pass ``rebuild_transpose`` there to rebuild it after a complete load."""
    a, b = parking_buffers(dst)
    m = rows.numel()
    raw = rows.reshape(-1).view(torch.uint8)
    a[start:start + m].copy_(raw[:m])
    b[start:start + m].copy_(raw[m:])
    dst._transpose_invalid = True


def unpark_rows(dst: torch.Tensor, start: int, out: torch.Tensor) -> None:
    """The rows :func:`park_rows` kept at element ``start`` of ``dst``, bit for bit, into ``out`` (contiguous)."""
    a, b = parking_buffers(dst)
    m = out.numel()
    raw = out.reshape(-1).view(torch.uint8)
    raw[:m].copy_(a[start:start + m])
    raw[m:].copy_(b[start:start + m])


def transpose_is_valid(t) -> bool:
    """Whether ``t`` has a transpose cache that is currently valid (TE Float8Tensor ``_transpose`` not marked
    ``_transpose_invalid``; the protocol's same names)."""
    return getattr(t, "_transpose", None) is not None and not getattr(t, "_transpose_invalid", False)


def finish_rows_quantize(dst: torch.Tensor, rebuild_transpose: bool = False) -> None:
    """Call once after every row range of ``dst`` went through :func:`quantize_rows_into`. ``rebuild_transpose``:
    the transpose was valid before rows were parked in it (:func:`park_rows` marked it invalid): rebuild it."""
    if rebuild_transpose:
        dst._transpose_invalid = False
    with torch.no_grad():
        if not _is_te_quantized(dst):
            fn = getattr(dst, "finish_rows_quantize_", None)
            if fn is not None:
                fn()
            return
        if quantization_kind(dst) in (DELAYED, TENSORWISE) and getattr(dst, "_transpose", None) is not None:
            if getattr(dst, "_transpose_invalid", False):
                return  # TE recomputes an invalid transpose when it is next needed
            create = getattr(dst, "_create_transpose", None)
            if create is not None:
                create()  # tex.fp8_transpose of _data into the existing _transpose buffer
            else:
                dst._transpose_invalid = True


# ---- TE implementation of the row-range quantize (GPU; checked by tests marked gpu and the benchmark's err) ---
def _te_tensorwise_rows(dst, r0: int, padded2d: torch.Tensor) -> None:
    """Rows ``[r0, r0 + n)`` of a current-scaling (tensorwise) destination as a whole-tensor quantize writes them,
    from ``padded2d``: those ``n`` rows plus one row holding the whole tensor's amax (see quantize_rows_into).

    TE (2.20) keeps no scale on its current-scaling quantizer and computes the scale from the amax of what it is
    given: a fresh quantizer of the destination's settings, given the padded rows (whose amax is the whole tensor's),
    computes the whole tensor's scale; the cast is elementwise. Transient: its FP8 output, 1 byte per element."""
    q = dst._quantizer
    n, cols = padded2d.shape[0] - 1, padded2d.shape[1]
    cast_q = _te.Float8CurrentScalingQuantizer(
        q.dtype, dst.device, rowwise=True, columnwise=False,
        force_pow_2_scales=getattr(q, "force_pow_2_scales", False), amax_epsilon=getattr(q, "amax_epsilon", 0.0),
    )
    out = cast_q(padded2d)
    dst._data.view(-1, cols)[r0:r0 + n].copy_(out._data.view(n + 1, cols)[:n])
    dst._scale_inv.copy_(out._scale_inv)


def _te_quantize_rows(dst, r0: int, src2d: torch.Tensor) -> None:
    """TE: ``src2d`` into rows ``[r0, ...)`` of ``dst`` (tensorwise: ``src2d`` is padded, see quantize_rows_into)."""
    kind = quantization_kind(dst)
    src2d = src2d.to(high_precision_dtype(dst)).contiguous()
    if kind == TENSORWISE:
        _te_tensorwise_rows(dst, r0, src2d)
        return
    n, cols = src2d.shape
    if kind == DELAYED:
        q = dst._quantizer
        cast_q = _te.Float8Quantizer(
            scale=q.scale, amax=torch.zeros(1, dtype=torch.float32, device=dst.device), fp8_dtype=q.dtype,
            rowwise=True, columnwise=False,
        )
        rows_view = dst._data.view(-1, cols)[r0:r0 + n]
        out = _te.Float8Tensor(
            shape=(n, cols), dtype=dst.dtype, data=rows_view,
            fp8_scale_inv=torch.empty(1, dtype=torch.float32, device=dst.device), fp8_dtype=q.dtype,
            requires_grad=False, data_transpose=None, quantizer=cast_q,
        )
        cast_q.update_quantized(src2d, out)
        dst._scale_inv.copy_(out._scale_inv)
        return
    tmp = dst._quantizer(src2d)
    if kind == MXFP8:
        g = 32
        for name in ("_rowwise_data", "_columnwise_data"):
            d, t = getattr(dst, name), getattr(tmp, name)
            if d is not None and t is not None:
                d.view(-1, cols)[r0:r0 + n].copy_(t.view(n, cols))
        d, t = dst._rowwise_scale_inv, tmp._rowwise_scale_inv
        if d is not None and t is not None:
            d[r0:r0 + n].copy_(t[:n])
        d, t = dst._columnwise_scale_inv, tmp._columnwise_scale_inv
        if d is not None and t is not None:
            k = -(-n // g)
            d[r0 // g:r0 // g + k].copy_(t[:k])
        return
    # BLOCKWISE, 128x128: rowwise [R, C] + scales [ceil(R/128), .]; columnwise data is the transpose [C, R] with
    # scales [ceil(C/128), ceil(R/128) padded]: a row range is a column range there.
    g = 128
    k = -(-n // g)
    if dst._rowwise_data is not None and tmp._rowwise_data is not None:
        dst._rowwise_data.view(-1, cols)[r0:r0 + n].copy_(tmp._rowwise_data.view(n, cols))
        dst._rowwise_scale_inv[r0 // g:r0 // g + k].copy_(tmp._rowwise_scale_inv[:k])
    if dst._columnwise_data is not None and tmp._columnwise_data is not None:
        dst._columnwise_data.view(cols, -1)[:, r0:r0 + n].copy_(tmp._columnwise_data.view(cols, n))
        dst._columnwise_scale_inv[:, r0 // g:r0 // g + k].copy_(tmp._columnwise_scale_inv[:, :k])


# ---- the distributed optimizer's quantized param gather (--use-distributed-optimizer --fp8-param-gather) -----------
DIST_OPT_KINDS = (DELAYED, TENSORWISE, BLOCKWISE)
"""Kinds whose weights the distributed optimizer can update shard by shard and all-gather as bytes: one byte per
element in the rowwise data, the scales equal on every rank after the amax reduction (per tensor, or per block for
blockwise). MXFP8 (per-rank E8M0 scales of 1x32 blocks, TE cannot re-point its data) and NVFP4 (half a byte per
element) are not."""


def rowwise_bytes(t) -> Optional[torch.Tensor]:
    """The flat, 1-byte-per-element rowwise data of a quantized weight of a :data:`DIST_OPT_KINDS` kind (TE
    Float8Tensor ``_data``, Float8BlockwiseQTensor ``_rowwise_data``; the protocol's ``_data``), viewed as uint8;
    None for anything else."""
    if quantization_kind(t) not in DIST_OPT_KINDS:
        return None
    data = getattr(t, "_rowwise_data", None) if quantization_kind(t) == BLOCKWISE else None
    if data is None:
        data = getattr(t, "_data", None)
    if not isinstance(data, torch.Tensor) or data.numel() != t.numel() or data.element_size() != 1:
        return None
    return data.view(torch.uint8).view(-1)


@functools.lru_cache(maxsize=None)
def _takes_manual_post_processing(fn) -> bool:
    import inspect

    return "manual_post_all_gather_processing" in inspect.signature(fn).parameters


@torch.no_grad()
def quantize_master_shards(weights, masters, offsets, group) -> None:
    """Step "quantize own shard" of the distributed optimizer: ``masters[i]`` (the fp32 main values of flat elements
    ``[offsets[i], offsets[i] + numel)`` of ``weights[i]``, or None when this rank owns none) is quantized into that
    range of the weight's rowwise bytes. Scaling as upstream: delayed scaling uses the weight's current scale and
    records the amax, current (tensorwise) scaling takes its scale from the amax reduced over ``group`` (so every rank
    computes the same scale), blockwise reduces each block's amax. A collective over ``group`` (every rank passes the
    same weights). TE weights go through TE's ``quantize_master_weights``; protocol tensors through their
    ``quantize_master_shard_(offset, master, amax)`` with the group's per-tensor amax."""
    te_items = [(w, m, o) for w, m, o in zip(weights, masters, offsets) if _is_te_quantized(w)]
    own = [(w, m, o) for w, m, o in zip(weights, masters, offsets) if not _is_te_quantized(w)]
    if te_items:
        if _te.te_quantize_master_weights is None:
            _te.require_te("--use-distributed-optimizer with --fp8-param-gather")
            raise RuntimeError("--use-distributed-optimizer with --fp8-param-gather needs Transformer Engine's "
                               "quantize_master_weights (transformer_engine.pytorch.tensor.utils); upgrade it")
        w, m, o = (list(x) for x in zip(*te_items))
        fn = _te.te_quantize_master_weights
        if _takes_manual_post_processing(fn):
            fn(w, m, o, group, manual_post_all_gather_processing=True)  # finish_param_gather does it
        else:  # an older TE: it refreshes the derived buffers at the next forward itself
            fn(w, m, o, group)
    if own:
        amax = torch.stack([m.detach().abs().max().float() if m is not None and m.numel()
                            else torch.zeros((), device=w.device) for w, m, _ in own])
        if group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
        for (w, m, o), a in zip(own, amax):
            w.quantize_master_shard_(o, m, a)


@torch.no_grad()
def quantize_whole_masters(weights, masters) -> None:
    """Step "quantize" of a distributed optimizer whose data-parallel group is one rank (each weight's fp32 master is
    whole on this rank, nothing to gather): TE weights quantize it in place with their own quantizer
    (``weight.copy_(master)``: one fused cast, transpose included where the weight keeps one, the amax recorded as
    the cast records it; the replicated optimizer's path, one rounding from fp32), instead of TE's shard path
    (master to the weight dtype, a Float8Tensor view per shard, the cast, the transpose in another pass); others
    through ``quantize_master_shards`` + ``finish_param_gather``, as any rank count."""
    ws, ms = [], []  # the weights that are not TE's
    for w, m in zip(weights, masters):
        if _is_te_quantized(w):
            w.copy_(m.view(w.shape))
        else:
            ws.append(w)
            ms.append(m)
    if ws:
        quantize_master_shards(ws, ms, [0] * len(ws), None)
        finish_param_gather(ws)


@torch.no_grad()
def finish_param_gather(weights) -> None:
    """After the rowwise bytes of ``weights`` were all-gathered: rebuild what derives from them (TE: transpose /
    columnwise data, ``post_all_gather_processing``; the protocol's ``finish_rows_quantize_``)."""
    te_weights = [w for w in weights if _is_te_quantized(w)]
    if te_weights and _te.te_post_all_gather_processing is not None:
        _te.te_post_all_gather_processing(te_weights)
    for w in weights:
        if not _is_te_quantized(w) and hasattr(w, "finish_rows_quantize_"):
            w.finish_rows_quantize_()


def is_first_last_bf16_layer(config, layer_no: int) -> bool:
    """Whether global layer ``layer_no`` (0-based) stays in high precision (``--first-last-layers-bf16``: the first
    ``num_layers_at_start_in_bf16`` and the last ``num_layers_at_end_in_bf16`` layers): neither FP8/FP4-computed nor
    built with quantized weights. Upstream's function; ``layer_no < 0`` (MTP, "any layer") is never such a layer."""
    if layer_no < 0 or not getattr(config, "first_last_layers_bf16", False):
        return False
    return layer_no < config.num_layers_at_start_in_bf16 or layer_no >= config.num_layers - config.num_layers_at_end_in_bf16


# ---- TE recipes and contexts (get_fp8_context below, and the TE layer wrappers, use them) ------------------------
def _te_layers_available() -> bool:
    """TE is installed with the layers the wrappers build on (read at each call: tests stand a fake TE in)."""
    return bool(_te.HAVE_TE and _te.TELinear is not None and _te.TELayerNormLinear is not None)


def check_te_available() -> None:
    """Raise a clear error when TE layers are asked for but Transformer Engine is not installed."""
    if not _te_layers_available():
        raise RuntimeError(
            "--transformer-impl transformer_engine (TransformerConfig.transformer_impl='transformer_engine') needs "
            "Transformer Engine, which is not installed or failed to import; install it on a CUDA machine "
            "(pip install 'megatron-core-fork[te]') or use --transformer-impl local"
        )


def get_quantization_recipe(config):
    """The TE recipe for ``config.fp8`` / ``config.fp8_recipe`` (or ``config.fp4``), None when neither is set."""
    check_te_available()
    r = _te.te_recipe
    if config.fp4 is not None:
        return r.NVFP4BlockScaling()
    if config.fp8 is None:
        return None
    fmt = r.Format.E4M3 if config.fp8 == "e4m3" else r.Format.HYBRID
    if config.fp8_recipe == "delayed":
        return r.DelayedScaling(
            margin=config.fp8_margin,
            fp8_format=fmt,
            amax_history_len=config.fp8_amax_history_len,
            amax_compute_algo=config.fp8_amax_compute_algo,
        )
    if config.fp8_recipe == "tensorwise":
        return r.Float8CurrentScaling(fp8_format=fmt)
    if config.fp8_recipe == "mxfp8":
        return r.MXFP8BlockScaling(fp8_format=fmt)
    if config.fp8_recipe == "blockwise":
        return r.Float8BlockScaling(fp8_format=fmt)
    raise ValueError(f"unknown fp8_recipe {config.fp8_recipe!r} (--fp8-recipe)")


def _call_with_recipe(fn, recipe, **kwargs):
    params = inspect.signature(fn).parameters
    key = "recipe" if "recipe" in params else "fp8_recipe"
    return fn(**{key: recipe}, **kwargs)


def te_quantization_autocast(config):
    """TE autocast (``te.pytorch.autocast`` or the older ``fp8_autocast``) for the config's fp8/fp4 recipe; amax
    reduction (delayed scaling) over the data x context parallel group when torch.distributed is initialised."""
    check_te_available()
    kwargs = {"enabled": True}
    if is_distributed():
        from megatron.core import parallel_state

        params = inspect.signature(_te.te_autocast).parameters
        group_key = "amax_reduction_group" if "amax_reduction_group" in params else "fp8_group"
        if group_key in params:
            kwargs[group_key] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return _call_with_recipe(_te.te_autocast, get_quantization_recipe(config), **kwargs)


_HIGH_PRECISION_INIT = contextvars.ContextVar("high_precision_init", default=False)


@contextlib.contextmanager
def high_precision_init():
    """TE modules built inside get plain (not quantized) weights whatever ``fp8_param`` / ``fp4_param`` say: the
    layers ``--first-last-layers-bf16`` keeps in high precision."""
    token = _HIGH_PRECISION_INIT.set(True)
    try:
        yield
    finally:
        _HIGH_PRECISION_INIT.reset(token)


def te_quantized_init_context(config):
    """TE ``quantized_model_init`` / ``fp8_model_init`` when ``fp8_param`` / ``fp4_param`` (not inside
    ``high_precision_init``), else a no-op."""
    if not (config.fp8_param or config.fp4_param) or _HIGH_PRECISION_INIT.get():
        return contextlib.nullcontext()
    check_te_available()
    if _te.te_quantized_model_init is None:
        raise RuntimeError("this Transformer Engine has neither quantized_model_init nor fp8_model_init (--fp8-param-gather)")
    return _call_with_recipe(_te.te_quantized_model_init, get_quantization_recipe(config), enabled=True)


# ---- upstream's FP8 context API (training loop, TransformerBlock) ----------------------------------------------
def get_fp8_context(config, layer_no: int = -1, is_init: bool = False):
    """Upstream's FP8 context: ``is_init=False``: TE's autocast with the config's recipe when ``config.fp8`` is set
    (what ``TransformerBlock`` runs its layers under); ``is_init=True``: TE's quantized model init when
    ``config.fp8_param`` is set (weights built as TE quantized tensors). ``nullcontext()`` otherwise, and for a layer ``layer_no`` (0-based,
    global) that ``--first-last-layers-bf16`` keeps in high precision (``is_first_last_bf16_layer``)."""
    if not (config.fp8_param if is_init else config.fp8) or is_first_last_bf16_layer(config, layer_no):
        return contextlib.nullcontext()
    return te_quantized_init_context(config) if is_init else te_quantization_autocast(config)


def correct_amax_history_if_needed(model) -> None:
    """Upstream's fix-up of FP8 weights' amax history after ``module.bfloat16()`` for Transformer Engine 1.x; TE 2.x
    (the versions this fork supports) needs none, as upstream's TE 2 path: a no-op."""
    return None
