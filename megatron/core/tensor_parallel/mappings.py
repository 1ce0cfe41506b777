"""Communication into and out of the tensor-parallel region, as autograd functions (upstream's names).

Tensor region (last dim split over TP ranks): ``copy_to_`` (forward identity, backward all-reduce),
``reduce_from_`` (forward all-reduce, backward identity), ``scatter_to_`` (forward split, backward all-gather),
``gather_from_`` (forward all-gather, backward split). Sequence-parallel region (first dim, the sequence of
``[s, b, h]``, split over TP ranks): ``scatter_to_sequence_parallel_region`` (forward split, backward all-gather),
``gather_from_sequence_parallel_region`` (forward all-gather, backward reduce-scatter, or split when the output
gradient is not tensor-parallel), ``reduce_scatter_to_sequence_parallel_region`` (forward reduce-scatter, backward
all-gather). ``group`` defaults to the tensor-parallel group; with one rank every function is the identity.

Over any group (MoE's expert-parallel token exchange): ``all_to_all`` (split sizes, backward with the splits swapped),
``gather_along_first_dim`` / ``reduce_scatter_along_first_dim`` (uneven first-dim pieces).
"""
import torch
import torch.distributed as dist

from megatron.core.dist_utils import get_world_size
from megatron.core.tensor_parallel.utils import split_along_dim, tp_group_info

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _info(group):
    group, size, rank = tp_group_info(tp_group=group)
    return group, size, rank


def _all_reduce(x, group):
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x, dim, group, size):
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter_first(x, group, size):
    """Sum over ranks, then this rank's piece of dim 0."""
    x = x.contiguous()
    if x.shape[0] % size:
        raise ValueError(f"reduce-scatter: first dimension {x.shape[0]} is not divisible by {size} ranks "
                         "(--sequence-parallel needs the sequence length divisible by --tensor-model-parallel-size)")
    out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, group=group)
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g.clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, rank, dim):
        ctx.args = (group, size, dim)
        return split_along_dim(x, dim, size, rank)

    @staticmethod
    def backward(ctx, g):
        group, size, dim = ctx.args
        return _all_gather(g, dim, group, size), None, None, None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, rank, dim, reduce_scatter_grad):
        ctx.args = (group, size, rank, dim, reduce_scatter_grad)
        return _all_gather(x, dim, group, size)

    @staticmethod
    def backward(ctx, g):
        group, size, rank, dim, reduce_scatter_grad = ctx.args
        if reduce_scatter_grad:  # dim is 0 here
            return _reduce_scatter_first(g, group, size), None, None, None, None, None
        return split_along_dim(g, dim, size, rank), None, None, None, None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size):
        ctx.args = (group, size)
        return _reduce_scatter_first(x, group, size)

    @staticmethod
    def backward(ctx, g):
        group, size = ctx.args
        return _all_gather(g, 0, group, size), None, None


def copy_to_tensor_model_parallel_region(x, group=None):
    group, size, _ = _info(group)
    return x if size == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x, group=None):
    group, size, _ = _info(group)
    return x if size == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x, group=None):
    group, size, rank = _info(group)
    return x if size == 1 else _ScatterToRegion.apply(x, group, size, rank, x.dim() - 1)


def gather_from_tensor_model_parallel_region(x, group=None):
    group, size, rank = _info(group)
    return x if size == 1 else _GatherFromRegion.apply(x, group, size, rank, x.dim() - 1, False)


def scatter_to_sequence_parallel_region(x, group=None):
    group, size, rank = _info(group)
    return x if size == 1 else _ScatterToRegion.apply(x, group, size, rank, 0)


def gather_from_sequence_parallel_region(x, tensor_parallel_output_grad: bool = True, group=None, **unused):
    group, size, rank = _info(group)
    return x if size == 1 else _GatherFromRegion.apply(x, group, size, rank, 0, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x, group=None, **unused):
    group, size, _ = _info(group)
    return x if size == 1 else _ReduceScatterToSequenceRegion.apply(x, group, size)


# ---- all-to-all and uneven first-dim gather / reduce-scatter over any group (MoE's EP or expert-TP x EP group) -
def _size(group) -> int:
    """World size of ``group``; 1 for None (no group: a single-process model)."""
    return 1 if group is None else get_world_size(group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, x, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        x = x.contiguous()
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, _AllToAll.apply(ctx.group, grad, ctx.input_splits, ctx.output_splits), None, None


def all_to_all(group, x: torch.Tensor, output_splits: list, input_splits: list) -> torch.Tensor:
    """``all_to_all_single`` along dim 0 with split sizes (upstream's ``tensor_parallel.all_to_all`` argument order);
    the backward sends the gradients back with the splits swapped. Identity on a group of size 1."""
    if _size(group) == 1:
        return x
    return _AllToAll.apply(group, x, [int(s) for s in output_splits], [int(s) for s in input_splits])


def gather_along_first_dim(group, x: torch.Tensor, sizes: list) -> torch.Tensor:
    """All-gather ``x`` along dim 0 over ``group`` (rank order), rank ``j`` contributing ``sizes[j]`` rows (uneven
    sizes allowed), as an all-to-all of ``x`` to every rank; backward: the rows' gradients summed back to their rank.
    Identity on a group of size 1."""
    ws = _size(group)
    if ws == 1:
        return x
    return all_to_all(group, x.repeat(ws, *([1] * (x.dim() - 1))), sizes, [x.shape[0]] * ws)


def reduce_scatter_along_first_dim(group, x: torch.Tensor, sizes: list) -> torch.Tensor:
    """Inverse of :func:`gather_along_first_dim`: ``x`` has ``sum(sizes)`` rows; rank ``j`` receives rows of its
    segment ``j`` from every rank and sums them. Backward: the gather of the gradient."""
    ws = _size(group)
    if ws == 1:
        return x
    me = dist.get_rank(group)
    out = all_to_all(group, x, [sizes[me]] * ws, sizes)
    return out.view(ws, sizes[me], *x.shape[1:]).sum(dim=0)
