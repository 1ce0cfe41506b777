"""Megatron-FSDP on PyTorch FSDP2, with meta-device initialisation that never clobbers real tensors."""
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel  # upstream's signature
from megatron.core.distributed.fsdp.meta_init import (
    copy_param_attributes,
    materialize_meta_module,
    materialize_meta_tensors,
    remap_param_keyed_maps,
)
from megatron.core.dtensor_utils import chunk_range  # torch.chunk's arithmetic, shared with the sharded state dict

__all__ = [
    "FullyShardedDataParallel",
    "chunk_range",
    "copy_param_attributes",
    "materialize_meta_module",
    "materialize_meta_tensors",
    "remap_param_keyed_maps",
]
