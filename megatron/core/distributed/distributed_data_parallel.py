"""Plain data parallelism (runs without ``--use-megatron-fsdp``): full replicas, gradients all-reduced.

Gradients accumulate in ``param.grad`` during the backward passes of a step; ``finish_grad_sync()`` (called by
``finalize_model_grads``) averages them over the data-parallel group in flat buckets, one collective per dtype.
With ``grad_reduce_in_fp32`` (``--accumulate-allreduce-grads-in-fp32``) and bf16 / fp16 parameters they accumulate in
fp32 instead, as upstream's: each such parameter's ``main_grad`` is a view of a persistent fp32 buffer (one per bucket,
or per (expert, device) without buckets; the distributed optimizer over several ranks has buckets even without overlap,
one per buffer, so it reads its owned range in place) that a post-accumulate-grad hook adds ``param.grad`` into before
freeing it; the collectives then run on those buffers in place and the optimizer takes ``main_grad`` as the main
parameter's gradient, so gradients cost 4 bytes per parameter, as upstream's. A step's first accumulation copies instead
of adding (``zero_grad_buffer`` only drops the views), and a parameter without a gradient in a step has its view zeroed
before a collective reads it.

``overlap_grad_reduce`` (``--overlap-grad-reduce``, as upstream): the parameters are cut into upstream's buckets
(``param_and_grad_buffer.py``; ``bucket_size``, default max(4e7, 1e6 x DP), none past the first pipeline stage or
with ``disable_bucketing``) and a hook after each parameter's gradient accumulation marks it ready; a bucket whose
parameters are all ready is reduced asynchronously (all-reduce, or reduce-scatter for the distributed optimizer)
while the backward pass goes on. Only the last micro-batch of a step communicates (``no_sync`` around the others,
as upstream). The first step learns how many times each parameter's hook fires (upstream's golden counts); its
buckets are launched by ``finish_grad_sync``. Buckets are always launched in their fixed order (a ready bucket waits
for the ones before it), so every rank issues the same collectives in the same order even where some parameter got
no gradient on one rank; ``finish_grad_sync`` launches what is left and waits. ``overlap_param_gather`` (distributed
optimizer): the optimizer step queues each bucket's updated shard; the first forward pre-hook of the chunk starts
every bucket's all-gather (``align_param_gather``: ``start_param_sync`` before the step's first forward, all
chunks at once) and each module's pre-hook waits for the buckets of its own parameters. Parameters whose gradient is ``None`` on this
rank take part with zeros, so ranks never disagree on collective sizes. Expert parameters (``allreduce=False``, held
by one expert-parallel rank) are summed over the expert-data-parallel group instead and divided by the data-parallel
size, as upstream (each expert's gradient already sums the contributions of the tokens of every EP rank).
"""
import contextlib
from functools import partial
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_utils import default_device, get_world_size
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.meta_init import has_meta_tensors, materialize_meta_module
from megatron.core.distributed.param_and_grad_buffer import (
    Bucket,
    build_buckets,
    check_reduced_grads,
    settle_main_grad,
)
from megatron.core.transformer.module import MegatronModule


