"""DistributedDataParallelConfig: upstream field names (``--use-megatron-fsdp``, ``--fp8-param-gather``, ...)."""
from dataclasses import dataclass
from typing import Optional

_SHARDING = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass
class DistributedDataParallelConfig:
    grad_reduce_in_fp32: bool = False
    """Reduce gradients in fp32 (DDP). Megatron-FSDP with bf16/fp16 always reduces in fp32."""
    overlap_grad_reduce: bool = False
    """Reduce gradient buckets asynchronously during the backward pass (DDP all-reduce, distributed optimizer
    reduce-scatter; ``param_and_grad_buffer.py``); Megatron-FSDP: FSDP2 overlaps its reduce-scatters itself."""
    overlap_param_gather: bool = False
    """Distributed optimizer (needs ``overlap_grad_reduce``): the step's parameter all-gathers run before the next
    forward, each bucket waited for by the first module that uses it."""
    align_param_gather: bool = False
    """With ``overlap_param_gather`` and an interleaved pipeline: every chunk's gathers start together at the start
    of the step (``config.param_sync_func``), else at each chunk's first forward."""
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    check_for_nan_in_grad: bool = False
    check_for_large_grads: bool = False
    bucket_size: Optional[int] = None
    """Elements per gradient bucket with ``overlap_grad_reduce`` (None: upstream's max(4e7, 1e6 x DP)); ignored
    without it (one bucket per buffer), past the first pipeline stage and for later model chunks, as upstream."""
    num_buckets: Optional[int] = None
    """``--ddp-num-buckets``: instead of ``bucket_size``, the parameters / num_buckets elements per bucket (the
    training loop counts every model chunk of the rank, as upstream; a DDP built directly counts its own)."""
    pad_buckets_for_high_nccl_busbw: bool = False
    average_in_collective: bool = False
    """Average in the collective (NCCL's AVG; experts pre-scaled by expert-DP / DP) instead of dividing by the
    data-parallel size after the sum (gloo has no AVG: it divides, the same values)."""
    fp8_param_gather: bool = False
    """All-gather FP8 (TE quantized) weights; with Megatron-FSDP through TE's FSDP2 tensor hooks (GPU + TE)."""
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    use_megatron_fsdp: bool = False
    use_custom_fsdp: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    """'no_shard' | 'optim' | 'optim_grads' | 'optim_grads_params': what Megatron-FSDP (use_megatron_fsdp) shards;
    ``wrap_data_parallel`` (data_parallel_wrapper.py) picks the wrapper for each. ``FullyShardedDataParallel``
    built directly treats 'no_shard' (this default) as 'optim_grads_params'."""
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: Optional[int] = None
    """Megatron-FSDP (``--suggested-communication-unit-size``): consecutive transformer layers whose parameters total
    at most this many elements become one FSDP2 unit (one all-gather and one reduce-scatter for all of them). Upstream
    uses the same flag as its bucket / prefetch budget; joining layers is how FSDP2 batches communication. None: one
    unit per layer, or 2**29 elements with one data-parallel rank (``fsdp.default_unit_size``)."""
    preserve_fp32_weights: bool = True
    """Megatron-FSDP: keep the sharded (main) parameters in fp32 when compute is bf16/fp16."""
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    outer_dp_sharding_strategy: str = "no_shard"
    disable_symmetric_registration: bool = False
    delay_wgrad_compute: bool = False

    def __post_init__(self):
        if self.data_parallel_sharding_strategy not in _SHARDING:
            raise ValueError(
                f"data_parallel_sharding_strategy (--data-parallel-sharding-strategy) must be one of {_SHARDING}, "
                f"got {self.data_parallel_sharding_strategy!r}"
            )
        if self.num_buckets is not None and (self.bucket_size is not None or self.num_buckets <= 0):
            raise ValueError(f"num_buckets (--ddp-num-buckets={self.num_buckets}) must be positive and not given with "
                             f"bucket_size (--ddp-bucket-size={self.bucket_size})")
        size = self.suggested_communication_unit_size
        if size is not None and size <= 0:
            raise ValueError("suggested_communication_unit_size: --suggested-communication-unit-size must be a "
                             f"positive number of elements, got {size}")
