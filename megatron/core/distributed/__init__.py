"""Data parallelism: plain DDP, Megatron-FSDP (on FSDP2), their config, finalize_model_grads."""
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.fsdp import FullyShardedDataParallel

__all__ = [
    "DistributedDataParallelConfig",
    "DistributedDataParallel",
    "FullyShardedDataParallel",
    "finalize_model_grads",
]
