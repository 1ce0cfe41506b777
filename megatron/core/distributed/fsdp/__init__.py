"""Megatron-FSDP on PyTorch FSDP2, with meta-device initialisation that never clobbers real tensors."""
from megatron.core.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel, chunk_range
from megatron.core.distributed.fsdp.meta_init import (
    copy_param_attributes,
    materialize_meta_module,
    materialize_meta_tensors,
    remap_param_keyed_maps,
)

__all__ = [
    "FullyShardedDataParallel",
    "chunk_range",
    "copy_param_attributes",
    "materialize_meta_module",
    "materialize_meta_tensors",
    "remap_param_keyed_maps",
]
