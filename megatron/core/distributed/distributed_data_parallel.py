"""Plain data parallelism (runs without ``--use-megatron-fsdp``): full replicas, gradients all-reduced.

Gradients accumulate in ``param.grad`` during the backward passes of a step (no hooks, so gradient accumulation
over micro-batches needs nothing); ``finish_grad_sync()`` (called by ``finalize_model_grads``) averages them over
the data-parallel group in flat buckets, one collective per dtype. Parameters whose gradient is ``None`` on this
rank take part with zeros, so ranks never disagree on collective sizes. Expert parameters (``allreduce=False``, held
by one expert-parallel rank) are summed over the expert-data-parallel group instead and divided by the data-parallel
size, as upstream (each expert's gradient already sums the contributions of the tokens of every EP rank).
"""
import contextlib
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_utils import default_device, get_world_size
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.meta_init import has_meta_tensors, materialize_meta_module
from megatron.core.transformer.module import MegatronModule


class DistributedDataParallel(MegatronModule):
    """``DistributedDataParallel(config, ddp_config, module, disable_bucketing=False, process_group=None)``; upstream's
    ``pg_collection=`` / ``full_param_layout=`` keywords are accepted (see ``__init__``).

    ``.module`` is the wrapped model; ``forward`` passes through; ``state_dict`` / ``load_state_dict`` /
    ``sharded_state_dict`` are the unwrapped model's (same keys). A model built on the meta device is
    materialised here (see ``fsdp/meta_init.py``); ``param_keyed_maps`` are remapped to the new parameters.
    """

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
        if getattr(config, "init_model_with_meta_device", False) or has_meta_tensors(module):
            self.old_to_new_params = materialize_meta_module(module, default_device(), maps=param_keyed_maps)
        self.param_to_name = {p: n for n, p in module.named_parameters()}
        self._sync_enabled = True

    # ---- forward / state ---------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return self.module.sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)

    # ---- gradients ---------------------------------------------------------------------------------------
    def _world_size(self) -> int:
        return 1 if self.process_group is None else get_world_size(self.process_group)

    def zero_grad_buffer(self) -> None:
        for p in self.module.parameters():
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad = None

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients are only reduced in ``finish_grad_sync``; inside ``no_sync`` that call does nothing."""
        old, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = old

    def start_grad_sync(self, *unused) -> None:
        pass

    def start_param_sync(self, *unused, **unused_kw) -> None:
        pass

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Average ``param.grad`` over the data-parallel group (fp32 when ``grad_reduce_in_fp32``); expert
        parameters: sum over the expert-data-parallel group / data-parallel size. With ``use_distributed_optimizer``
        nothing happens here: the DistributedOptimizer reduce-scatters the grads."""
        ws = self._world_size()
        if not self._sync_enabled or ws == 1 or self.ddp_config.use_distributed_optimizer:
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
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
            if self.ddp_config.check_for_nan_in_grad and not torch.isfinite(flat).all():
                raise RuntimeError("DistributedDataParallel: NaN/Inf in the reduced gradients (--check-for-nan-in-grad)")

    @torch.no_grad()
    def scale_gradients(self, scaling_factor: float) -> None:
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(scaling_factor)

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Make every rank's parameters and buffers equal to data-parallel rank 0's."""
        if self._world_size() == 1:
            return
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            group = self.process_group if getattr(t, "allreduce", True) else self.expert_process_group
            if dist.get_world_size(group) > 1:
                dist.broadcast(t.data, src=dist.get_global_rank(group, 0), group=group)
