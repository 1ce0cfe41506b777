"""One home for choosing the data-parallel wrapper from ``--data-parallel-sharding-strategy``.

Without ``use_megatron_fsdp`` the model is wrapped in ``DistributedDataParallel`` (its own
``use_distributed_optimizer`` decides whether the optimizer shards its state). Under ``use_megatron_fsdp`` the
four strategies of upstream's Megatron-FSDP map onto this repo's machinery:

- ``optim_grads_params`` (ZeRO-3): ``FullyShardedDataParallel`` (FSDP2), parameters resharded after forward and
  all-gathered again for backward; parameters, gradients and optimizer state are 1/DP per rank.
- ``optim_grads`` (ZeRO-2): ``FullyShardedDataParallel`` with FSDP2 ``reshard_after_forward=False``: the
  parameters are all-gathered once per step (before forward) and kept unsharded until the end of backward, then
  freed (FSDP2 reshards after backward); gradients are reduce-scattered (1/DP), optimizer state is 1/DP. The
  stored parameters between steps are FSDP2's 1/DP shards (the optimizer updates them).
- ``optim`` (ZeRO-1): ``DistributedDataParallel`` (full parameters and gradients on every rank) with
  ``use_distributed_optimizer=True``: ``get_megatron_optimizer`` then builds the ``DistributedOptimizer``, which
  reduce-scatters the gradients, keeps 1/DP of the fp32 main params and optimizer state, and all-gathers params.
- ``no_shard``: ``DistributedDataParallel`` with gradients all-reduced and a plain (replicated) optimizer.

The ``DistributedDataParallel`` of ``optim`` / ``no_shard`` gets a copy of the config with ``use_megatron_fsdp``
off (its fields then say what the wrapper does) and keeps ``data_parallel_sharding_strategy``. Meta-device init
works for every strategy: both wrappers materialise the model (``fsdp/meta_init.py``). Checkpoint keys are the
unwrapped model's in every case, so a checkpoint saved under one strategy loads under another.
"""
import dataclasses

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig

FSDP2_STRATEGIES = ("optim_grads", "optim_grads_params")
DDP_STRATEGIES = ("no_shard", "optim")


def effective_ddp_config(ddp_config: DistributedDataParallelConfig) -> DistributedDataParallelConfig:
    """The config the chosen wrapper runs with (see the module docstring); unchanged for FSDP2 and plain DDP."""
    strategy = ddp_config.data_parallel_sharding_strategy
    if not ddp_config.use_megatron_fsdp or strategy in FSDP2_STRATEGIES:
        return ddp_config
    return dataclasses.replace(ddp_config, use_megatron_fsdp=False, use_distributed_optimizer=strategy == "optim")


def resolve_num_buckets(ddp_config: DistributedDataParallelConfig, chunks) -> DistributedDataParallelConfig:
    """``num_buckets`` (``--ddp-num-buckets``) as upstream's training loop resolves it: ``bucket_size`` = the
    parameters of all of this rank's model chunks // num_buckets."""
    if ddp_config.num_buckets is None:
        return ddp_config
    total = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    return dataclasses.replace(ddp_config, bucket_size=max(1, total // ddp_config.num_buckets), num_buckets=None)


def wrap_data_parallel(config, ddp_config: DistributedDataParallelConfig, module, **kwargs):
    """Wrap ``module`` as ``ddp_config`` asks (``use_megatron_fsdp`` and ``data_parallel_sharding_strategy``);
    ``kwargs`` (``process_group``, ``param_keyed_maps``) go to the wrapper."""
    eff = effective_ddp_config(ddp_config)
    if eff.use_megatron_fsdp:
        from megatron.core.distributed.fsdp import FullyShardedDataParallel

        kwargs.pop("disable_bucketing", None)  # FSDP2 units, no buckets

        return FullyShardedDataParallel(config=config, ddp_config=eff, module=module, **kwargs)
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

    return DistributedDataParallel(config=config, ddp_config=eff, module=module, **kwargs)
