"""Upstream's import path for the buffer layout (``megatron.core.optimizer.param_layout``): the layout lives in
``megatron/core/distributed/param_layout.py``, beside the DDP buffers that are cut by it and below the optimizer."""
from megatron.core.distributed.param_layout import (  # noqa: F401
    BucketLayout,
    BufferLayout,
    FullParamLayout,
    bucket_end_alignment,
    buffer_layouts,
    upstream_module_order,
)
