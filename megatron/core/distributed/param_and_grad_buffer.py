"""Buckets of gradients reduced, and of parameters gathered, asynchronously (``--overlap-grad-reduce``,
``--overlap-param-gather``).

``build_buckets`` cuts a model chunk's trainable parameters into upstream's buckets (``optimizer/param_layout.py``:
reverse module order, each parameter at a multiple of 64 elements, a bucket closed once it holds ``bucket_size``
elements, its end padded to a multiple of lcm(DP, 128)), one set per (param dtype, grad dtype, expert-parallel).
A bucket is a range of one flat index space: ``offsets[p]`` is where parameter ``p`` starts, ``numel`` (a multiple of
the group size) its padded size, and data-parallel rank ``r`` owns ``[r * shard_numel, (r + 1) * shard_numel)``.

No flat buffer lives between steps: a bucket's gradients are copied into a fresh flat tensor (in the reduce dtype)
when the bucket is launched, and

- ``all_reduce`` (DDP): the flat is all-reduced asynchronously; ``finish_grad_reduce`` waits, divides by the
  data-parallel size (or averages in the collective, ``average_in_collective``, where the backend can) and copies
  the result back into ``param.grad`` (``param.main_grad`` when it is reduced in fp32 for a bf16/fp16 gradient);
- ``reduce_scatter`` (distributed optimizer): the flat is reduce-scattered asynchronously; each parameter's
  ``main_grad`` becomes its view of the flat (its ``grad`` is dropped), and ``finish_grad_reduce`` writes this rank's
  reduced and divided shard into the flat, so the owned ranges of ``main_grad`` hold the data-parallel mean (the
  other ranges keep the local gradient, as in upstream's grad buffer). What ``finalize_model_grads`` sums later
  (sequence-parallel norms over TP, tied embeddings over PP) is summed in place on those views: sums commute, so
  the owned ranges end up as the non-overlapped order gives them.

Parameter gather: the distributed optimizer hands a bucket this rank's updated shard and a function that writes the
gathered flat into the parameters (``set_param_shard``); ``start_param_gather`` all-gathers it asynchronously and
``finish_param_gather`` waits and writes.

Expert parameters (``allreduce=False``) are reduced over the expert-data-parallel group and divided by the
data-parallel size, as ``DistributedDataParallel.finish_grad_sync`` does without overlap.
"""
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core.dist_utils import foreach_copy as _foreach_copy, get_rank, get_world_size


def check_reduced_grads(buckets) -> None:
    """RuntimeError if a bucket's reduced gradient has a NaN/Inf (``--check-for-nan-in-grad``): the buckets' device
    flags read on the host once (not once per bucket)."""
    flagged = [b for b in buckets if getattr(b, "nonfinite", None) is not None]
    if flagged and bool(torch.stack([b.nonfinite for b in flagged]).any()):
        bad = next(b for b in flagged if bool(b.nonfinite))
        raise RuntimeError(bad.nan_message())


def settle_main_grad(param: torch.nn.Parameter, view: torch.Tensor) -> None:
    """``view`` (a persistent fp32 ``main_grad``) made ``param.main_grad`` holding this step's gradient: a
    ``param.grad`` added in (copied at the step's first accumulation, when ``main_grad`` is not ``view``: the
    accumulate hook of DistributedDataParallel, or a gradient set by hand) and freed; with no gradient this step,
    zeros (a collective reads it). No autograd context needed: neither tensor requires grad (a hook runs per
    parameter per micro-batch, so this stays short)."""
    grad = param.grad
    if getattr(param, "main_grad", None) is view:
        if grad is not None:
            view.add_(grad)
            param.grad = None
        return
    if grad is not None:
        view.copy_(grad)
        param.grad = None
    else:
        view.zero_()
    param.main_grad = view


def _reduce_scatter_async(out: torch.Tensor, flat: torch.Tensor, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, flat, group=group, async_op=True)


def _all_gather_async(out: torch.Tensor, shard: torch.Tensor, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, shard, group=group, async_op=True)


def _can_average(group) -> bool:
    """Whether the backend of ``group`` has ``ReduceOp.AVG`` (NCCL); gloo sums and the result is divided."""
    return "nccl" in str(dist.get_backend(group)).lower()


