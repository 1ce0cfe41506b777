"""The distributed optimizer (``--use-distributed-optimizer`` with plain data parallelism, ZeRO-1 style).

Layout: every model parameter (in param-group order, the same on every rank) occupies ``[offset, offset + numel)``
of one flat index space of ``N`` elements, padded to ``ceil(N / D) * D`` (``D``: data-parallel size). DP rank
``r`` owns the contiguous range ``[r * S, (r + 1) * S)``, ``S = padded / D``: for every parameter that range
intersects, it keeps an fp32 main copy of that flat slice, and the torch optimizer (AdamW / SGD) steps only those
slices, so the main params and the optimizer state on a rank are ``1/D`` of the whole (the last rank less the
padding). With the precision-aware optimizer and ``--bf16`` (``store_param_remainders``, upstream's default) a bf16
weight's main is the weight's own slice, stepped in place, its fp32 master's low 16 bits kept as optimizer state
(``precision_aware.py``); checkpoints hold the rebuilt fp32 master either way.

Quantized weights (TE FP8 tensors, ``--fp8-param-gather``; delayed, tensorwise or blockwise scaling) live in a
second index space laid out the same way: after the step each rank quantizes its own slices of the fp32 main params
into the weights (``fp8_utils.quantize_master_shards``: tensorwise scaling reduces the amax over the DP group,
delayed scaling keeps its amax history, blockwise reduces per block) and the FP8 bytes, not bf16, are all-gathered.

Expert weights (``allreduce=False``: each expert-parallel rank holds other experts) have index spaces of their own
over the expert-data-parallel group (the ranks holding the same experts).

Step: the gradients of all parameters are flattened and reduce-scattered over the DP group (each rank receives
the sum of its own range, then divided by ``D``: the mean, as DDP's all-reduce gives), the owned slices are
stepped, and the updated slices are all-gathered back into every rank's parameters. The collectives are
``reduce_scatter_tensor`` / ``all_gather_into_tensor`` (torch's ``*_single`` names where they exist); gloo in
torch 2.13 has both, and where a backend lacks them the code falls back to ``all_reduce`` + slice and
``all_gather`` into a list. ``DistributedDataParallel.finish_grad_sync`` does not all-reduce when the DDP config
says ``use_distributed_optimizer`` (this optimizer reduces); building this optimizer on a model whose DDP config
says otherwise is refused.

``--overlap-grad-reduce`` (``DistributedDataParallel`` buckets, ``distributed/param_and_grad_buffer.py``): each bucket
is an index space of its own (upstream's layout: each rank owns 1/DP of every bucket), reduce-scattered by the DDP chunk
during the backward pass; the step reads the owned range of the bucket's flat gradient instead of reduce-scattering.
Without overlap, DDP accumulating bf16 / fp16 gradients in fp32 over several ranks has buckets too (one per buffer,
reduce-scattered in place by ``finish_grad_sync``), read the same way. ``--overlap-param-gather``: the step hands each
bucket this rank's updated (or quantized) shard and the bucket gathers it before the next forward
(``DistributedDataParallel``'s forward pre-hooks); every other use of the model's weights here (loads,
``reload_model_params``) first waits for queued gathers.

Checkpoint: upstream 0.19.2's layouts, chosen as upstream by ``metadata['distrib_optim_sharding_type']`` of
``sharded_state_dict`` (the training loop passes it and stores it as the checkpoint's content metadata; a load passes
the checkpoint's own). Plain values in all: ``optimizer.param_groups`` (hyper-parameters and ``step``),
``param_state_sharding_type``, and ``grad_scaler`` with fp16.

- ``fully_reshardable`` (what the training loop writes, with or without ``--dist-ckpt-optim-fully-reshardable``):
  per parameter its whole state, fp32, shaped and placed like the parameter's ShardedTensor (same replica id), keys
  ``optimizer.state.<param|exp_avg|exp_avg_sq>.<param key>`` (``param``: the fp32 main). A save all-gathers each
  state over the DP group onto CPU (every rank holds the whole state for a moment, as upstream's default); a load
  reads whole tensors on every rank and keeps its slices, so any TP/PP/DP size loads it. Under expert parallelism
  (where upstream optimizes expert weights in an optimizer of their own, chained) it is ``{0: the dense part, 1: the
  expert part}``, each with its own param groups, as upstream's ChainedOptimizer; a load reads either form.
- ``dp_reshardable`` (upstream's training default): per bucket of upstream's buffer layout (``param_layout.py``) and
  state, one 1-D fp32 tensor ``optimizer.distributed.dp_group_idx_<model-parallel rank>.gbuf_idx_<g>.dtype_<(param
  dtype, grad dtype)>.bucket_idx_<b>.<state>`` of the bucket's unpadded size, with ``per_bucket_numel(_unpadded)``
  and the param groups as ShardedObjects of the same prefix. Written from the gathered whole state (each DP rank its
  1/DP range of each bucket); read whole-bucket on every rank, so another DP size loads it where the buckets are the
  same (a clear error otherwise). Under expert parallelism ``{0: dense, 1: expert}`` as upstream's chained
  optimizers, keys prefixed ``chained_<i>.``, the expert part keyed by the expert tensor x pipeline rank and laid
  out over the expert-DP group; without it upstream's experts are plain parameters.
- ``fully_sharded_model_space`` (upstream's default without metadata, deprecated there; this fork's older
  checkpoints): a slice's state is a ``ShardedTensor`` copying the parameter's own with ``flattened_range`` = the
  slice and DP replica coordinate 0, keys ``optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<param key>``; another
  DP size asks for its own slices of the same keys.
"""
import dataclasses
import math
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_utils import get_rank, get_world_size, is_distributed
from megatron.core.fp8_utils import (
    DIST_OPT_KINDS,
    dequantize,
    finish_param_gather,
    quantization_kind,
    quantize_master_shards,
    quantize_whole_masters,
    rowwise_bytes,
)
from megatron.core.distributed.param_layout import BucketLayout, BufferLayout, buffer_layouts
from megatron.core.optimizer.precision_aware import (PrecisionAwareAdamW, has_remainder, log_state_conversion,
                                                     main_grad_dtype, merge_fp32, remainders_enabled,
                                                     set_slice_state, slice_state, split_fp32)
from megatron.core.optimizer.optimizer import (
    MegatronOptimizer,
    _count_zeros,
    _foreach_copy,
    _is_dtensor,
    _is_quantized_param,
    global_grad_norm,
    scale_tensors_,
)

FULLY_SHARDED_MODEL_SPACE = "fully_sharded_model_space"  # upstream's names of the layouts
FULLY_RESHARDABLE = "fully_reshardable"
DP_RESHARDABLE = "dp_reshardable"


@dataclasses.dataclass
class _Slice:
    """The part of ``model_param`` (flat elements ``[start, stop)``) this rank owns, at ``shard_offset`` of the
    rank's flat shard of index space ``space``."""

    model_param: torch.nn.Parameter
    start: int
    stop: int
    shard_offset: int
    space: int = 0


