"""Fused SwiGLU (``--bias-swiglu-fusion``, upstream's default; config ``bias_activation_fusion``).

``swiglu(x) = silu(x1) * x2`` for the halves ``x = [x1, x2]`` of the last axis (the convention of
``megatron.core.transformer.mlp.apply_activation`` and of Transformer Engine's ``swiglu``: the gate is the first
half). :class:`SwiGLUFunction` saves only its input ``x``: the unfused chain (chunk, silu, mul) keeps ``x`` (through
the chunk views) and ``silu(x1)`` as well, and its backward runs several elementwise kernels plus a cat.

Kernels: on CUDA with Transformer Engine, TE's ``transformer_engine_torch.swiglu(input, quantizer=None)`` (output
``[..., d/2]`` in the input's dtype) and ``dswiglu(grad_output, input, quantizer=None)`` (``[..., d]``), both
computing in fp32 internally; otherwise torch ops that compute in fp32 and round once to the input's dtype.
"""
import torch
import torch.nn.functional as F


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for the half-precision dtypes (fp64 stays fp64)."""
    return torch.promote_types(x.dtype, torch.float32)


def swiglu_torch(x: torch.Tensor) -> torch.Tensor:
    """``silu(x1) * x2`` computed in fp32 (at least), rounded once to ``x.dtype``."""
    x1, x2 = torch.chunk(x.to(_compute_dtype(x)), 2, dim=-1)
    return (F.silu(x1) * x2).to(x.dtype)


def swiglu_back_torch(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`swiglu_torch` w.r.t. ``x`` (``[..., d]``, ``x.dtype``) for the output gradient ``g``,
    from ``x`` alone (fp32 math at least): ``d/dx1 = g * x2 * s * (1 + x1 * (1 - s))`` with ``s = sigmoid(x1)``,
    and ``d/dx2 = g * x1 * s``."""
    x1, x2 = torch.chunk(x.to(_compute_dtype(x)), 2, dim=-1)
    g = g.to(x1.dtype)
    s = torch.sigmoid(x1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    half = x.shape[-1] // 2
    out[..., :half] = g * x2 * s * (1 + x1 * (1 - s))
    out[..., half:] = g * x1 * s
    return out


def _te_kernels(x: torch.Tensor):
    """TE's ``(swiglu, dswiglu)`` when they can run on ``x`` (TE installed, CUDA, a TE dtype, non-empty), else
    None."""
    from megatron.core.extensions.transformer_engine import te_dswiglu, te_swiglu

    if (te_swiglu is None or te_dswiglu is None or not x.is_cuda or x.numel() == 0
            or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        return None
    return te_swiglu, te_dswiglu


class SwiGLUFunction(torch.autograd.Function):
    """``swiglu(x)`` saving only ``x``; the backward recomputes what it needs from ``x``. ``use_te`` picks TE's
    kernels (where they can run; see :func:`_te_kernels`) or the torch ops."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, use_te: bool = True):
        if x.shape[-1] % 2:
            raise ValueError(f"swiglu: the last axis ({x.shape[-1]}) must be even (the halves [x1, x2])")
        kernels = _te_kernels(x) if use_te else None
        ctx.use_te = kernels is not None
        ctx.save_for_backward(x)
        if kernels is None:
            return swiglu_torch(x)
        x = x.contiguous()
        return kernels[0](x.view(-1, x.shape[-1]), None).view(*x.shape[:-1], x.shape[-1] // 2)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (x,) = ctx.saved_tensors
        if not ctx.use_te:
            return swiglu_back_torch(grad_output, x), None
        _, dswiglu = _te_kernels(x)
        x = x.contiguous()
        g = grad_output.to(x.dtype).contiguous()
        dx = dswiglu(g.view(-1, g.shape[-1]), x.view(-1, x.shape[-1]), None)
        return dx.view(x.shape), None


def swiglu_impl(x: torch.Tensor, use_te: bool = True) -> torch.Tensor:
    """Fused ``silu(x1) * x2`` for ``x = [x1, x2]`` (last axis): ``[..., d]`` -> ``[..., d/2]``."""
    return SwiGLUFunction.apply(x, use_te)


def use_fused_swiglu(config) -> bool:
    """``config.bias_activation_fusion`` (``--bias-swiglu-fusion``) for a SwiGLU MLP: ``gated_linear_unit`` with
    ``activation_func`` silu. Any other activation keeps the plain torch ops."""
    return bool(getattr(config, "bias_activation_fusion", False) and config.gated_linear_unit
                and config.activation_func in (F.silu, torch.nn.functional.silu))
