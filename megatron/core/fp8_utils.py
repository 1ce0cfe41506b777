"""Adapter for quantized tensors (Transformer Engine QuantizedTensor, or anything following the same protocol).

Everything that needs to know what a quantized tensor is goes through this module; the checkpoint code
(``dist_checkpointing/strategies/quantized_load.py``) only calls the functions below.

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
from typing import Dict, Optional

import torch

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