@dataclasses.dataclass
class _Space:
    """One flat index space (see the module docstring): ``params`` at ``offsets``, ``shard_numel`` elements per
    rank. ``quantized``: the TE quantized weights (``--fp8-param-gather``), gathered as their FP8 bytes."""

    params: List[torch.nn.Parameter]
    offsets: Dict[torch.nn.Parameter, int]
    shard_numel: int
    quantized: bool
    expert: bool = False  # expert weights (``allreduce=False``): sharded over the expert-data-parallel group
    group: Optional[dist.ProcessGroup] = None
    size: int = 1
    rank: int = 0
    bucket: Optional[object] = None  # --overlap-grad-reduce: the DDP bucket (param_and_grad_buffer.Bucket) it is


def _dp_group_and_size(expert: bool = False):
    """``(group, size, rank)`` of the data-parallel group (``expert``: the expert-data-parallel group)."""
    group = (parallel_state.get_expert_data_parallel_group(check_initialized=False) if expert
             else parallel_state.get_data_parallel_group(with_context_parallel=True))
    if group is None or not is_distributed():
        return None, 1, 0
    return group, get_world_size(group), get_rank(group)


def _reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group, rank: int) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    try:
        fn(out, flat, group=group)
    except (RuntimeError, NotImplementedError):  # a backend without it: all_reduce + own slice
        dist.all_reduce(flat, group=group)
        out.copy_(flat[rank * out.numel() : (rank + 1) * out.numel()])


