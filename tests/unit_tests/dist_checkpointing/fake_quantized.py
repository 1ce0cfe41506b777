"""A small pure-torch quantized tensor for tests: behaves like Transformer Engine's Float8Tensor where the checkpoint
code cares (dequantize, copy_ quantizes, view stays quantized, detach), so the quantized-load logic runs in CI.

``FakeQuantizedTensor`` is a wrapper subclass (``_make_wrapper_subclass`` + ``__torch_dispatch__``) presenting a
high-precision nominal dtype (bf16 by default) while holding float8_e4m3fn data, a per-tensor scale (q = x * scale)
and a ``_quantizer`` with ``scale``, ``amax`` and ``amax_history``. Modes:

- ``"delayed"``: copy_ quantizes with the quantizer's current ``scale`` (not recomputed), then records the source's
  amax in the history (rolls it and writes row 0, as TE's cast + recipe bookkeeping would). ``update_scale()`` is the
  recipe step: scale = FP8_MAX / max(amax_history).
- ``"tensorwise"``: copy_ computes the scale from the source's own amax at copy_ time (current scaling); no history.

Ops: ``dequantize``, ``copy_`` (quantizes into this tensor), ``view`` and ``detach`` (stay quantized, share data and
quantizer, no dequantize); any other op dequantizes its quantized arguments and runs on plain tensors (in-place ops
quantize the result back). ``FakeQuantizedTensor.dequantize_calls`` counts every dequantize of any instance, so a
test can assert that a code path does not dequantize.
"""
import torch
from torch.utils._pytree import tree_map

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448

aten = torch.ops.aten


class FakeQuantizer:
    """Per-tensor quantizer state (shared by views of a tensor, like TE's quantizer)."""

    def __init__(self, mode: str, history_len: int = 4, device="cpu"):
        if mode not in ("delayed", "tensorwise"):
            raise ValueError(f"unknown mode {mode!r}")
        self.mode = mode
        self.scale = torch.ones(1, dtype=torch.float32, device=device)
        self.amax_history = torch.zeros(history_len, dtype=torch.float32, device=device)
        # TE keeps the quantizer's amax as a view into the recipe's amax history row; same here.
        self.amax = self.amax_history[0:1]

    def update_scale(self):
        """The delayed-scaling recipe step: scale from the amax history."""
        amax = float(self.amax_history.max())
        self.scale.fill_(FP8_MAX / amax if amax > 0 else 1.0)


class FakeQuantizedTensor(torch.Tensor):
    __mcore_quantized_tensor__ = True
    dequantize_calls = 0  # class-wide counter, reset by tests
    view_keeps_ndim_only = False  # True in a subclass: view cannot add/remove axes (like TE's blockwise tensor)
    quantize_calls = 0

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, quantizer: FakeQuantizer, dtype=torch.bfloat16):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=dtype, device=data.device, requires_grad=False
        )

    def __init__(self, data, scale_inv, quantizer, dtype=torch.bfloat16):
        assert data.dtype == FP8_DTYPE
        self._data = data
        self._scale_inv = scale_inv  # 1-element float32: x ~= q * scale_inv
        self._quantizer = quantizer

    # ---- protocol ------------------------------------------------------------------------------------------
    @property
    def quantization_kind(self) -> str:
        return self._quantizer.mode

    @property
    def scale_inv(self) -> float:
        return float(self._scale_inv)

    def dequantize(self, dtype=None) -> torch.Tensor:
        FakeQuantizedTensor.dequantize_calls += 1
        return (self._data.to(torch.float32) * self._scale_inv).to(dtype or self.dtype)

    def _quantize_from(self, src: torch.Tensor) -> None:
        """Quantize ``src`` (plain) into this tensor's data, the way the mode says."""
        FakeQuantizedTensor.quantize_calls += 1
        q = self._quantizer
        src = src.detach().to(device=self._data.device, dtype=torch.float32).reshape(self._data.shape)
        amax = src.abs().max() if src.numel() else torch.zeros((), device=src.device)
        if q.mode == "tensorwise":
            scale = FP8_MAX / amax if float(amax) > 0 else torch.ones((), device=src.device)
            scale = scale.reshape(1).to(torch.float32)
        else:
            scale = q.scale.clone()
        self._data.copy_((src * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
        self._scale_inv.copy_(1.0 / scale)
        if q.mode == "delayed":  # record the amax like TE's cast does (history roll + row 0)
            q.amax_history.copy_(torch.roll(q.amax_history, 1))
            q.amax_history[0] = amax
        else:
            q.scale.copy_(scale)

    @classmethod
    def quantize(cls, src: torch.Tensor, mode: str, dtype=torch.bfloat16, history_len: int = 4):
        """A new quantized tensor holding ``src`` (delayed: scale first set from the source's amax, like a warmed-up
        recipe, then history holds that amax)."""
        q = FakeQuantizer(mode, history_len, device=src.device)
        if mode == "delayed":
            amax = float(src.detach().abs().max()) if src.numel() else 0.0
            q.amax_history.fill_(amax)
            q.update_scale()
        out = cls(
            torch.empty(src.shape, dtype=FP8_DTYPE, device=src.device),
            torch.ones(1, dtype=torch.float32, device=src.device),
            q,
            dtype=dtype,
        )
        out._quantize_from(src)
        return out

    def __repr__(self):
        return (
            f"FakeQuantizedTensor(mode={self._quantizer.mode}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"scale_inv={self.scale_inv:.4g})"
        )

    # ---- dispatch --------------------------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.detach.default:
            t = args[0]
            return cls(t._data, t._scale_inv, t._quantizer, dtype=t.dtype)
        if func is aten.view.default:
            t, shape = args[0], args[1]
            if cls.view_keeps_ndim_only and len(shape) != t.dim():
                raise NotImplementedError("Changing shape with view not implemented")  # like TE's blockwise
            return cls(t._data.view(shape), t._scale_inv, t._quantizer, dtype=t.dtype)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, cls):
                if isinstance(src, cls):  # quantized -> quantized: copy the encoding
                    dst._data.copy_(src._data.view(dst._data.shape))
                    dst._scale_inv.copy_(src._scale_inv)
                else:
                    dst._quantize_from(src)
                return dst
            return dst.copy_(src.dequantize(dtype=dst.dtype) if isinstance(src, cls) else src)

        # Anything else: dequantize quantized args and run on plain tensors.
        def unwrap(x):
            return x.dequantize() if isinstance(x, cls) else x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if func._schema.is_mutable and args and isinstance(args[0], cls):
            args[0]._quantize_from(out if isinstance(out, torch.Tensor) else args[0].dequantize())
            return args[0]
        return out


def quantized_like(src: torch.Tensor, mode: str, **kw) -> FakeQuantizedTensor:
    return FakeQuantizedTensor.quantize(src, mode, dtype=src.dtype if src.is_floating_point() else torch.bfloat16, **kw)
