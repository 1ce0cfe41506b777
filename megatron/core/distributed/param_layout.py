"""Upstream's layout of the distributed optimizer's buffers, which its ``dp_reshardable`` checkpoints are keyed by.

Upstream's DistributedDataParallel puts the trainable parameters (in module order) into buffers, one per
(param dtype, grad dtype, expert-parallel) in order of first appearance: the param dtype is ``uint8`` for a quantized
weight, the grad dtype fp32 with ``--accumulate-allreduce-grads-in-fp32`` (``grad_reduce_in_fp32``) else the param's.
In a buffer the parameters are placed in reverse order, each starting at a multiple of 64 elements, and cut into
buckets: a bucket ends after the parameter that brings it to ``bucket_size`` elements (no size limit without
``--overlap-grad-reduce`` or past the first pipeline stage), and under pipeline parallelism a tied embedding copy
(``shared_embedding``; upstream sets it only then) gets a bucket of its own. A bucket's unpadded size runs to its
last parameter's end; its padded size is a multiple of lcm(DP, 128) (with ``pad_buckets_for_high_nccl_busbw`` also
of 2**16), and the next bucket starts there.

``dp_reshardable`` stores, per bucket and state key, the bucket's unpadded elements as one 1-D tensor (each DP rank
writes the part of its contiguous 1/DP range, padding between parameters included); a parameter's state is
``[start, end)`` of its bucket."""
import dataclasses
import itertools
import math
from typing import List, Optional, Tuple

import torch

PARAM_START_ALIGNMENT = 64
BUCKET_END_ALIGNMENT = 128
HIGH_NCCL_BUSBW_ALIGNMENT = 2**16


@dataclasses.dataclass
class BucketLayout:
    """``params``: (parameter, start, end) within the bucket, in increasing order; ``numel_unpadded`` the end of the
    last; ``numel`` padded to the DP multiple."""

    params: List[Tuple[torch.nn.Parameter, int, int]]
    numel_unpadded: int
    numel: int


@dataclasses.dataclass
class BufferLayout:
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    expert: bool
    buckets: List[BucketLayout]

    @property
    def dtype_key(self) -> Tuple[torch.dtype, torch.dtype]:
        """Upstream's key of the buffer's buckets (in checkpoint keys as ``dtype_<str of it>``)."""
        return (self.param_dtype, self.grad_dtype)


def _round_up(value: int, divisor: int) -> int:
    return int(math.ceil(value / divisor) * divisor)


def bucket_end_alignment(dp_size: int, pad_for_high_nccl_busbw: bool = False) -> int:
    if pad_for_high_nccl_busbw:
        return math.lcm(dp_size, BUCKET_END_ALIGNMENT, HIGH_NCCL_BUSBW_ALIGNMENT)
    return math.lcm(dp_size, BUCKET_END_ALIGNMENT)


ATTENTION_MODULES = ("self_attention", "cross_attention")


def upstream_module_order(named_params: List[Tuple[str, torch.nn.Parameter]]) -> List[torch.nn.Parameter]:
    """The parameters in the order upstream's modules register them (its DDP's ``named_parameters()`` order):
    this fork's attention registers ``linear_proj`` after ``linear_qkv`` (and the q/k norms), upstream's before
    them; everything else is in the same order. Each attention module's run of parameters is reordered alone."""
    runs = itertools.groupby(named_params, key=lambda item: _attention_prefix(item[0]))
    out = []
    for prefix, run in runs:
        run = list(run)
        if prefix is not None:
            run.sort(key=lambda item: item[0].split(".")[prefix.count(".") + 1] != "linear_proj")  # stable
        out += [p for _, p in run]
    return out


def _attention_prefix(name: str) -> Optional[str]:
    """``decoder.layers.0.self_attention`` for a parameter inside that attention module, else None."""
    parts = name.split(".")
    hit = next((i for i, part in enumerate(parts[:-1]) if part in ATTENTION_MODULES), None)
    return None if hit is None else ".".join(parts[: hit + 1])


def buffer_layouts(params: List[torch.nn.Parameter], dp_size: int, expert_dp_size: int, is_quantized,
                   is_expert=lambda p: not getattr(p, "allreduce", True), grad_reduce_in_fp32: bool = False,
                   bucket_size: Optional[int] = None, pad_for_high_nccl_busbw: bool = False,
                   pipelined: bool = False) -> List[BufferLayout]:
    """Upstream's buffers of ``params`` (trainable, in module order); ``is_quantized(p)``: stored as bytes;
    ``is_expert(p)``: in an expert buffer (over the expert-DP group); ``pipelined``: pipeline parallel size > 1
    (tied embedding copies get buckets of their own)."""
    groups = {}
    for p in params:
        grad_dtype = torch.float32 if grad_reduce_in_fp32 else p.dtype
        key = (torch.uint8 if is_quantized(p) else p.dtype, grad_dtype, is_expert(p))
        groups.setdefault(key, []).append(p)
    return [BufferLayout(pd, gd, expert, _buckets(ps, expert_dp_size if expert else dp_size, bucket_size,
                                                  pad_for_high_nccl_busbw, pipelined))
            for (pd, gd, expert), ps in groups.items()]


def _buckets(params, dp_size: int, bucket_size: Optional[int], pad_for_high_nccl_busbw: bool,
             pipelined: bool) -> List[BucketLayout]:
    """The buckets of one buffer (see the module docstring); offsets relative to each bucket's start."""
    alignment = bucket_end_alignment(dp_size, pad_for_high_nccl_busbw)
    buckets, current, bucket_start, next_start = [], [], 0, 0

    def close(end: int) -> int:
        buckets.append(BucketLayout([(p, s - bucket_start, e - bucket_start) for p, s, e in current],
                                    end - bucket_start, _round_up(end, alignment) - bucket_start))
        current.clear()
        return _round_up(end, alignment)

    for p in reversed(params):
        start = _round_up(next_start, PARAM_START_ALIGNMENT)
        own_bucket = pipelined and getattr(p, "shared_embedding", False)
        if own_bucket and current:
            bucket_start = start = close(start)
        end = start + p.numel()
        current.append((p, start, end))
        if own_bucket or (bucket_size is not None and end - bucket_start >= bucket_size):
            bucket_start = next_start = close(end)
        else:
            next_start = end
    if current:
        close(current[-1][2])
    return buckets


@dataclasses.dataclass
class FullParamLayout:
    """Upstream's ``FullParamLayout`` (``DistributedOptimizer.compute_full_param_layout``): ``layouts`` maps each
    buffer's key ``(param dtype, grad dtype, is expert-parallel)`` to its :class:`BufferLayout`."""
    layouts: dict
