"""A small pure-torch quantized tensor for tests: behaves like Transformer Engine's Float8Tensor where the checkpoint
code cares (dequantize, copy_ quantizes, view stays quantized, detach), so the quantized-load logic runs in CI.

``FakeQuantizedTensor`` is a wrapper subclass (``_make_wrapper_subclass`` + ``__torch_dispatch__``) presenting a
high-precision nominal dtype (bf16 by default) while holding float8_e4m3fn data, a per-tensor scale (q = x * scale)
and a ``_quantizer`` with ``scale``, ``amax`` and ``amax_history``. Modes:

- ``"delayed"``: copy_ quantizes with the quantizer's current ``scale`` (not recomputed), then records the source's
  amax in the history (rolls it and writes row 0, as TE's cast + recipe bookkeeping would). ``update_scale()`` is the
  recipe step: scale = FP8_MAX / max(amax_history).
- ``"tensorwise"``: copy_ computes the scale from the source's own amax at copy_ time (current scaling); no history.
- ``"mxfp8"``: 1x32 blocks along the last axis (rowwise ``_scale_inv`` [rows, ceil(cols/32)], powers of two) plus
  columnwise data quantized in 32x1 blocks (``_columnwise_data`` [rows, cols], ``_columnwise_scale_inv``
  [ceil(rows/32), cols]), like TE's MXFP8Tensor.
- ``"blockwise"``: 128x128 blocks (``_scale_inv`` [ceil(rows/128), ceil(cols/128)], scale = FP8_MAX / block amax)
  plus the transposed columnwise copy (``_columnwise_data`` [cols, rows], ``_columnwise_scale_inv`` its blocks),
  like TE's Float8BlockwiseQTensor with 2-D scaling.
Per-tensor modes may carry a ``_transpose`` cache ([cols, rows] FP8, ``with_transpose=True``), like TE's
Float8Tensor.

The chunked streaming protocol (``megatron.core.fp8_utils.quantize_rows_into``): ``chunk_row_multiple`` (1, 32,
128) and ``quantize_rows_(row_start, src2d, padded)``, which encodes only the given rows into the tensor's buffers,
refusing a range not aligned to the blocks (tensorwise: ``src2d`` carries one extra row, which the adapter filled with
the whole tensor's amax, and the scale is computed from max |src2d|, as TE's current scaling computes it from its
input: a missing or wrong amax row gives another scale);
``finish_rows_quantize_()`` recomputes the transpose cache. So chunked == whole-tensor quantize can be checked
bit for bit on CPU.

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
MODES = ("delayed", "tensorwise", "mxfp8", "blockwise")
PER_TENSOR = ("delayed", "tensorwise")
BLOCK = {"mxfp8": 32, "blockwise": 128}


def _pad_to(x: torch.Tensor, dim: int, mult: int) -> torch.Tensor:
    extra = (-x.shape[dim]) % mult
    if not extra:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim)


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _mx_scale_inv(amax: torch.Tensor) -> torch.Tensor:
    """A power of two >= amax / FP8_MAX per block (E8M0-like); 1 for an all-zero block."""
    out = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    return torch.where(amax > 0, out, torch.ones_like(out))


def _block_scale(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))


def encode_mxfp8(x: torch.Tensor):
    """float32 [r, c] -> (data, scale_inv [r, ceil(c/32)], col_data, col_scale_inv [ceil(r/32), c])."""
    r, c = x.shape
    xr = _pad_to(x, 1, 32).reshape(r, -1, 32)
    s_inv = _mx_scale_inv(xr.abs().amax(-1))
    data = _to_fp8(xr / s_inv.unsqueeze(-1)).reshape(r, -1)[:, :c]
    xc = _pad_to(x, 0, 32).reshape(-1, 32, c)
    cs_inv = _mx_scale_inv(xc.abs().amax(1))
    col = _to_fp8(xc / cs_inv.unsqueeze(1)).reshape(-1, c)[:r]
    return data, s_inv, col, cs_inv


def encode_blockwise(x: torch.Tensor):
    """float32 [r, c] -> (data, scale_inv [ceil(r/128), ceil(c/128)], col_data [c, r], col_scale_inv)."""
    r, c = x.shape
    xp = _pad_to(_pad_to(x, 0, 128), 1, 128)
    br, bc = xp.shape[0] // 128, xp.shape[1] // 128
    blocks = xp.reshape(br, 128, bc, 128)
    scale = _block_scale(blocks.abs().amax(dim=(1, 3)))
    q = _to_fp8(blocks * scale[:, None, :, None]).reshape(xp.shape)[:r, :c]
    s_inv = 1.0 / scale
    return q, s_inv, q.t().contiguous(), s_inv.t().contiguous()


class FakeQuantizer:
    """Per-tensor quantizer state (shared by views of a tensor, like TE's quantizer)."""

    def __init__(self, mode: str, history_len: int = 4, device="cpu"):
        if mode not in MODES:
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
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, quantizer: FakeQuantizer, dtype=torch.bfloat16,
                extra=None):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=dtype, device=data.device, requires_grad=False
        )

    def __init__(self, data, scale_inv, quantizer, dtype=torch.bfloat16, extra=None):
        assert data.dtype == FP8_DTYPE
        self._data = data
        self._scale_inv = scale_inv  # per-tensor: 1-element float32, x ~= q * scale_inv; block modes: per block
        self._quantizer = quantizer
        # block modes: _columnwise_data / _columnwise_scale_inv; per-tensor: optional _transpose (None if absent)
        self._extra = dict(extra or {})
        self._transpose = self._extra.get("_transpose")
        self._columnwise_data = self._extra.get("_columnwise_data")
        self._columnwise_scale_inv = self._extra.get("_columnwise_scale_inv")

    @property
    def chunk_row_multiple(self) -> int:
        return BLOCK.get(self._quantizer.mode, 1)

    def _rows_cols(self):
        c = self._data.shape[-1] if self._data.dim() else 1
        return (self._data.numel() // c if c else 0), c

    # ---- protocol ------------------------------------------------------------------------------------------
    @property
    def quantization_kind(self) -> str:
        return self._quantizer.mode

    @property
    def scale_inv(self) -> float:
        return float(self._scale_inv) if self._scale_inv.numel() == 1 else float(self._scale_inv.max())

    def dequantize(self, dtype=None) -> torch.Tensor:
        FakeQuantizedTensor.dequantize_calls += 1
        mode = self._quantizer.mode
        if mode in PER_TENSOR:
            return (self._data.to(torch.float32) * self._scale_inv).to(dtype or self.dtype)
        r, c = self._rows_cols()
        g = BLOCK[mode]
        q = self._data.reshape(r, c).to(torch.float32)
        if mode == "mxfp8":
            s_inv = self._scale_inv.repeat_interleave(g, 1)[:, :c]
        else:
            s_inv = self._scale_inv.repeat_interleave(g, 0).repeat_interleave(g, 1)[:r, :c]
        return (q * s_inv).reshape(self.shape).to(dtype or self.dtype)

    def _write_rows(self, r0: int, x: torch.Tensor, scale=None, transpose: bool = True) -> None:
        """Encode float32 rows ``x`` ([n, cols]) into rows [r0, r0 + n) of every buffer (per-tensor: with ``scale``;
        ``transpose=False``: not the transpose cache, which ``finish_rows_quantize_`` rebuilds, as TE's chunked
        path)."""
        mode = self._quantizer.mode
        n, c = x.shape
        r, _ = self._rows_cols()
        if mode in PER_TENSOR:
            q = _to_fp8(x * scale)
            self._data.view(r, c)[r0:r0 + n].copy_(q)
            self._scale_inv.copy_(1.0 / scale)
            if self._transpose is not None and transpose:
                self._transpose.view(c, r)[:, r0:r0 + n].copy_(q.t())
            return
        g = BLOCK[mode]
        if r0 % g or (r0 + n != r and n % g):
            raise ValueError(f"{mode}: rows [{r0}, {r0 + n}) are not aligned to its {g}-row blocks")
        k = -(-n // g)
        if mode == "mxfp8":
            data, s_inv, col, cs_inv = encode_mxfp8(x)
            self._data.view(r, c)[r0:r0 + n].copy_(data)
            self._scale_inv[r0:r0 + n].copy_(s_inv)
            self._columnwise_data.view(r, c)[r0:r0 + n].copy_(col)
            self._columnwise_scale_inv[r0 // g:r0 // g + k].copy_(cs_inv)
        else:
            data, s_inv, col, cs_inv = encode_blockwise(x)
            self._data.view(r, c)[r0:r0 + n].copy_(data)
            self._scale_inv[r0 // g:r0 // g + k].copy_(s_inv)
            self._columnwise_data[:, r0:r0 + n].copy_(col)
            self._columnwise_scale_inv[:, r0 // g:r0 // g + k].copy_(cs_inv)

    rows_quantize_calls = 0
    last_rows_source = None
    parks_rows_in_own_bytes = True  # quantize_rows_ leaves the transpose alone; finish_rows_quantize_ rebuilds it

    def quantize_rows_(self, row_start: int, src2d: torch.Tensor, padded: bool = False) -> None:
        """The chunked protocol: quantize ``src2d`` into rows [row_start, row_start + n) only. Tensorwise (current
        scaling, like TE's quantizer): ``src2d`` is padded, n + 1 rows, and the scale comes from max |src2d| over all
        of them (the adapter puts the whole tensor's amax in the last row); only the first n rows are written."""
        FakeQuantizedTensor.rows_quantize_calls += 1
        FakeQuantizedTensor.last_rows_source = src2d  # tests check that a padded scratch is used in place
        q = self._quantizer
        if padded != (q.mode == "tensorwise"):
            raise ValueError(f"{q.mode}: quantize_rows_ got padded={padded} (only tensorwise takes the amax row)")
        x = src2d.detach().to(device=self._data.device, dtype=torch.float32)
        scale = None
        if q.mode == "tensorwise":
            amax = x.abs().max()
            scale = (FP8_MAX / amax if float(amax) > 0 else torch.ones(())).reshape(1).to(torch.float32)
            q.scale.copy_(scale)
            x = x[:-1]
        elif q.mode == "delayed":
            scale = q.scale.clone()
        self._write_rows(row_start, x, scale, transpose=False)

    def quantize_master_shard_(self, offset: int, master, amax: torch.Tensor) -> None:
        """The distributed optimizer's protocol (per-tensor modes): encode ``master`` (flat float32, or None) into
        flat elements ``[offset, offset + numel)`` of the data; ``amax``: the whole tensor's, reduced over the ranks
        (tensorwise takes its scale from it, delayed records it, as TE's cast + recipe would). The transpose cache is
        rebuilt by ``finish_rows_quantize_`` once every rank's bytes are gathered."""
        q = self._quantizer
        if q.mode not in PER_TENSOR:
            raise NotImplementedError(f"{q.mode}: quantize_master_shard_ is implemented for per-tensor modes only")
        if q.mode == "tensorwise":
            scale = (FP8_MAX / amax if float(amax) > 0 else torch.ones(())).reshape(1).to(torch.float32)
            q.scale.copy_(scale)
        else:
            scale = q.scale.clone()
            q.amax_history.copy_(torch.roll(q.amax_history, 1))
            q.amax_history[0] = amax
        self._scale_inv.copy_(1.0 / scale)
        if master is not None and master.numel():
            flat = self._data.view(-1)
            flat[offset:offset + master.numel()].copy_(_to_fp8(master.detach().float().reshape(-1) * scale))

    def finish_rows_quantize_(self) -> None:
        """The transpose cache rebuilt from the data (as TE's ``_create_transpose`` in fp8_utils; an invalid one is
        left invalid, as fp8_utils leaves TE's)."""
        if self._transpose is not None and not getattr(self, "_transpose_invalid", False):
            r, c = self._rows_cols()
            self._transpose.copy_(self._data.view(r, c).t())

    def _quantize_from(self, src: torch.Tensor) -> None:
        """Quantize ``src`` (plain) into this tensor's data, the way the mode says."""
        FakeQuantizedTensor.quantize_calls += 1
        q = self._quantizer
        src = src.detach().to(device=self._data.device, dtype=torch.float32).reshape(self._data.shape)
        amax = src.abs().max() if src.numel() else torch.zeros((), device=src.device)
        if q.mode in BLOCK:
            self._write_rows(0, src.reshape(self._rows_cols()))
            return
        if q.mode == "tensorwise":
            scale = FP8_MAX / amax if float(amax) > 0 else torch.ones((), device=src.device)
            scale = scale.reshape(1).to(torch.float32)
        else:
            scale = q.scale.clone()
        self._write_rows(0, src.reshape(self._rows_cols()), scale)
        if q.mode == "delayed":  # record the amax like TE's cast does (history roll + row 0)
            q.amax_history.copy_(torch.roll(q.amax_history, 1))
            q.amax_history[0] = amax
        else:
            q.scale.copy_(scale)

    @classmethod
    def quantize(cls, src: torch.Tensor, mode: str, dtype=torch.bfloat16, history_len: int = 4,
                 with_transpose: bool = False):
        """A new quantized tensor holding ``src`` (delayed: scale first set from the source's amax, like a warmed-up
        recipe, then history holds that amax). ``with_transpose``: per-tensor modes keep a ``_transpose`` cache."""
        q = FakeQuantizer(mode, history_len, device=src.device)
        if mode == "delayed":
            amax = float(src.detach().abs().max()) if src.numel() else 0.0
            q.amax_history.fill_(amax)
            q.update_scale()
        dev = src.device
        c = src.shape[-1] if src.dim() else 1
        r = src.numel() // c if c else 0
        extra = {}
        if mode in PER_TENSOR:
            scale_inv = torch.ones(1, dtype=torch.float32, device=dev)
            if with_transpose:
                extra["_transpose"] = torch.empty(c, r, dtype=FP8_DTYPE, device=dev)
        elif mode == "mxfp8":
            scale_inv = torch.ones(r, -(-c // 32), dtype=torch.float32, device=dev)
            extra["_columnwise_data"] = torch.empty(src.shape, dtype=FP8_DTYPE, device=dev)
            extra["_columnwise_scale_inv"] = torch.ones(-(-r // 32), c, dtype=torch.float32, device=dev)
        else:
            scale_inv = torch.ones(-(-r // 128), -(-c // 128), dtype=torch.float32, device=dev)
            extra["_columnwise_data"] = torch.empty(c, r, dtype=FP8_DTYPE, device=dev)
            extra["_columnwise_scale_inv"] = torch.ones(-(-c // 128), -(-r // 128), dtype=torch.float32, device=dev)
        out = cls(torch.empty(src.shape, dtype=FP8_DTYPE, device=dev), scale_inv, q, dtype=dtype, extra=extra)
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
            return cls(t._data, t._scale_inv, t._quantizer, dtype=t.dtype, extra=t._extra)
        if func is aten.view.default:
            t, shape = args[0], args[1]
            if cls.view_keeps_ndim_only and len(shape) != t.dim():
                raise NotImplementedError("Changing shape with view not implemented")  # like TE's blockwise
            if t._quantizer.mode in BLOCK and tuple(shape)[-1:] != tuple(t.shape)[-1:]:
                raise RuntimeError("a block-scaled tensor cannot change its last axis by view")  # like TE's MXFP8
            extra = {k: v for k, v in t._extra.items() if k != "_transpose"}  # like TE: a view drops the transpose
            return cls(t._data.view(shape), t._scale_inv, t._quantizer, dtype=t.dtype, extra=extra)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, cls):
                if isinstance(src, cls):  # quantized -> quantized: copy the encoding
                    dst._data.copy_(src._data.view(dst._data.shape))
                    dst._scale_inv.copy_(src._scale_inv)
                    for k, v in dst._extra.items():
                        if k in src._extra:
                            v.copy_(src._extra[k])
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
