"""Grouped matmul of row groups: ``grouped_gemm(x, weights, m_splits)`` is ``cat([x_i @ weights[i].T])`` for the
row groups ``x_i`` of sizes ``m_splits``, in one call of torch's grouped matmul (``torch._grouped_mm``) where this
torch has it and the inputs suit it (:func:`use_torch_grouped_mm`), else one ``F.linear`` per group (the same math).
Used by the experts of ``--moe-grouped-gemm``: the local layers of ``megatron.core.transformer.moe.grouped_gemm_util``
and, for unquantized bf16 on Hopper, Transformer Engine's ``GroupedLinear``
(``megatron.core.tensor_parallel.te_layers``). The group sizes reach the device without a host sync."""
import itertools
from typing import Sequence

import torch
import torch.nn.functional as F


def use_torch_grouped_mm(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`grouped_gemm` runs ``torch._grouped_mm`` here: this torch has it, a 2-D input with rows, row
    strides a multiple of 16 bytes; on CPU fp32/bf16; on CUDA bf16 on Hopper only (elsewhere torch falls back to a
    loop that reads the group offsets on the host, a sync; Blackwell is left out until tested there: torch's issue
    172439 reports garbage weight gradients for empty groups on B200). Else :func:`grouped_gemm` loops over
    ``F.linear`` (which also keeps an empty input's gradient dense)."""
    if not hasattr(torch, "_grouped_mm") or x.dim() != 2 or x.shape[0] == 0 or not weights:
        return False
    if any(w.dtype != x.dtype for w in weights):
        return False
    if x.is_cuda:
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] != 9:
            return False
    elif x.dtype not in (torch.float32, torch.bfloat16):
        return False
    out_f, in_f = weights[0].shape
    size = x.element_size()
    return (in_f * size) % 16 == 0 and (out_f * size) % 16 == 0


def host_ints_to_device(values: Sequence[int], device: torch.device, dtype=torch.int64) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without stalling the host: on CUDA through pinned memory
    and a non-blocking copy (a pageable copy synchronises the stream, which drains the queue of kernels the host
    had launched ahead: twice per MoE layer on the grouped path, 16 of 49 synchronisations per step of the H200
    benchmark). The caching host allocator keeps the pinned block until the copy has run."""
    values = [int(v) for v in values]
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    if torch.cuda.is_current_stream_capturing():
        return _ints_by_kernels(values, device, dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _ints_by_kernels(values: Sequence[int], device, dtype) -> torch.Tensor:
    """``values`` made on the device by kernels only, for a CUDA graph capture (``--cuda-graph-modules moe``): a
    captured copy from pinned host memory would read that host block again at every replay, after the caching host
    allocator has handed it to someone else. Equal values or an arithmetic progression (drop-and-pad experts' row
    counts and their offsets) are one ``full`` / ``arange`` kernel, anything else one ``fill_`` per value."""
    n = len(values)
    if n == 0:
        return torch.empty(0, dtype=dtype, device=device)
    step = values[1] - values[0] if n > 1 else 0
    if all(b - a == step for a, b in zip(values, values[1:])):
        if step == 0:
            return torch.full((n,), values[0], dtype=dtype, device=device)
        return torch.arange(values[0], values[0] + step * n, step, dtype=dtype, device=device)
    out = torch.empty(n, dtype=dtype, device=device)
    for i, v in enumerate(values):
        out[i].fill_(v)
    return out


class _GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm(x, stack(weights)^T, offs)`` that keeps the weights themselves for backward (references)
    rather than their stacked copy (a second copy of every local expert's weight per layer until backward); the
    backward stacks them again. Gradients as torch's own formula for ``_grouped_mm``."""

    @staticmethod
    def forward(ctx, x, offs, *weights):
        ctx.save_for_backward(x, offs, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, offs, *weights = ctx.saved_tensors
        grad = grad.contiguous()  # an expanded gradient (zero strides) is not a valid operand
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad, torch.stack(weights), offs=offs)  # [M, out] x [n, out, in]
        grad_w = [None] * len(weights)
        if any(ctx.needs_input_grad[2:]):
            grad_w = list(torch._grouped_mm(grad.t(), x, offs=offs).unbind(0))  # [n, out, in]: dy_g^T x_g
        return (grad_x, None, *grad_w)


def grouped_gemm(x: torch.Tensor, weights: Sequence[torch.Tensor], m_splits: Sequence[int]) -> torch.Tensor:
    """``cat([x_i @ weights[i].T])`` for the row groups ``x_i`` of sizes ``m_splits`` (see the module docstring)."""
    m_splits = [int(m) for m in m_splits]
    if len(m_splits) != len(weights) or sum(m_splits) != x.shape[0]:
        raise ValueError(f"grouped_gemm: m_splits {m_splits} does not match {len(weights)} weights and "
                         f"{x.shape[0]} rows")
    if use_torch_grouped_mm(x, weights):
        offs = host_ints_to_device(itertools.accumulate(m_splits), x.device, torch.int32)
        return _GroupedMM.apply(x.contiguous(), offs, *weights)
    pieces = [F.linear(xi, w) for xi, w in zip(torch.split(x, m_splits, dim=0), weights)]
    return torch.cat(pieces, dim=0) if pieces else x.new_zeros(0, weights[0].shape[0] if weights else 0)


def add_grouped_bias(out: torch.Tensor, biases: Sequence[torch.Tensor], m_splits: Sequence[int]) -> torch.Tensor:
    """``out`` with ``biases[i]`` added to row group ``i``."""
    counts = host_ints_to_device([int(m) for m in m_splits], out.device)
    return out + torch.repeat_interleave(torch.stack(list(biases)), counts, dim=0, output_size=out.shape[0])
