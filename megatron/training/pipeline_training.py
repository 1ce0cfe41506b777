"""The training loop's pipeline-parallel parts (``--pipeline-model-parallel-size`` > 1): this rank's stage as model
chunks, and one iteration through ``megatron.core.pipeline_parallel.get_forward_backward_func()`` with upstream's
arguments, its lm loss taken on the last stage and broadcast over the pipeline group so every rank (rank 0 logs
it) holds the value of its data-parallel replica.

Every stage reads the micro-batches from its own iterator (one per model chunk, all from the same position):
the first stage uses the tokens and positions, the last the labels and loss mask, the others read and drop them.
"""
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_utils import default_device
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.schedules import get_model_config


def build_pipeline_model_chunks(build: Callable, config, args, wrap_with_ddp: bool = True) -> list:
    """This rank's model chunks: one per virtual stage (``args.virtual_pipeline_model_parallel_size``, else one),
    each ``build(pre_process=, post_process=, vp_stage=)`` for its place in the pipeline, wrapped like the
    one-stage model (``wrap_data_parallel``)."""
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for c in range(vpp or 1):
        vp = c if vpp else None
        chunks.append(build(pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=vp),
                            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=vp),
                            vp_stage=vp))
    if parallel_state.get_data_parallel_rank() == 0:
        n = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        print(f" > number of parameters on (tensor, pipeline) model parallel rank "
              f"({parallel_state.get_tensor_model_parallel_rank()}, "
              f"{parallel_state.get_pipeline_model_parallel_rank()}): {n}", flush=True)
    if not wrap_with_ddp:
        return chunks
    from megatron.core.distributed.data_parallel_wrapper import wrap_data_parallel
    from megatron.training.arguments import ddp_config_from_args

    # as upstream: only the first model chunk's gradients are bucketed (the later chunks' reduce off the critical path)
    from megatron.core.distributed.data_parallel_wrapper import resolve_num_buckets

    ddp_config = resolve_num_buckets(ddp_config_from_args(args), chunks)
    return [wrap_data_parallel(config, ddp_config, chunk, disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]


def broadcast_from_last_stage(value: torch.Tensor) -> torch.Tensor:
    """``value`` of the last pipeline stage on every rank of this pipeline (a float32 scalar)."""
    value = value.detach().float().reshape(1).to(default_device())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(value, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    return value.reshape(())


def _lm_loss(reported: dict) -> torch.Tensor:
    value = reported["lm loss"] if isinstance(reported, dict) else reported
    value = torch.as_tensor(value).detach().float()
    if value.numel() == 2:  # (loss sum, tokens), upstream's per-token form
        value = value[0] / value[1]
    return value.reshape(())


def _set_sync_funcs(config, model: list, args) -> None:
    """Upstream's training-loop settings of the schedule's hooks under ``--overlap-grad-reduce``: ``no_sync_func``
    (every chunk's ``no_sync``: only the last micro-batch's backward communicates), ``grad_sync_func`` (a chunk's
    reduction starts after its last backward), with ``--overlap-param-gather`` and ``align_param_gather``
    ``param_sync_func`` (every chunk's parameter all-gathers start together at the beginning of the step)."""
    from megatron.core.distributed import DistributedDataParallel

    # as upstream, only with --overlap-grad-reduce (without it gradients are reduced once, at the end); Megatron-FSDP
    # (FSDP2) chunks keep accumulating as they do without it
    if not getattr(args, "overlap_grad_reduce", False) or not all(
            isinstance(chunk, DistributedDataParallel) for chunk in model):
        return
    one = len(model) == 1
    config.no_sync_func = model[0].no_sync if one else [chunk.no_sync for chunk in model]
    config.grad_sync_func = model[0].start_grad_sync if one else [chunk.start_grad_sync for chunk in model]
    if getattr(args, "overlap_param_gather", False) and getattr(args, "align_param_gather", False):
        config.param_sync_func = model[0].start_param_sync if one else [chunk.start_param_sync for chunk in model]


def pipeline_forward_backward(forward_step_func, data_iterator, model: list, optimizer: Optional[object],
                              forward_only: bool) -> List[torch.Tensor]:
    """One iteration's forward (and backward) of ``args.num_microbatches`` micro-batches through the pipeline
    schedule; the gradients are finalized by the schedule (``finalize_model_grads``: DP, sequence-parallel and
    tied-embedding sums). ``optimizer``'s loss scale (``--fp16``) scales the loss. Returns ``[lm loss]``: the mean
    over this data-parallel replica's micro-batches, on every stage."""
    from megatron.training.global_vars import get_args

    args = get_args()
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    get_loss_scale = getattr(optimizer, "get_loss_scale", None)
    for chunk in model:
        config = get_model_config(chunk)
        config.finalize_model_grads_func = finalize_model_grads
        _set_sync_funcs(config, model, args)
        config.grad_scale_func = None
        if callable(get_loss_scale):
            config.grad_scale_func = lambda loss: loss * get_loss_scale().to(loss.device).reshape(())
    reported = get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model,
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=forward_only,
    )
    if parallel_state.is_pipeline_last_stage():
        local = torch.stack([_lm_loss(r) for r in reported]).mean()
    else:
        local = torch.zeros(())
    return [broadcast_from_last_stage(local)]