class Bucket:
    """One bucket (see the module docstring). ``index``: its position in the chunk's bucket list (the order in which
    gradient collectives are issued on every rank); ``dp_size``: the data-parallel size every gradient is divided
    by; ``reduce_scatter``: distributed optimizer (else all-reduce)."""

    def __init__(self, index: int, params_ranges, numel: int, group, expert: bool, quantized: bool,
                 reduce_dtype: torch.dtype, dp_size: int, reduce_scatter: bool, average_in_collective: bool = False,
                 check_for_nan: bool = False, names: Optional[Dict] = None):
        self.index = index
        self.params: List[torch.nn.Parameter] = [p for p, _, _ in params_ranges]
        self.offsets: Dict[torch.nn.Parameter, int] = {p: start for p, start, _ in params_ranges}
        self.group = group
        self.size = get_world_size(group)
        self.rank = get_rank(group)
        if numel % self.size:
            raise ValueError(f"Bucket {index}: {numel} elements do not split over {self.size} data-parallel ranks")
        self.numel = numel
        self.shard_numel = numel // self.size
        self.expert = expert
        self.quantized = quantized
        self.reduce_dtype = reduce_dtype
        self.dp_size = dp_size
        self.reduce_scatter = reduce_scatter
        self.average = average_in_collective and _can_average(group)
        self.check_for_nan = check_for_nan
        self.names = names or {}
        self.device = self.params[0].device
        # fp32 accumulation (DistributedDataParallel._setup_main_grads): the persistent flat gradient and the
        # ``main_grad`` views of its bf16 / fp16 parameters
        self.grad_data: Optional[torch.Tensor] = None
        self.views: Dict[torch.nn.Parameter, torch.Tensor] = {}
        self.reset()
        self._gather: Optional[tuple] = None  # (shard, write_back) handed over by the optimizer
        self._gather_work = None
        self._gathered: Optional[torch.Tensor] = None

    # ---- gradients -------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget this step's gradient state (``zero_grad_buffer``)."""
        self.ready: Dict[torch.nn.Parameter, int] = {}
        self.flat: Optional[torch.Tensor] = None
        self._shard: Optional[torch.Tensor] = None
        self._work = None
        self.launched = False
        self.finished = False
        self.nonfinite: Optional[torch.Tensor] = None

    def launch_grad_reduce(self) -> None:
        """Copy the gradients into a fresh flat tensor and start its reduction (asynchronous)."""
        if self.launched:
            return
        persistent = self.grad_data is not None
        flat = self.grad_data if persistent else torch.zeros(self.numel, dtype=self.reduce_dtype, device=self.device)
        dst, src = [], []
        for p in self.params:
            o = self.offsets[p]
            view = self.views.get(p)
            if view is not None:  # accumulated in place
                settle_main_grad(p, view)
                continue
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                dst.append(flat[o : o + p.numel()])
                src.append(g.reshape(-1))
            elif persistent:
                flat[o : o + p.numel()].zero_()
        _foreach_copy(dst, src)
        if self.average and self.expert and self.size != self.dp_size:
            flat.mul_(self.size / self.dp_size)  # averaged over expert-DP below: the sum / DP, as upstream
        op = dist.ReduceOp.AVG if self.average else dist.ReduceOp.SUM
        if self.reduce_scatter:
            for p in self.params:  # the flat is the gradient from now on (its owned range reduced at the finish)
                if p not in self.views:
                    o = self.offsets[p]
                    p.main_grad = flat[o : o + p.numel()].view(p.shape)
                p.grad = None
            self._shard = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
            if self.average:
                self._work = dist.reduce_scatter_tensor(self._shard, flat, op=op, group=self.group, async_op=True)
            else:
                self._work = _reduce_scatter_async(self._shard, flat, self.group)
        else:
            self._work = dist.all_reduce(flat, op=op, group=self.group, async_op=True)
        self.flat = flat
        self.launched = True

    def finish_grad_reduce(self) -> None:
        """Wait for the reduction; divide by the data-parallel size; put the result where the optimizer reads it."""
        if self.finished:
            return
        self.launch_grad_reduce()
        if self._work is not None:
            self._work.wait()
            self._work = None
        flat = self.flat
        if self.reduce_scatter:
            owned = flat[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]
            owned.copy_(self._shard)
            self._shard = None
            reduced = owned
        else:
            reduced = flat
        if not self.average and self.dp_size > 1:
            reduced.div_(self.dp_size)
        # --check-for-nan-in-grad: a flag on the device, read for all buckets at once (check_reduced_grads)
        self.nonfinite = (~torch.isfinite(reduced).all()) if self.check_for_nan else None
        if not self.reduce_scatter:
            for p in self.params:
                if p in self.views:  # reduced in place: main_grad is the view
                    continue
                o = self.offsets[p]
                value = flat[o : o + p.numel()].view(p.shape)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if value.dtype != p.grad.dtype:
                    p.main_grad = value  # fp32 reduced grad of a bf16/fp16 param; the optimizer prefers it
                else:
                    p.grad.copy_(value)
            self.flat = None
        self.finished = True

    def nan_message(self) -> str:
        return (f"{'DistributedOptimizer' if self.reduce_scatter else 'DistributedDataParallel'}: "
                "NaN/Inf in the reduced gradients (--check-for-nan-in-grad)")

    def owned_grad_shard(self) -> torch.Tensor:
        """This rank's reduced range of the flat gradient (after ``finish_grad_reduce``, reduce-scatter buckets)."""
        if not self.finished or self.flat is None:
            raise RuntimeError(f"Bucket {self.index}: the gradient reduction has not finished "
                               "(finish_grad_sync was not called after the backward pass)")
        return self.flat[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]

    # ---- parameters ------------------------------------------------------------------------------------------
    def set_param_shard(self, shard: torch.Tensor, write_back: Callable[[torch.Tensor], None]) -> None:
        """Queue this rank's updated ``shard`` (``shard_numel`` elements) for gathering; ``write_back(full)``
        copies the gathered flat into the parameters."""
        if self._gather is not None or self._gather_work is not None:
            self.finish_param_gather()  # never two gathers of one bucket at once
        self._gather = (shard, write_back)

    @property
    def param_gather_pending(self) -> bool:
        return self._gather is not None

    @property
    def param_gather_dispatched(self) -> bool:
        return self._gather_work is not None

    def start_param_gather(self) -> None:
        if self._gather is None or self._gather_work is not None:
            return
        shard = self._gather[0]
        self._gathered = torch.empty(self.shard_numel * self.size, dtype=shard.dtype, device=shard.device)
        self._gather_work = _all_gather_async(self._gathered, shard, self.group)

    def finish_param_gather(self) -> None:
        if self._gather is None:
            return
        self.start_param_gather()
        self._gather_work.wait()
        write_back = self._gather[1]
        full, self._gathered, self._gather, self._gather_work = self._gathered, None, None, None
        write_back(full)


