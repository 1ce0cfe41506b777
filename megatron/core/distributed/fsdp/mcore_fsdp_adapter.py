"""Upstream's Megatron-FSDP entry class, ``megatron.core.distributed.fsdp.mcore_fsdp_adapter.FullyShardedDataParallel``.

``FullyShardedDataParallel(config, ddp_config, module, fsdp_unit_modules=None, disable_bucketing=False, device=None,
pg_collection=None)``: upstream's signature over this fork's Megatron-FSDP on FSDP2
(``fully_sharded_data_parallel.py``, whose keywords ``process_group``, ``param_keyed_maps`` and
``reshard_after_forward`` are accepted too). ``megatron.core.distributed.FullyShardedDataParallel`` is this class.

Differences from upstream's adapter, by design: ``.module`` is the wrapped model itself (upstream puts its
``MegatronFSDP`` engine in between; ``unwrap_model`` / ``get_model_config`` give the same model either way);
``disable_bucketing`` has no effect (FSDP2 communicates per unit, there are no buckets); ``pg_collection``'s
data-parallel group (``dp_cp``) is used, and the expert / hybrid-sharding groups come from ``parallel_state``
(a collection whose expert-DP group differs from it is refused by name).
"""
from typing import List, Optional

import torch

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel as _MegatronFSDP


class FullyShardedDataParallel(_MegatronFSDP):
    """Megatron-FSDP with upstream's constructor (see the module docstring)."""

    def __init__(
        self,
        config,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        fsdp_unit_modules: Optional[List[type]] = None,
        disable_bucketing: bool = False,
        device: Optional[torch.device] = None,
        pg_collection=None,
        **fork_kwargs,
    ):
        unknown = set(fork_kwargs) - {"process_group", "param_keyed_maps", "reshard_after_forward"}
        if unknown:
            raise TypeError(f"FullyShardedDataParallel: unexpected keyword argument(s) {sorted(unknown)}")
        if pg_collection is not None:
            from megatron.core.process_groups_config import check_mpu_groups

            if fork_kwargs.get("process_group") is not None:
                raise ValueError("FullyShardedDataParallel: give pg_collection= or process_group=, not both")
            # expert-DP and hybrid-sharding groups are parallel_state's (see the module docstring)
            check_mpu_groups(pg_collection, "FullyShardedDataParallel",
                             names=("expt_dp", "intra_dp_cp", "intra_expt_dp", "inter_dist_opt"))
            from megatron.core import parallel_state
            from megatron.core.process_groups_config import _same_group

            dense = pg_collection.dp_cp if pg_collection.dp_cp is not None else pg_collection.dp
            if dense is not None and not _same_group(dense, parallel_state.get_data_parallel_group(
                    with_context_parallel=True)):
                fork_kwargs["process_group"] = dense
        self.disable_bucketing = disable_bucketing
        self.pg_collection = pg_collection
        super().__init__(config, ddp_config, module, fsdp_unit_modules=fsdp_unit_modules, device=device,
                         **fork_kwargs)
