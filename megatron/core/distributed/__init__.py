"""Data parallelism: plain DDP, Megatron-FSDP (on FSDP2), their config, finalize_model_grads."""
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.fsdp import FullyShardedDataParallel
from megatron.core.distributed.data_parallel_wrapper import effective_ddp_config, wrap_data_parallel

__all__ = [
    "DistributedDataParallelConfig",
    "DistributedDataParallel",
    "FullyShardedDataParallel",
    "effective_ddp_config",
    "finalize_model_grads",
    "wrap_data_parallel",
]