def build_buckets(params: List[torch.nn.Parameter], group, expert_group, dp_size: int, bucket_size: Optional[int],
                  reduce_dtype_of: Callable, reduce_scatter: bool, grad_reduce_in_fp32: bool = False,
                  pad_for_high_nccl_busbw: bool = False, pipelined: bool = False, average_in_collective: bool = False,
                  check_for_nan: bool = False, names: Optional[Dict] = None) -> List[Bucket]:
    """Upstream's buckets of ``params`` (trainable, in upstream's module order), in the order their gradients are
    expected (the first bucket of each buffer holds the last parameters). Buckets over a group of one rank are left
    out: nothing to communicate (the caller handles those parameters as without overlap)."""
    from megatron.core.fp8_utils import is_quantized_tensor
    from megatron.core.distributed.param_layout import buffer_layouts

    expert_of = lambda p: not getattr(p, "allreduce", True)  # noqa: E731
    edp = get_world_size(expert_group) if expert_group is not None else 1
    dsize = get_world_size(group) if group is not None else 1
    layouts = buffer_layouts(params, dsize, edp, is_quantized_tensor, expert_of, grad_reduce_in_fp32, bucket_size,
                             pad_for_high_nccl_busbw, pipelined)
    position = {p: i for i, p in enumerate(reversed(params))}  # backward order, roughly
    found = []
    for layout in layouts:
        g = expert_group if layout.expert else group
        if g is None or get_world_size(g) == 1:
            continue
        for b in layout.buckets:
            last = max(position[p] for p, _, _ in b.params)
            found.append((last, b, layout))
    found.sort(key=lambda item: item[0])
    out = []
    for last, b, layout in found:
        quantized = layout.param_dtype == torch.uint8 and any(is_quantized_tensor(p) for p, _, _ in b.params)
        out.append(Bucket(len(out), b.params, b.numel, expert_group if layout.expert else group, layout.expert,
                          quantized, reduce_dtype_of(b.params[0][0]), dp_size, reduce_scatter,
                          average_in_collective, check_for_nan, names))
    return out