def _all_gather(out: torch.Tensor, shard: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    try:
        fn(out, shard, group=group)
    except (RuntimeError, NotImplementedError):  # a backend without it: all_gather into views of ``out``
        dist.all_gather(list(out.view(-1, shard.numel()).unbind(0)), shard, group=group)


class DistributedOptimizer(MegatronOptimizer):
    """``DistributedOptimizer(make_optimizer, config, groups, param_to_name, grad_scaler=None,
    grad_reduce_in_fp32=False, check_for_nan_in_grad=False)``.

    ``groups``: the param groups of ``get_param_groups`` (model parameters); ``make_optimizer(groups)`` builds
    the torch optimizer over groups whose ``params`` are this rank's fp32 slices (a group may be empty here).
    """

    def __init__(self, make_optimizer, config, groups: List[dict], param_to_name: Dict, grad_scaler=None,
                 grad_reduce_in_fp32: bool = False, check_for_nan_in_grad: bool = False,
                 chunk_params: Optional[List[List[torch.nn.Parameter]]] = None, ddp_config=None,
                 model_chunks=None):
        self.group, self.dp_size, self.dp_rank = _dp_group_and_size()
        # what upstream's buffer layout follows (``dp_reshardable``): each model chunk's trainable parameters in
        # module order, and the DDP config's bucketing
        self.chunk_params = chunk_params if chunk_params is not None else [list(param_to_name)]
        self.ddp_config = ddp_config
        self.grad_reduce_in_fp32 = grad_reduce_in_fp32
        self.all_params = [p for g in groups for p in g["params"]]
        for p in self.all_params:
            name = param_to_name.get(p, "<unnamed>")
            if _is_dtensor(p):
                raise NotImplementedError(f"--use-distributed-optimizer without --use-megatron-fsdp: parameter {name} "
                                          "is a DTensor (Megatron-FSDP's); its optimizer shards it already")
            if _is_quantized_param(p) and rowwise_bytes(p) is None:
                raise NotImplementedError(
                    f"--use-distributed-optimizer without --use-megatron-fsdp: parameter {name} is a "
                    f"{quantization_kind(p) or type(p).__name__} quantized weight; the distributed optimizer "
                    f"gathers quantized weights of the kinds {DIST_OPT_KINDS} only (--fp8-recipe delayed, "
                    "tensorwise or blockwise); use --use-megatron-fsdp for MXFP8 / NVFP4 (--fp4-param-gather)"
                )
            if not p.is_contiguous():
                raise ValueError(f"DistributedOptimizer: parameter {name} is not contiguous")
        plain = [p for p in self.all_params if not _is_quantized_param(p)]
        dtypes = {p.dtype for p in self.all_params}
        self.reduce_dtype = (torch.float32 if grad_reduce_in_fp32 or len(dtypes) != 1 else next(iter(dtypes)))
        plain_dtypes = {p.dtype for p in plain}
        self.param_dtype = next(iter(plain_dtypes)) if len(plain_dtypes) == 1 else torch.float32
        self.check_for_nan_in_grad = check_for_nan_in_grad
        self.main_grad_dtype = main_grad_dtype(config, self.reduce_dtype)  # precision_aware.py: bf16 or fp32
        self.param_remainders = remainders_enabled(config)  # bf16 weights' fp32 mains as 16-bit remainders
        self.device = self.all_params[0].device if self.all_params else torch.device("cpu")

        # flat layouts (plain parameters; quantized weights in a space of their own, gathered as bytes; expert
        # weights, which differ across expert-parallel ranks, in spaces over the expert-data-parallel group) and this
        # rank's range of each
        self.spaces: List[_Space] = []
        space_of: Dict[torch.nn.Parameter, int] = {}
        # the DDP chunks' buckets (--overlap-grad-reduce, or fp32 accumulation over several ranks) are index spaces
        # of their own (reduced by DDP: during the backward pass with overlap, else in finish_grad_sync;
        # --overlap-param-gather: gathered before the next forward)
        self.overlap_param_gather = bool(getattr(ddp_config, "overlap_param_gather", False))
        self._defer_param_gather = False
        for bucket in _ddp_buckets(model_chunks):
            missing = [param_to_name.get(p, "<unnamed>") for p in bucket.params if p not in set(self.all_params)]
            if missing:
                raise ValueError(f"parameters {missing[:3]} are in a DistributedDataParallel "
                                 "bucket but not in the optimizer's param groups")
            for p in bucket.params:
                space_of[p] = len(self.spaces)
            self.spaces.append(_Space(list(bucket.params), dict(bucket.offsets), bucket.shard_numel,
                                      bucket.quantized, bucket.expert, bucket.group, bucket.size, bucket.rank, bucket))
        for expert in (False, True):
            group, size, rank = _dp_group_and_size(expert)
            for quantized in (False, True):
                params = [p for p in self.all_params if p not in space_of
                          and _is_quantized_param(p) == quantized and _is_expert(p) == expert]
                if not params:
                    continue
                offsets, total = {}, 0
                for p in params:
                    offsets[p], total = total, total + p.numel()
                    space_of[p] = len(self.spaces)
                self.spaces.append(_Space(params, offsets, max(1, math.ceil(total / size)), quantized, expert,
                                          group, size, rank))
        self.slices: List[_Slice] = []
        shard_groups, main_params = [], []
        for g in groups:
            mains = []
            for p in g["params"]:
                space = self.spaces[space_of[p]]
                lo, hi = space.rank * space.shard_numel, (space.rank + 1) * space.shard_numel
                o = space.offsets[p]
                a, b = max(o, lo), min(o + p.numel(), hi)
                if a >= b:
                    continue
                s = _Slice(p, a - o, b - o, a - lo, space_of[p])
                self.slices.append(s)
                if self.param_remainders and p.dtype == torch.bfloat16 and not _is_quantized_param(p):
                    # store_param_remainders: the optimizer steps the weight's own slice (a view) and keeps the low
                    # 16 bits of its fp32 master beside it (precision_aware.py)
                    main = torch.nn.Parameter(p.detach().view(-1)[s.start : s.stop])
                    main.grad_dtype = self.main_grad_dtype
                else:
                    main = torch.nn.Parameter(_flat_values(p)[s.start : s.stop].float().clone())
                    if self.main_grad_dtype != torch.float32:  # --main-grads-dtype bf16: the reduced bf16 gradient
                        main.grad_dtype = self.main_grad_dtype
                mains.append(main)
            main_params.extend(mains)
            shard_groups.append({**g, "params": mains})
        optimizer = make_optimizer(shard_groups)
        self._step_count = 0
        super().__init__(optimizer, config, [s.model_param for s in self.slices], param_to_name, main_params,
                         grad_scaler=grad_scaler)

    # ---- gradients ---------------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.all_params + self.main_params:
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad = None
        for space in self.spaces:  # a finished DDP bucket's gradient belongs to the last step (as zero_grad_buffer)
            if space.bucket is not None and space.bucket.finished:
                space.bucket.reset()

    @torch.no_grad()
    def _copy_model_grads_to_main(self) -> None:
        """Reduce-scatter the flattened model grads (one collective per index space, over its group) and hand each
        owned slice to its main param. Divided by the data-parallel size: the mean over DP; for expert weights the
        sum over expert-DP / DP, as ``DistributedDataParallel`` (each expert's gradient already sums the tokens of
        its whole EP group)."""
        shards = []
        nonfinite = []  # --check-for-nan-in-grad: device flags, read on the host once below
        for k, space in enumerate(self.spaces):
            if space.bucket is not None:  # reduced by DistributedDataParallel (finish_grad_sync)
                bucket = space.bucket
                if not bucket.finished and not getattr(self.ddp_config, "overlap_grad_reduce", False):
                    # fp32 accumulation without overlap, finish_grad_sync not called: reduced here, as without buckets
                    bucket.finish_grad_reduce()
                    if bucket.nonfinite is not None:
                        nonfinite.append(bucket.nonfinite)
                shards.append(bucket.owned_grad_shard().to(self.main_grad_dtype))
                continue
            if space.size == 1:  # nothing to reduce: each main grad is its parameter's own gradient (no flat copy)
                shards.append(None)
                self._own_grads_to_main(k, nonfinite)
                continue
            flat = torch.zeros(space.shard_numel * space.size, dtype=self.reduce_dtype, device=self.device)
            dst, src = [], []
            for p in space.params:
                g = getattr(p, "main_grad", None)
                if g is None:
                    g = p.grad
                if g is not None:
                    o = space.offsets[p]
                    dst.append(flat[o : o + p.numel()])
                    src.append(g.reshape(-1))
            _foreach_copy(dst, src)
            shard = torch.empty(space.shard_numel, dtype=self.reduce_dtype, device=self.device)
            _reduce_scatter(shard, flat, space.group, space.rank)
            if self.dp_size > 1:
                shard.div_(self.dp_size)
            if self.check_for_nan_in_grad:
                nonfinite.append(~torch.isfinite(shard).all())
            shards.append(shard.to(self.main_grad_dtype))  # fresh every step: the main grads are views of it (no copy when fp32)
        for s, main in zip(self.slices, self.main_params):
            if shards[s.space] is not None:
                main.grad = shards[s.space][s.shard_offset : s.shard_offset + s.stop - s.start]
        if nonfinite and bool(torch.stack(nonfinite).any()):
            raise RuntimeError("DistributedOptimizer: NaN/Inf in the reduced gradients (--check-for-nan-in-grad)")

    def _own_grads_to_main(self, k: int, nonfinite: List[torch.Tensor]) -> None:
        """Space ``k`` over one rank (one GPU, or experts without expert-DP): each main grad is its parameter's
        gradient in fp32, divided by the DP size for experts as the reduce-scatter path. An fp32 gradient on one
        data-parallel rank is used as it is (a view); the others are views of one fp32 buffer of this step, filled
        by one ``torch._foreach_copy_`` (not a new tensor and a kernel per parameter); the buffer is freed with the
        main grads at the next ``zero_grad``, as before, so it adds nothing to the peak of the forward."""
        todo = []
        for s, main in zip(self.slices, self.main_params):
            if s.space != k:
                continue
            g = getattr(s.model_param, "main_grad", None)
            if g is None:
                g = s.model_param.grad
            if g is None:
                main.grad = torch.zeros(s.stop - s.start, dtype=self.main_grad_dtype, device=self.device)
                continue
            g = g.reshape(-1)[s.start : s.stop]
            if g.dtype == self.main_grad_dtype and self.dp_size == 1:
                main.grad = g
                continue
            todo.append((main, g))
        if todo:
            flat = torch.empty(sum(g.numel() for _, g in todo), dtype=self.main_grad_dtype, device=self.device)
            dst, o = [], 0
            for main, g in todo:
                main.grad = flat[o : o + g.numel()]
                dst.append(main.grad)
                o += g.numel()
            _foreach_copy(dst, [g for _, g in todo])
            if self.dp_size > 1:
                flat.div_(self.dp_size)
        if self.check_for_nan_in_grad:  # (``nonfinite``: the caller's flags, read once for all spaces)
            grads = [main.grad for s, main in zip(self.slices, self.main_params)
                     if s.space == k and main.grad.numel() > 0]
            if grads:
                nonfinite.append(~torch.isfinite(torch.stack(torch._foreach_norm(grads, float("inf")))).all())

    def _dp_sum(self, value: float, dtype=torch.float64) -> float:
        t = torch.tensor([value], dtype=dtype)
        if self.dp_size > 1:
            t = t.to(parallel_state.collective_device(self.group))
            dist.all_reduce(t, group=self.group)
        return t.item()

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """Global L2 norm (``global_grad_norm``): the owned slices' squares summed over the DP group, each value
        counted once under tensor parallelism."""
        return self._global_norm([main.grad for main in self.main_params])

    @torch.no_grad()
    def get_params_norm(self) -> float:
        """Global L2 norm of the fp32 main params (the owned slices, summed over the DP group)."""
        return self._global_norm([self._fp32_main(main) for main in self.main_params])

    def _fp32_main(self, main: torch.Tensor) -> torch.Tensor:
        """The fp32 main of a slice: ``main``, or rebuilt from the weight slice and its remainder (a copy)."""
        return self.optimizer.master(main) if has_remainder(self.optimizer, main) else main.detach()

    def _global_norm(self, tensors) -> float:
        entries = [(s.model_param, t) for s, t in zip(self.slices, tensors)]
        groups = {"dense": self.group, "expert": _dp_group_and_size(expert=True)[0]}
        return global_grad_norm(entries, shard_group=groups,
                                kinds=self._kept_norm_kinds())  # model_params are the slices' params, in order

    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        norm = self.get_grad_norm()
        if clip_grad > 0 and math.isfinite(norm):
            coef = clip_grad / (norm + 1e-6)
            if coef < 1.0:
                scale_tensors_(self._grads(), coef)
        return norm

    @torch.no_grad()
    def count_zeros(self) -> int:
        return int(self._dp_sum(_count_zeros(self._grads())))

    @torch.no_grad()
    def _copy_main_params_to_model(self) -> None:
        """All-gather the updated slices into every rank's parameters: plain ones in their dtype; quantized weights
        (``--fp8-param-gather``) are first quantized shard by shard on their owners (``quantize_master_shards``:
        amax reduced over DP), then their FP8 bytes are gathered (1 byte per element), then their derived buffers
        rebuilt (``finish_param_gather``). A space over one rank has nothing to gather (``_own_mains_to_model``)."""
        for k, space in enumerate(self.spaces):
            owned = [(s, main) for s, main in zip(self.slices, self.main_params) if s.space == k]
            if space.size == 1:  # (a main with a remainder is its weight's slice: nothing to copy)
                self._own_mains_to_model(space, [(s, m) for s, m in owned if not has_remainder(self.optimizer, m)])
                continue
            if space.quantized:
                mine = {id(s.model_param): (s, main) for s, main in owned}
                found = [mine.get(id(p)) for p in space.params]
                quantize_master_shards(space.params, [None if f is None else f[1].detach() for f in found],
                                       [0 if f is None else f[0].start for f in found], space.group)
                dtype, values = torch.uint8, (lambda s, main: rowwise_bytes(s.model_param)[s.start : s.stop])
            else:
                dtype, values = self.param_dtype, (lambda s, main: main.detach())
            shard = torch.zeros(space.shard_numel, dtype=dtype, device=self.device)
            _foreach_copy([shard[s.shard_offset : s.shard_offset + s.stop - s.start] for s, _ in owned],
                          [values(s, main) for s, main in owned])

            def write_back(full, space=space):
                _foreach_copy([rowwise_bytes(p) if space.quantized else p.data.view(-1) for p in space.params],
                              [full[space.offsets[p] : space.offsets[p] + p.numel()] for p in space.params])
                if space.quantized:
                    finish_param_gather(space.params)

            if space.bucket is not None:  # through the DDP bucket: deferred to the next forward in a step with
                space.bucket.set_param_shard(shard, write_back)  # --overlap-param-gather
                if not self._defer_param_gather:
                    space.bucket.finish_param_gather()
                continue
            full = torch.empty(space.shard_numel * space.size, dtype=dtype, device=self.device)
            _all_gather(full, shard, space.group)
            write_back(full)

    @staticmethod
    def _own_mains_to_model(space: "_Space", owned) -> None:
        """A space over one rank: plain weights take their fp32 mains by one ``torch._foreach_copy_``; quantized
        weights are quantized whole from them (``quantize_whole_masters``: one fused cast per weight, no bytes to
        gather, no separate transpose pass)."""
        if space.quantized:
            quantize_whole_masters([s.model_param for s, _ in owned], [main.detach() for _, main in owned])
            return
        _foreach_copy([s.model_param.data.view(-1)[s.start : s.stop] for s, _ in owned],
                      [main.detach() for _, main in owned])

    def _finish_param_gathers(self) -> None:
        """Wait for the queued --overlap-param-gather all-gathers (before the model's weights are read here)."""
        for space in self.spaces:
            if space.bucket is not None:
                space.bucket.finish_param_gather()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        self._finish_param_gathers()
        for s, main in zip(self.slices, self.main_params):
            if has_remainder(self.optimizer, main):  # the weight slice itself: its master is its value (remainder 0)
                self.optimizer.set_master(main, main.detach().float())
                continue
            main.copy_(_flat_values(s.model_param)[s.start : s.stop])

    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        # --overlap-param-gather: the updated shards are gathered asynchronously before the next forward
        self._defer_param_gather = self.overlap_param_gather
        try:
            result = super().step()
        finally:
            self._defer_param_gather = False
        if result[0]:
            self._step_count += 1
        return result

    # ---- state -------------------------------------------------------------------------------------------
    def _param_groups_state(self, expert: Optional[bool] = None) -> dict:
        """The param groups without their params, each with ``step``; ``expert`` True / False: only the expert /
        dense groups (``is_expert_parallel``)."""
        groups = []
        for g in self.optimizer.param_groups:
            if expert is None or (bool(g.get("is_expert_parallel", False)) and _upstream_expert_layout()) == expert:
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "step": self._step_count})
        return {"param_groups": groups}

    def _slice_state(self, main) -> Dict[str, torch.Tensor]:
        """{``fp32_param``: the main slice, state key: its state}; the precision-aware optimizer's moments as fp32
        values (copies, see ``precision_aware.slice_state``)."""
        return slice_state(self.optimizer, main)

    def _common_state(self, kind: str, expert: Optional[bool] = None) -> dict:
        """The plain values of every layout: param groups (with ``step``; ``expert``: see ``_param_groups_state``),
        the sharding type, the grad scaler."""
        sd = {"optimizer": self._param_groups_state(expert), "param_state_sharding_type": kind}
        if self.grad_scaler is not None:
            sd["grad_scaler"] = self.grad_scaler.state_dict()
        return sd

    def state_dict(self) -> dict:
        """This rank's part (plain tensors): param groups, the owned slices' state, the grad scaler."""
        self.init_state()
        sd = self._common_state(FULLY_SHARDED_MODEL_SPACE)
        sd["param_state"] = {i: {k: v.clone() for k, v in self._slice_state(m).items()}
                             for i, m in enumerate(self.main_params)}
        return sd

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           sharding_type: Optional[str] = None, metadata: Optional[dict] = None) -> dict:
        """The layout ``sharding_type`` names, else ``metadata['distrib_optim_sharding_type']``, else upstream's
        default here, ``fully_sharded_model_space`` (see the module docstring)."""
        kind = sharding_type or (metadata or {}).get("distrib_optim_sharding_type", FULLY_SHARDED_MODEL_SPACE)
        builders = {FULLY_SHARDED_MODEL_SPACE: self._fs_model_space_param_state,
                    FULLY_RESHARDABLE: self._fully_reshardable_part,
                    DP_RESHARDABLE: self._dp_reshardable_part}
        if kind not in builders:
            raise ValueError(f"DistributedOptimizer.sharded_state_dict: distrib_optim_sharding_type {kind!r} is not "
                             f"supported (supported: {sorted(builders)})")
        self.init_state()
        if is_loading:  # a checkpoint of other moment precisions: said in one line
            log_state_conversion(self.optimizer, metadata)
        if kind == FULLY_SHARDED_MODEL_SPACE:
            return {**self._common_state(kind), "param_state": builders[kind](model_sharded_state_dict)}
        # upstream's layouts, per optimizer upstream would have (with expert parallelism a dense and an expert one)
        whole = (None if is_loading and kind == DP_RESHARDABLE else
                 self._empty_whole_state() if is_loading else self._gathered_whole_state())
        parts = [builders[kind](model_sharded_state_dict, is_loading, expert, whole)
                 for expert in self._upstream_optimizers()]
        if len(parts) == 1:
            return parts[0]
        if kind == DP_RESHARDABLE:  # upstream's ChainedOptimizer prefixes the keys of the non-reshardable layouts
            from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

            for i, part in enumerate(parts):
                add_prefix_for_sharding(part, f"chained_{i}.")
        return dict(enumerate(parts))

    def _fs_model_space_param_state(self, model_sharded_state_dict: dict) -> dict:
        """``fully_sharded_model_space``: {slice index: {state key: the live slice as a flattened ShardedTensor}}
        (a load fills the live state in place)."""
        param_state = {}
        for i, (s, main) in enumerate(zip(self.slices, self.main_params)):
            sh = self._param_sharded_tensor(s.model_param, model_sharded_state_dict)
            replica_id = _dp_replica_zero(sh.replica_id)
            param_state[i] = {
                k: _state_sharded_tensor(sh, f"optimizer.state.{k}.{sh.key}", v, replica_id, slice(s.start, s.stop))
                for k, v in self._slice_state(main).items()
            }
        return param_state

    def _fully_reshardable_part(self, model_sharded_state_dict: dict, is_loading: bool, expert: Optional[bool],
                                whole: dict) -> dict:
        """``fully_reshardable``, one of upstream's optimizers (``expert``: see ``_upstream_optimizers``): common
        state and ``param_state`` = {index: {``param`` (the fp32 main) / ``exp_avg`` / ...: the parameter's whole
        state, fp32, placed (and replicated) like the parameter's ShardedTensor}}. ``whole``: the gathered whole
        states (saving: every rank holds them on CPU, as upstream), or empty ones to load into (every rank reads them
        whole; ``load_state_dict`` keeps its slices)."""
        sd = self._common_state(FULLY_RESHARDABLE, expert)
        sd["param_state"] = {}
        for i, p in enumerate(self._params_of(expert)):
            sh = self._param_sharded_tensor(p, model_sharded_state_dict)
            sd["param_state"][i] = {_upstream_state_key(k): _state_sharded_tensor(
                sh, f"optimizer.state.{_upstream_state_key(k)}.{sh.key}", v, sh.replica_id)
                for k, v in whole[p].items()}
        return sd

    def _upstream_optimizers(self) -> List[Optional[bool]]:
        """Upstream's optimizers of this model: [None] (one, every parameter) or, with expert parameters,
        [False, True] (its dense and its expert optimizer, chained)."""
        return [False, True] if any(_upstream_expert(p) for p in self.all_params) else [None]

    def _params_of(self, expert: Optional[bool]) -> List[torch.nn.Parameter]:
        return [p for p in self.all_params if expert is None or _upstream_expert(p) == expert]

    # ---- dp_reshardable: upstream's bucket layout (param_layout.py) -------------------------------------------
    def _part_dp(self, expert: Optional[bool]) -> Tuple[int, int]:
        """(size, rank) of the data-parallel group that upstream's optimizer ``expert`` shards over."""
        return _dp_group_and_size(expert=True)[1:] if expert else (self.dp_size, self.dp_rank)

    def _dp_reshardable_object(self, name: str, value, expert: Optional[bool]) -> "ShardedObject":
        from megatron.core.dist_checkpointing import ShardedObject

        return ShardedObject(f"{_dp_reshardable_prefix(expert)}.{name}", value, (1,), (0,),
                             replica_id=(0, 0, self._part_dp(expert)[1]))

    @staticmethod
    def compute_full_param_layout(params, bucket_size: Optional[int], data_parallel_world_size: int, ddp_config,
                                  expert_data_parallel_world_size: Optional[int] = None):
        """Upstream's static layout of the DDP buffers of ``params`` (trainable, in module order): a
        ``param_layout.FullParamLayout`` keyed by (param dtype, grad dtype, is expert-parallel), each buffer's
        buckets and parameter ranges as upstream pads them (``param_layout.buffer_layouts``). This fork's DDP keeps
        no flat buffers (``DistributedDataParallel`` accepts ``full_param_layout=`` and ignores it); the optimizer
        uses the same layout for upstream's ``dp_reshardable`` checkpoint keys."""
        from megatron.core.distributed.param_layout import FullParamLayout

        edp = data_parallel_world_size if expert_data_parallel_world_size is None else expert_data_parallel_world_size
        buffers = buffer_layouts(list(params), data_parallel_world_size, edp, _is_quantized_param, _upstream_expert,
                                 bool(getattr(ddp_config, "grad_reduce_in_fp32", False)), bucket_size,
                                 bool(getattr(ddp_config, "pad_buckets_for_high_nccl_busbw", False)),
                                 parallel_state.get_pipeline_model_parallel_world_size() > 1)
        return FullParamLayout(layouts={(b.param_dtype, b.grad_dtype, b.expert): b for b in buffers})

    def _upstream_buffers(self, expert: Optional[bool]) -> List[BufferLayout]:
        """The buffers of upstream's optimizer ``expert`` (every chunk's, in order), as its DistributedDataParallel
        would lay them out here: ``dp_reshardable`` keys and offsets follow them."""
        cfg = self.ddp_config
        out = []
        for i, chunk in enumerate(self.chunk_params):
            params = [p for p in chunk if expert is None or _upstream_expert(p) == expert]
            bucket_size = _upstream_bucket_size(cfg, self.dp_size, first_chunk=i == 0)
            out += buffer_layouts(params, self.dp_size, self._part_dp(True)[0], _is_quantized_param, _upstream_expert,
                                  self.grad_reduce_in_fp32, bucket_size,
                                  bool(getattr(cfg, "pad_buckets_for_high_nccl_busbw", False)),
                                  parallel_state.get_pipeline_model_parallel_world_size() > 1)
        return out

    def _dp_reshardable_part(self, model_sharded_state_dict: dict, is_loading: bool, expert: Optional[bool],
                             whole: Optional[dict]) -> dict:
        """``dp_reshardable`` (upstream's default), one of upstream's optimizers: its param groups (and grad
        scaler) as ShardedObjects, and per buffer, bucket and state (``param`` = the fp32 main, ``exp_avg``, ...) one
        1-D fp32 tensor of the bucket's unpadded elements, key ``optimizer.distributed.dp_group_idx_<model-parallel
        rank>.gbuf_idx_<g>.dtype_<(param dtype, grad dtype)>.bucket_idx_<b>.<state>``, with ``per_bucket_numel`` /
        ``per_bucket_numel_unpadded`` beside them. Saving: this DP rank writes the part of its 1/DP range of each
        bucket (from the gathered ``whole`` state); loading: every rank reads whole buckets and ``load_state_dict``
        takes its slices, so any DP size loads it where the buckets are the same."""
        from megatron.core.dist_checkpointing import ShardedTensor

        sd = self._common_state(DP_RESHARDABLE, expert)
        sd.update({k: self._dp_reshardable_object(k, sd[k], expert) for k in ("optimizer", "grad_scaler") if k in sd})
        buffers = self._upstream_buffers(expert)
        dp_size, dp_rank = self._part_dp(expert)
        replica_id = (0, 0, dp_rank if is_loading else 0)  # saved: each rank's range is its own
        prefix = _dp_reshardable_prefix(expert)
        state = {name: self._dp_reshardable_object(name, [{b.dtype_key: [getattr(k, attr) for k in b.buckets]}
                                                           for b in buffers], expert)
                 for name, attr in (("per_bucket_numel", "numel"), ("per_bucket_numel_unpadded", "numel_unpadded"))}
        for g, buf in enumerate(buffers):
            buckets = []
            for b, bucket in enumerate(buf.buckets):
                lo, hi = (0, bucket.numel_unpadded) if is_loading else _rank_range(bucket, dp_size, dp_rank)
                tensors = {}
                for key in self._state_keys():
                    name = _upstream_state_key(key)
                    data = (torch.empty(hi - lo, dtype=torch.float32) if is_loading
                            else _bucket_values(bucket, whole, key)[lo:hi])
                    if hi > lo:
                        tensors[name] = ShardedTensor(
                            f"{prefix}.gbuf_idx_{g}.dtype_{buf.dtype_key}.bucket_idx_{b}.{name}", data, torch.float32,
                            (hi - lo,), (bucket.numel_unpadded,), (lo,), None, replica_id=replica_id)
                buckets.append(tensors)
            state[g] = {buf.dtype_key: buckets}
        sd["param_state"] = state
        return sd

    def _dp_reshardable_location(self, param_state: dict,
                                 expert: Optional[bool]) -> Dict[torch.nn.Parameter, Tuple[dict, int]]:
        """{parameter: (its bucket's loaded tensors, its start in the bucket)} of upstream's optimizer ``expert``;
        the checkpoint's bucket sizes must be this model's (ValueError naming both otherwise)."""
        buffers = self._upstream_buffers(expert)
        mine = [{b.dtype_key: [k.numel_unpadded for k in b.buckets]} for b in buffers]
        saved = param_state.get("per_bucket_numel_unpadded")
        if saved != mine:
            raise ValueError(
                f"distributed optimizer checkpoint (dp_reshardable): its buckets hold {saved} elements (per buffer, "
                f"unpadded), upstream's layout of this model {mine}; dp_reshardable loads only into the same model, "
                f"tensor/pipeline parallel sizes and bucketing (--overlap-grad-reduce, --ddp-bucket-size) it was "
                f"saved with (any data-parallel size); save with --dist-ckpt-optim-fully-reshardable to reshard")
        out = {}
        for g, buf in enumerate(buffers):
            for b, bucket in enumerate(buf.buckets):
                for p, start, _ in bucket.params:
                    out[p] = (param_state[g][buf.dtype_key][b], start)
        return out

    def _state_keys(self) -> List[str]:
        """The keys of a slice's state (``fp32_param`` and the optimizer's tensors): the same for every slice."""
        if self.main_params:
            return list(self._slice_state(self.main_params[0]))
        if isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW, PrecisionAwareAdamW)):  # the same
            return ["fp32_param", "exp_avg", "exp_avg_sq"]
        momentum = any(g.get("momentum", 0) for g in self.optimizer.param_groups)
        return ["fp32_param"] + (["momentum_buffer"] if momentum else [])

    def _empty_whole_state(self) -> Dict[torch.nn.Parameter, Dict[str, torch.Tensor]]:
        return {p: {k: torch.empty(p.shape, dtype=torch.float32) for k in self._state_keys()}
                for p in self.all_params}

    @torch.no_grad()
    def _gathered_whole_state(self) -> Dict[torch.nn.Parameter, Dict[str, torch.Tensor]]:
        """{parameter: {state key: its whole state, fp32 on CPU, shaped like the parameter}}: per index space and
        key, the ranks' shards all-gathered over the space's group (a collective; ``_gathered_to_cpu``)."""
        out = {p: {} for p in self.all_params}
        for k, space in enumerate(self.spaces):
            owned = [(s, self._slice_state(main)) for s, main in zip(self.slices, self.main_params) if s.space == k]
            for key in self._state_keys():
                shard = torch.zeros(space.shard_numel, dtype=torch.float32, device=self.device)
                for s, state in owned:
                    shard[s.shard_offset : s.shard_offset + s.stop - s.start].copy_(state[key])
                full = _gathered_to_cpu(shard, space)
                for p in space.params:
                    o = space.offsets[p]
                    out[p][key] = full[o : o + p.numel()].clone().view(p.shape)
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load ``state_dict()`` / what ``dist_checkpointing.load`` returned for ``sharded_state_dict``; then
        all-gather the loaded fp32 params into the model (a collective: every DP rank calls it)."""
        self._finish_param_gathers()
        parts = _upstream_parts(state_dict)
        kind = parts[0].get("param_state_sharding_type")
        readers = {FULLY_SHARDED_MODEL_SPACE: self._fs_model_space_reader,
                   FULLY_RESHARDABLE: self._fully_reshardable_reader,
                   DP_RESHARDABLE: self._dp_reshardable_reader}
        if kind not in readers:
            raise ValueError(
                f"distributed optimizer checkpoint: param_state_sharding_type {kind!r} is not supported (supported: "
                f"{sorted(readers)}); a checkpoint saved without --use-distributed-optimizer loads without it"
            )
        if len(parts) > 1 and kind == FULLY_SHARDED_MODEL_SPACE:
            raise ValueError(f"distributed optimizer checkpoint: a chained (dense + expert) optimizer's state in "
                             f"param_state_sharding_type {kind!r}; chained ones load in upstream's layouts only")
        self._load_grad_scaler(parts[0])
        step = self._load_param_groups([g for part in parts for g in part["optimizer"]["param_groups"]])
        self.init_state()
        read = readers[kind]([part["param_state"] for part in parts])
        differ = []  # dp_reshardable: slices whose loaded main is not their weight (read before a remainder's load
        rebuilt = []  # writes the weight slice); slices whose saved main was a 16-bit remainder (see below)
        for i, (s, main) in enumerate(zip(self.slices, self.main_params)):
            for k, dest in self._slice_state(main).items():
                value = read(i, k)
                if k == "fp32_param":
                    master = _master_from_saved_remainder(s, value)
                    if master is not None:
                        value = master
                        rebuilt.append(self.param_to_name.get(s.model_param, "?"))
                if k == "fp32_param" and kind == DP_RESHARDABLE and _main_differs(s, value):
                    differ.append(self.param_to_name.get(s.model_param, "?"))
                if value is not dest:
                    set_slice_state(self.optimizer, main, k, dest, value)
            st = self.optimizer.state.get(main)
            if st and "step" in st:
                st["step"] = torch.tensor(float(step), dtype=torch.float32, device=st["step"].device)  # fused: GPU
        count = int(self._dp_sum(len(rebuilt)))
        if count and self.dp_rank == 0:
            warnings.warn(f"distributed optimizer checkpoint: the saved fp32 main params ('param') of {count} bf16 "
                          f"parameter slices (this rank's first: {rebuilt[:3]}) are 16-bit remainders, as upstream "
                          "writes them with store_param_remainders (its default with --use-precision-aware-optimizer "
                          "and --bf16); rebuilt from them and the loaded bf16 weights (load the model first)")
        if kind == DP_RESHARDABLE:
            self._warn_if_mains_differ_from_weights(differ)
        self._copy_main_params_to_model()

    def _warn_if_mains_differ_from_weights(self, differ: List[str]) -> None:
        """``dp_reshardable`` is keyed by offsets only: a bucket layout that differed from upstream's in the order of
        equal-sized parameters would load without an error. The weights (loaded by name, before the optimizer) are
        the fp32 mains cast to their dtype; a warning names the parameters whose loaded main is not (``differ``,
        :func:`_main_differs`; quantized weights are not compared). Collective over the DP group."""
        count = int(self._dp_sum(len(differ)))
        if count and self.dp_rank == 0:
            warnings.warn(f"distributed optimizer checkpoint (dp_reshardable): the loaded fp32 main params of "
                          f"{count} parameter slices (this rank's first: {differ[:3]}) differ from the "
                          f"model's weights; if the model was loaded from the same checkpoint, its bucket layout is "
                          f"not the one computed here (param_layout.py) and the optimizer state is misplaced")

    def _load_param_groups(self, groups: List[dict]) -> int:
        """The saved hyper-parameters into this optimizer's param groups (``_matched_groups``; a group's
        ``is_expert_parallel`` stays its own); returns the saved step."""
        step = 0
        for mine, saved in zip(self.optimizer.param_groups, _matched_groups(self.optimizer.param_groups, groups)):
            step = int(saved.get("step", 0))
            mine.update({k: v for k, v in saved.items() if k not in ("params", "step", "is_expert_parallel")})
        self._step_count = step
        return step

    # Readers of a loaded ``param_state``: ``read(slice index, state key)`` -> the slice's loaded state.
    def _fs_model_space_reader(self, param_states: List[dict]):
        """``fully_sharded_model_space``: the loaded slices themselves."""
        (param_state,) = param_states

        def read(i: int, key: str) -> torch.Tensor:
            saved = param_state.get(i)
            if saved is None:
                raise KeyError(f"distributed optimizer checkpoint: no param_state for slice {i} "
                               f"({self.param_to_name.get(self.slices[i].model_param)})")
            if key not in saved:
                raise KeyError(f"distributed optimizer checkpoint: param_state[{i}] has no {key!r}")
            return saved[key]

        return read

    def _fully_reshardable_reader(self, param_states: List[dict]):
        """``fully_reshardable``: the slice's range of its parameter's whole tensor (``param``: upstream's name of
        the fp32 main param; its loader also accepts ``fp32_param``); one part, or a dense and an expert one."""
        parts = self._saved_parts(param_states, FULLY_RESHARDABLE)
        where = {p: (ps, i) for ps, expert in zip(param_states, parts) for i, p in enumerate(self._params_of(expert))}

        def read(i: int, key: str) -> torch.Tensor:
            s = self.slices[i]
            param_state, index = where[s.model_param]
            saved = param_state.get(index)
            name = self.param_to_name.get(s.model_param)
            if saved is None:
                raise KeyError(f"distributed optimizer checkpoint (fully_reshardable): no param_state for parameter "
                               f"{index} ({name})")
            found = [k for k in (_upstream_state_key(key), key) if k in saved]
            if not found:
                raise KeyError(f"distributed optimizer checkpoint (fully_reshardable): param_state[{index}] ({name}) "
                               f"has no {_upstream_state_key(key)!r}")
            return saved[found[0]].reshape(-1)[s.start : s.stop]

        return read

    def _saved_parts(self, param_states: List[dict], kind: str) -> List[Optional[bool]]:
        """Which of upstream's optimizers each saved part is: [None] (one), or [False, True] (chained dense +
        expert); a fully_reshardable checkpoint of one optimizer also loads into a model upstream would chain."""
        parts = [None] if len(param_states) == 1 else [False, True]
        mine = self._upstream_optimizers()
        if len(param_states) > 2 or (parts != mine and (kind == DP_RESHARDABLE or parts != [None])):
            raise ValueError(f"distributed optimizer checkpoint ({kind}): the state of {len(param_states)} (chained) "
                             f"optimizers, upstream's optimizers of this model {len(mine)} (expert parallelism "
                             f"differs)")
        return parts

    def _dp_reshardable_reader(self, param_states: List[dict]):
        """``dp_reshardable``: the slice's range of its bucket's tensor (the buckets checked against this model's)."""
        locations = {}
        for param_state, expert in zip(param_states, self._saved_parts(param_states, DP_RESHARDABLE)):
            locations.update(self._dp_reshardable_location(param_state, expert))

        def read(i: int, key: str) -> torch.Tensor:
            s = self.slices[i]
            tensors, start = locations[s.model_param]
            name = _upstream_state_key(key)
            if name not in tensors:
                raise KeyError(f"distributed optimizer checkpoint (dp_reshardable): no {name!r} in the bucket of "
                               f"{self.param_to_name.get(s.model_param)}")
            return tensors[name][start + s.start : start + s.stop]

        return read


@torch.no_grad()
def _master_from_saved_remainder(s: _Slice, value: torch.Tensor) -> Optional[torch.Tensor]:
    """The fp32 master of a bf16 weight slice where the checkpoint holds, as upstream writes them with
    ``store_param_remainders`` (TE FusedAdam returns its int16 state as the "unscaled" master), the low 16 bits
    under ``param`` (int16, or their values as floats) instead of the master: rebuilt from them and the slice's
    loaded weight (:func:`precision_aware.merge_fp32`). None for a real master: not all integers in int16's range,
    or the weight itself (a master is its weight rounded)."""
    weight = s.model_param.detach().reshape(-1)[s.start : s.stop]
    if weight.dtype != torch.bfloat16 or _is_quantized_param(s.model_param) or value.numel() == 0:
        return None
    v = value.detach().reshape(-1).to(weight.device)
    if v.dtype != torch.int16:
        if not v.is_floating_point() or not _main_differs(s, v):
            return None
        if not (torch.equal(v, v.round()) and bool(((v >= -32768) & (v <= 32767)).all())):
            return None
        v = v.to(torch.int16)
    return merge_fp32(weight, v)


@torch.no_grad()
def _main_differs(s: _Slice, value: torch.Tensor) -> bool:
    """Whether a loaded fp32 main ``value`` is not the slice's weight cast to its dtype (cast to nearest even, or
    rounded as a remainder's weight: ties away from zero); quantized weights are not compared."""
    if _is_quantized_param(s.model_param):
        return False
    weight = s.model_param.detach().reshape(-1)[s.start : s.stop]
    value = value.reshape(-1).to(weight.device)
    if torch.equal(value.to(weight.dtype), weight):
        return False
    return not (weight.dtype == torch.bfloat16 and torch.equal(split_fp32(value.float())[0], weight))


def _ddp_buckets(model_chunks) -> list:
    """The gradient buckets of the DistributedDataParallel chunks: with ``overlap_grad_reduce`` (reduced during the
    backward pass), or without it where DDP accumulates in fp32 over several ranks (one bucket per buffer, reduced
    by ``finish_grad_sync``); empty otherwise."""
    return [b for chunk in model_chunks or () for b in getattr(chunk, "buckets", ())]


def _is_expert(p) -> bool:
    """An expert-parallel parameter (``allreduce=False``): upstream optimizes those in an optimizer of their own."""
    return not getattr(p, "allreduce", True)


def _upstream_expert_layout() -> bool:
    """Whether upstream gives expert weights an optimizer (and buffers) of their own: with expert parallelism, or an
    expert tensor-parallel size other than the tensor-parallel size; else its experts are plain parameters."""
    return (parallel_state.get_expert_model_parallel_world_size() > 1
            or parallel_state.get_expert_tensor_parallel_world_size()
            != parallel_state.get_tensor_model_parallel_world_size())


def _upstream_expert(p) -> bool:
    """An expert weight in upstream's optimizer of expert weights (``_upstream_expert_layout``)."""
    return _is_expert(p) and _upstream_expert_layout()


def _upstream_parts(state_dict: dict) -> List[dict]:
    """A loaded optimizer state as upstream's optimizers: [it], or, for a ChainedOptimizer's ({0: dense, 1:
    expert}, upstream's MoE models), its parts in order."""
    if "param_state_sharding_type" not in state_dict and state_dict and all(isinstance(k, int) for k in state_dict):
        return [state_dict[k] for k in sorted(state_dict)]
    return [state_dict]


GROUP_IDENTIFIER_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr", "max_lr", "min_lr")


def _matched_groups(live: List[dict], saved: List[dict]) -> List[dict]:
    """The saved param group of each live one: the one with the same ``GROUP_IDENTIFIER_KEYS`` values, as upstream
    pairs them (the saving run may have ordered its groups differently; ``is_expert_parallel`` as upstream's layout
    has it: without expert parallelism upstream's experts share the dense groups), else, where those do not pair
    the groups (e.g. another --lr), the one at the same position. ValueError naming the counts if neither does."""
    def ident(g):
        expert = bool(g.get("is_expert_parallel", False)) and _upstream_expert_layout()
        return tuple(expert if k == "is_expert_parallel" else g.get(k) for k in GROUP_IDENTIFIER_KEYS)

    by_ident = {ident(g): g for g in saved}
    if len(by_ident) == len(saved) and all(ident(g) in by_ident for g in live):
        return [by_ident[ident(g)] for g in live]
    if len(saved) != len(live):
        raise ValueError(f"distributed optimizer checkpoint has {len(saved)} param groups, this optimizer "
                         f"{len(live)}, and they do not pair by {GROUP_IDENTIFIER_KEYS}")
    return list(saved)


def _dp_reshardable_prefix(expert: Optional[bool] = None) -> str:
    """Upstream's prefix of ``dp_reshardable`` keys: ``dp_group_idx`` is this rank's index in its model-parallel
    (TP x PP) group, for the expert optimizer in its expert tensor x pipeline group."""
    group = (parallel_state.get_expert_tensor_model_pipeline_parallel_group(check_initialized=False) if expert
             else parallel_state.get_model_parallel_group(check_initialized=False))
    rank = get_rank(group) if group is not None and is_distributed() else 0
    return f"optimizer.distributed.dp_group_idx_{rank}"


def _upstream_bucket_size(ddp_config, dp_size: int, first_chunk: bool) -> Optional[int]:
    """The bucket size upstream's DistributedDataParallel uses: none (one bucket per buffer) without
    ``overlap_grad_reduce``, past the first pipeline stage or for later model chunks; else ``bucket_size`` or its
    default max(4e7, 1e6 x DP)."""
    if ddp_config is None or not getattr(ddp_config, "overlap_grad_reduce", False) or not first_chunk:
        return None
    if parallel_state.get_pipeline_model_parallel_rank() > 0:
        return None
    return ddp_config.bucket_size or max(40_000_000, 1_000_000 * dp_size)


GATHER_CHUNK_NUMEL = 2**26  # the most elements (all ranks' together) a whole-state save gathers on the device at once


def _gathered_to_cpu(shard: torch.Tensor, space: _Space) -> torch.Tensor:
    """Every rank's ``shard`` of ``space`` (rank order) on CPU, all-gathered piece by piece, so the device holds at
    most ``GATHER_CHUNK_NUMEL`` gathered elements at a time."""
    if space.size == 1:
        return shard.cpu()
    full = torch.empty(space.size, space.shard_numel, dtype=shard.dtype)
    step = max(1, GATHER_CHUNK_NUMEL // space.size)
    for start in range(0, space.shard_numel, step):
        piece = shard[start : start + step].contiguous()
        gathered = torch.empty(piece.numel() * space.size, dtype=shard.dtype, device=shard.device)
        _all_gather(gathered, piece, space.group)
        full[:, start : start + piece.numel()] = gathered.view(space.size, -1).cpu()
    return full.view(-1)


def _rank_range(bucket: BucketLayout, dp_size: int, dp_rank: int) -> Tuple[int, int]:
    """This DP rank's contiguous range of a bucket (1/DP of its padded size), cut at its unpadded end."""
    local = bucket.numel // dp_size
    return min(dp_rank * local, bucket.numel_unpadded), min((dp_rank + 1) * local, bucket.numel_unpadded)


def _bucket_values(bucket: BucketLayout, whole: dict, key: str) -> torch.Tensor:
    """State ``key`` of a bucket's parameters laid out as in the bucket (zeros between them)."""
    flat = torch.zeros(bucket.numel_unpadded, dtype=torch.float32)
    for p, start, end in bucket.params:
        flat[start:end].copy_(whole[p][key].reshape(-1))
    return flat


def _flat_values(p: torch.Tensor) -> torch.Tensor:
    """``p``'s values, flat (a quantized weight dequantized to its nominal dtype)."""
    return dequantize(p.detach()).reshape(-1)


def _upstream_state_key(key: str) -> str:
    """The name upstream's ``fully_reshardable`` layout gives a state: ``param`` for the fp32 main param."""
    return "param" if key == "fp32_param" else key


def _dp_replica_zero(replica_id):
    """``replica_id`` with its DP coordinate (the last) 0: each rank's slices are distinct."""
    return (*replica_id[:-1], 0) if isinstance(replica_id, tuple) else 0


def _state_sharded_tensor(sh, key: str, data: torch.Tensor, replica_id, flat: Optional[slice] = None):
    """``sh`` (the parameter's ShardedTensor or ShardedTensorFactory) describing the optimizer state ``data``
    under ``key`` and ``replica_id``: whole (shaped like the parameter), or the flat slice ``flat`` of it (1-D)."""
    from megatron.core.dist_checkpointing import ShardedTensorFactory

    kwargs = dict(key=key, data=data, replica_id=replica_id)
    if flat is not None:
        kwargs["flattened_range"] = flat
    if not isinstance(sh, ShardedTensorFactory):
        kwargs["dtype"] = data.dtype
    return dataclasses.replace(sh, **kwargs)
