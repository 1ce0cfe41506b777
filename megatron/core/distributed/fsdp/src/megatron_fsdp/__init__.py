"""Upstream's import path of the Megatron-FSDP package (``megatron.core.distributed.fsdp.src.megatron_fsdp``).

This fork's Megatron-FSDP lives in ``megatron/core/distributed/fsdp/`` (FSDP2); here are the names of upstream's
package that map onto it: ``DistributedDataParallelConfig`` and ``MegatronFSDP`` (the engine: this fork's
``fully_sharded_data_parallel.FullyShardedDataParallel``, which the adapter ``mcore_fsdp_adapter.
FullyShardedDataParallel`` subclasses; its constructor is the fork's, not upstream's engine's). Upstream's
``fully_shard`` API and the ``fsdp_dtensor`` checkpoint helpers are not provided (importing them raises
ImportError, which upstream's callers treat as "Megatron-FSDP not installed").
"""
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel as MegatronFSDP

__all__ = ["DistributedDataParallelConfig", "MegatronFSDP"]