class DistributedDataParallel(MegatronModule):
    """``DistributedDataParallel(config, ddp_config, module, disable_bucketing=False, process_group=None)``; upstream's
    ``pg_collection=`` / ``full_param_layout=`` keywords are accepted (see ``__init__``).

    ``.module`` is the wrapped model; ``forward`` passes through; ``state_dict`` / ``load_state_dict`` /
    ``sharded_state_dict`` are the unwrapped model's (same keys). A model built on the meta device is
    materialised here (see ``fsdp/meta_init.py``); ``param_keyed_maps`` are remapped to the new parameters.
    """

    init_on_construction = False  # wraps a built (or meta) module; materialisation initialises

    def __init__(
        self,
        config,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
        process_group: Optional[dist.ProcessGroup] = None,
        param_keyed_maps=(),
        *,
        pg_collection=None,
        full_param_layout=None,
    ):
        super().__init__(config)
        self.ddp_config = ddp_config
        self.module = module
        self.process_group = (process_group if process_group is not None  # CP ranks are replicas too, as upstream's
                              else parallel_state.get_data_parallel_group(with_context_parallel=True))
        self.expert_process_group = (
            self.process_group if process_group is not None else parallel_state.get_expert_data_parallel_group()
        )
        # upstream's keywords: ``pg_collection`` gives the data-parallel groups (dp_cp, expt_dp); this DDP keeps no
        # flat buffers, so ``full_param_layout`` (DistributedOptimizer.compute_full_param_layout) is not needed
        if pg_collection is not None:
            if process_group is not None:
                raise ValueError("DistributedDataParallel: give pg_collection= or process_group=, not both")
            dense = pg_collection.dp_cp if pg_collection.dp_cp is not None else pg_collection.dp
            self.process_group = dense if dense is not None else self.process_group
            if pg_collection.expt_dp is not None:
                self.expert_process_group = pg_collection.expt_dp
        self.old_to_new_params: Dict = {}
        if has_meta_tensors(module):  # an eagerly built (or loaded) model keeps its values
            self.old_to_new_params = materialize_meta_module(module, default_device(), maps=param_keyed_maps)
        self.param_to_name = {p: n for n, p in module.named_parameters()}
        self._sync_enabled = True
        self.buckets: List[Bucket] = []
        self.bucket_size = None
        self._next_launch = 0  # the first bucket whose reduction has not been launched this step
        self.use_forward_hook = bool(ddp_config.overlap_param_gather)  # upstream's attribute
        self._param_gather_hooks = []
        self._main_grad_views: Dict[torch.nn.Parameter, torch.Tensor] = {}
        self._main_grad_groups: List[tuple] = []  # (is_expert, fp32 buffer, params) of the parameters outside buckets
        self._main_grad_hooks = []
        overlap = ddp_config.overlap_grad_reduce or ddp_config.overlap_param_gather
        if overlap or self._distributed_optimizer_reads_fp32_buckets():
            self._setup_buckets(disable_bucketing or not overlap)  # without overlap: one bucket per buffer
        else:
            self._setup_main_grads()

    # ---- forward / state ---------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        self.finish_param_sync()  # a queued gather must not overwrite the loaded values later
        return self.module.load_state_dict(state_dict, strict=strict)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        self.finish_param_sync()
        return self.module.sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)

    # ---- overlap: buckets and hooks (see the module docstring) ---------------------------------------------
    def _distributed_optimizer_reads_fp32_buckets(self) -> bool:
        """The distributed optimizer without overlap, over several ranks, with fp32 accumulation of bf16 / fp16
        gradients: buckets too (one per buffer, reduce-scattered in place by ``finish_grad_sync``), so the optimizer
        reads the persistent fp32 buffers instead of copying them into a flat of its own (4 bytes per parameter,
        as upstream, not 8)."""
        cfg = self.ddp_config
        return (cfg.use_distributed_optimizer and cfg.grad_reduce_in_fp32 and self._world_size() > 1
                and any(p.requires_grad and p.dtype != torch.float32 for p in self.module.parameters()))

    def _setup_buckets(self, disable_bucketing: bool) -> None:
        cfg = self.ddp_config
        if cfg.overlap_param_gather and not cfg.use_distributed_optimizer:
            raise ValueError("overlap_param_gather (--overlap-param-gather) needs use_distributed_optimizer "
                             "(--use-distributed-optimizer): without it parameters are not gathered")
        if cfg.overlap_param_gather and not cfg.overlap_grad_reduce:
            raise ValueError("overlap_param_gather (--overlap-param-gather) needs overlap_grad_reduce "
                             "(--overlap-grad-reduce), as upstream")
        if cfg.bucket_size is not None and cfg.bucket_size <= 0:
            raise ValueError(f"bucket_size (--ddp-bucket-size) must be a positive number of elements, got "
                             f"{cfg.bucket_size}")
        ws = self._world_size()
        bucket_size = cfg.bucket_size or max(40_000_000, 1_000_000 * ws)  # upstream's default
        if cfg.num_buckets is not None and cfg.bucket_size is None:
            bucket_size = max(1, sum(p.numel() for p in self.module.parameters()) // cfg.num_buckets)
        pp = parallel_state.model_parallel_is_initialized()
        if disable_bucketing or (pp and parallel_state.get_pipeline_model_parallel_rank() > 0):
            bucket_size = None  # as upstream: one bucket per buffer off the critical path
        self.bucket_size = bucket_size
        from megatron.core.distributed.param_layout import upstream_module_order

        params = upstream_module_order([(n, p) for n, p in self.module.named_parameters() if p.requires_grad])
        dist_opt = cfg.use_distributed_optimizer
        if dist_opt:  # the distributed optimizer's one reduce dtype (distrib_optimizer.py)
            dtypes = {p.dtype for p in params}
            one = torch.float32 if cfg.grad_reduce_in_fp32 or len(dtypes) != 1 else next(iter(dtypes), None)
            reduce_dtype_of = lambda p: one  # noqa: E731
        else:
            reduce_dtype_of = lambda p: torch.float32 if cfg.grad_reduce_in_fp32 else p.dtype  # noqa: E731
        groups_ready = self.process_group is not None and ws > 1
        self.buckets = [] if not groups_ready else build_buckets(
            params, self.process_group, self.expert_process_group, ws, bucket_size, reduce_dtype_of,
            reduce_scatter=dist_opt, grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
            pad_for_high_nccl_busbw=cfg.pad_buckets_for_high_nccl_busbw,
            pipelined=pp and parallel_state.get_pipeline_model_parallel_world_size() > 1,
            average_in_collective=cfg.average_in_collective, check_for_nan=cfg.check_for_nan_in_grad,
            names=self.param_to_name)
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._golden: Optional[List[dict]] = None  # per bucket: {param: hook calls} of the first step
        self._next_launch = 0
        self._hooks = []
        self._setup_main_grads()  # its hooks run before _grad_ready's (registration order)
        if cfg.overlap_grad_reduce:
            for p in self._bucket_of:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        if self.use_forward_hook:
            self.enable_forward_pre_hook()

    def enable_forward_pre_hook(self) -> None:
        """Upstream's: register the forward pre-hooks that overlap the parameter all-gathers with the forward
        (``overlap_param_gather``; registered at construction, as upstream)."""
        if not self.use_forward_hook:
            raise RuntimeError("enable_forward_pre_hook: needs overlap_param_gather (--overlap-param-gather)")
        if self._param_gather_hooks:
            raise RuntimeError("enable_forward_pre_hook: the forward pre-hooks are already registered")
        if not self.buckets:
            return
        hooks = [self.module.register_forward_pre_hook(self._dispatch_param_gathers)]
        for m in self.module.modules():
            if any(p in self._bucket_of for p in m.parameters(recurse=False)):
                hooks.append(m.register_forward_pre_hook(self._wait_param_gathers))
        self._param_gather_hooks = hooks

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Upstream's: remove those hooks (evaluation, checkpointing, CUDA-graph capture); ``param_sync``: then
        gather and write every queued parameter now (``start_param_sync(force_sync=True)``)."""
        if not self.use_forward_hook:
            raise RuntimeError("disable_forward_pre_hook: needs overlap_param_gather (--overlap-param-gather)")
        for h in self._param_gather_hooks:
            h.remove()
        self._param_gather_hooks = []
        if param_sync:
            with torch.no_grad():
                self.start_param_sync(force_sync=True)

    def _grad_ready(self, param) -> None:
        """Post-accumulate-grad hook: mark ``param`` ready in the last micro-batch; launch what is complete."""
        if not self._sync_enabled:
            return
        bucket = self._bucket_of[param]
        if bucket.launched:
            raise RuntimeError(
                f"--overlap-grad-reduce: the gradient of {self.param_to_name.get(param, '?')} was accumulated again "
                f"after its bucket (bucket {bucket.index}) started its reduction, in the last micro-batch of a "
                "step: zero_grad_buffer() was not called before the step, or the gradient arrives in more backward "
                "passes than in the first step (then run without --overlap-grad-reduce)")
        bucket.ready[param] = bucket.ready.get(param, 0) + 1
        if self._golden is not None:
            self._launch_ready()

    def _complete(self, bucket: Bucket) -> bool:
        golden = self._golden[bucket.index]
        return bool(golden) and bucket.ready == golden

    def _launch_ready(self) -> None:
        """Launch the complete buckets, in bucket order: a complete bucket waits for the ones before it."""
        while self._next_launch < len(self.buckets) and self._complete(self.buckets[self._next_launch]):
            self.buckets[self._next_launch].launch_grad_reduce()
            self._next_launch += 1

    def _dispatch_param_gathers(self, *unused) -> None:
        """The chunk's forward pre-hook: start every queued parameter all-gather, in bucket order (the same order on
        every rank, all before any wait, so no rank waits for a gather another has not started)."""
        for bucket in self.buckets:
            bucket.start_param_gather()

    def _wait_param_gathers(self, module, *unused) -> None:
        """A module's forward pre-hook: its own parameters' buckets gathered and written back."""
        for p in module.parameters(recurse=False):
            bucket = self._bucket_of.get(p)
            if bucket is not None and bucket.param_gather_pending:
                self._dispatch_param_gathers()
                bucket.finish_param_gather()

    # ---- fp32 gradient accumulation (see the module docstring) ----------------------------------------------
    def _setup_main_grads(self) -> None:
        if not self.ddp_config.grad_reduce_in_fp32:
            return
        low = [p for p in self.module.parameters() if p.requires_grad and p.dtype != torch.float32]
        if not low:
            return
        low_set = set(low)
        for bucket in self.buckets:  # the bucket's flat gradient is the buffer (its fp32 parameters copied in)
            if bucket.reduce_dtype == torch.float32 and any(p in low_set for p in bucket.params):
                buf = torch.zeros(bucket.numel, dtype=torch.float32, device=bucket.device)
                bucket.grad_data = buf
                for p in bucket.params:
                    if p in low_set:
                        o = bucket.offsets[p]
                        self._main_grad_views[p] = bucket.views[p] = buf[o : o + p.numel()].view(p.shape)
        groups: Dict[tuple, list] = {}
        for p in low:
            if p not in self._main_grad_views:
                groups.setdefault((not getattr(p, "allreduce", True), p.device), []).append(p)
        for (is_expert, device), ps in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            buf = torch.zeros(sum(p.numel() for p in ps), dtype=torch.float32, device=device)
            o = 0
            for p in ps:
                self._main_grad_views[p] = buf[o : o + p.numel()].view(p.shape)
                o += p.numel()
            self._main_grad_groups.append((is_expert, buf, ps))
        for p, view in self._main_grad_views.items():
            p.grad_accumulated_into_main_grad = True  # cuda_graphs: the graphed grad buffer is consumed at once
            # the post-accumulate-grad hook: param.grad into its fp32 main_grad view, then freed
            self._main_grad_hooks.append(p.register_post_accumulate_grad_hook(partial(settle_main_grad, view=view)))

    # ---- gradients ---------------------------------------------------------------------------------------
    def _world_size(self) -> int:
        return 1 if self.process_group is None else get_world_size(self.process_group)

    def zero_grad_buffer(self) -> None:
        for p in self.module.parameters():
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad = None
        for bucket in self.buckets:
            bucket.reset()
        self._next_launch = 0

    @contextlib.contextmanager
    def no_sync(self):
        """Inside ``no_sync`` gradients only accumulate: no bucket is launched and ``finish_grad_sync`` does
        nothing (upstream's gradient accumulation: only the last micro-batch communicates)."""
        old, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = old

    def start_grad_sync(self, *unused) -> None:
        """Launch the reduction of every bucket not launched yet (in bucket order; asynchronous)."""
        for bucket in self.buckets[self._next_launch :]:
            bucket.launch_grad_reduce()
        self._next_launch = len(self.buckets)

    def start_param_sync(self, *unused, force_sync: bool = False, **unused_kw) -> None:
        """Start the queued parameter all-gathers (``overlap_param_gather``); ``force_sync``: and wait for them."""
        self._dispatch_param_gathers()
        if force_sync:
            self.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for every queued parameter all-gather and write the parameters (before they are read outside the
        forward pass: checkpoints, loads)."""
        self._dispatch_param_gathers()
        for bucket in self.buckets:
            bucket.finish_param_gather()

    @torch.no_grad()
    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Average the gradients over the data-parallel group (fp32 when ``grad_reduce_in_fp32``); expert
        parameters: sum over the expert-data-parallel group / data-parallel size. With ``overlap_grad_reduce``:
        launch the buckets not launched yet and wait for all (reduce-scatter for the distributed optimizer, whose
        buckets it reads). Without it and with ``use_distributed_optimizer`` nothing happens here: the
        DistributedOptimizer reduce-scatters the grads in its step. ``force_all_reduce`` (upstream's keyword) is
        accepted; the distributed optimizer's buckets always reduce-scatter."""
        if not self._sync_enabled:
            return
        rest = None
        if self.buckets:
            self.finish_param_sync()  # gathers of parameters no forward pre-hook waited for
            self.start_grad_sync()
            for bucket in self.buckets:
                bucket.finish_grad_reduce()
            check_reduced_grads(self.buckets)
            if self._golden is None and self.ddp_config.overlap_grad_reduce:
                self._golden = [dict(b.ready) for b in self.buckets]
            rest = [p for p in self.module.parameters() if p.requires_grad and p not in self._bucket_of]
        if self._world_size() == 1 or self.ddp_config.use_distributed_optimizer:
            return
        self._reduce_now(rest)

    @torch.no_grad()
    def _reduce_now(self, params=None) -> None:
        """Without overlap: one all-reduce per (expert, dtype) of ``params`` (default all trainable ones)."""
        ws = self._world_size()
        if params is None:
            params = [p for p in self.module.parameters() if p.requires_grad]
        # fp32-accumulated parameters are reduced in place, a buffer each; their groups hold exactly the bf16 / fp16
        # parameters outside buckets, so ``params`` (all, or those outside buckets) holds each group whole
        in_groups = {p for _, _, ps in self._main_grad_groups for p in ps}
        nonfinite = []
        for is_expert, buf, ps in self._main_grad_groups:
            for p in ps:
                settle_main_grad(p, self._main_grad_views[p])
            group = self.expert_process_group if is_expert else self.process_group
            if dist.get_world_size(group) > 1:
                dist.all_reduce(buf, group=group)
            buf.div_(ws)
            if self.ddp_config.check_for_nan_in_grad:
                nonfinite.append(~torch.isfinite(buf).all())
        params = [p for p in params if p not in in_groups]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        buckets: Dict[tuple, list] = {}
        for p in params:
            dtype = torch.float32 if self.ddp_config.grad_reduce_in_fp32 else p.grad.dtype
            buckets.setdefault((not getattr(p, "allreduce", True), dtype, p.grad.device), []).append(p)
        for (is_expert, dtype, _), ps in sorted(buckets.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            flat = torch.cat([p.grad.reshape(-1).to(dtype) for p in ps])
            group = self.expert_process_group if is_expert else self.process_group
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flat, group=group)
            flat.div_(ws)
            offset = 0
            for p in ps:
                n = p.grad.numel()
                reduced = flat[offset : offset + n].view_as(p.grad)
                if reduced.dtype != p.grad.dtype:
                    p.main_grad = reduced  # fp32 reduced grad of a bf16/fp16 param; the optimizer prefers it
                else:
                    p.grad.copy_(reduced)
                offset += n
            if self.ddp_config.check_for_nan_in_grad:
                nonfinite.append(~torch.isfinite(flat).all())
        if nonfinite and bool(torch.stack(nonfinite).any()):  # one host read for all of them
            raise RuntimeError("DistributedDataParallel: NaN/Inf in the reduced gradients (--check-for-nan-in-grad)")

    @torch.no_grad()
    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply the gradients the optimizer reads (``main_grad`` where set, else ``grad``)."""
        for p in self.module.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                g.mul_(scaling_factor)

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Make every rank's parameters and buffers equal to data-parallel rank 0's."""
        if self._world_size() == 1:
            return
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            group = self.process_group if getattr(t, "allreduce", True) else self.expert_process_group
            if dist.get_world_size(group) > 1:
                dist.broadcast(t.data, src=dist.get_global_rank(group, 0), group=group)
