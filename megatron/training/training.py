"""The training loop: ``pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func)``.

Data order: iteration ``i`` uses global samples ``[i*G, (i+1)*G)`` (``G`` = global batch size) of the train
dataset, cut into ``G / (m*D)`` micro-steps of ``m*D`` consecutive samples (``m`` micro-batch size, ``D``
data-parallel size); DP rank ``r`` takes samples ``[r*m, (r+1)*m)`` of each micro-step. The position is
``args.consumed_train_samples``, saved in the checkpoint, so a resumed run sees exactly the samples an
uninterrupted one would, and a different DP size sees the same global batches.
"""
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.dist_utils import default_device, get_rank
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training.arguments import (
    core_transformer_config_from_args,
    ddp_config_from_args,
    optimizer_config_from_args,
)
from megatron.training.checkpoint_safety import check_save_dir
from megatron.training.checkpointing import (check_save_target, load_checkpoint, maybe_finalize_async_save,
                                             non_persistent_dir, save_checkpoint, warm_up_async_save)
from megatron.training.global_vars import get_args, get_scalar_writer
from megatron.training.initialize import initialize_megatron
from megatron.training.profiling import TrainingProfiler
from megatron.training.run_control import RunControl
from megatron.training.utils import (
    average_losses_across_data_parallel_group,
    current_rss_bytes,
    memory_report,
    print_rank_0,
    TrainingStopped,
)

from megatron.core.enums import ModelType  # noqa: F401 (upstream's training imports it from here)


_TRAIN_START_TIME = None  # when pretrain() started (--exit-duration-in-mins)


@dataclass
class TrainingResult:
    """What ``pretrain`` returns (upstream returns nothing): the final iteration, the per-iteration lm loss
    (float32 value, averaged over micro-batches and DP ranks) and grad norm, the wrapped model and optimizer."""

    iteration: int = 0
    losses: Dict[int, float] = field(default_factory=dict)
    grad_norms: Dict[int, float] = field(default_factory=dict)
    learning_rates: Dict[int, float] = field(default_factory=dict)
    params_norms: Dict[int, Optional[float]] = field(default_factory=dict)
    """--log-params-norm: the parameter norm at each log iteration."""
    num_zeros: Dict[int, Optional[int]] = field(default_factory=dict)
    """--log-num-zeros-in-grad: zero gradient values at each log iteration."""
    loss_scales: Dict[int, float] = field(default_factory=dict)
    """The loss scale each iteration used (1.0 without --fp16)."""
    moe_losses: Dict[int, Dict[str, float]] = field(default_factory=dict)
    """MoE auxiliary losses of each iteration, without their coefficients (``load_balancing_loss`` with
    --moe-aux-loss-coeff, ``z_loss`` with --moe-z-loss-coeff): means over MoE layers, micro-batches and DP ranks."""
    skipped_iterations: int = 0
    """Iterations whose optimizer step was skipped (inf/nan gradients)."""
    valid_losses: Dict[int, float] = field(default_factory=dict)
    cuda_graph_regions: List[str] = field(default_factory=list)
    """--cuda-graph-impl: the layer regions replayed as CUDA graphs (e.g. 'layer 1 attn'), empty without graphs."""
    cuda_graph_replays: int = 0
    """--cuda-graph-impl: graph replays in training forwards (regions x micro-batches x replayed iterations)."""
    exit_reason: Optional[str] = None
    """Why training stopped before --train-iters (SIGTERM, --exit-duration-in-mins, --exit-interval), else None."""
    interrupted: bool = False
    """Stopped by SIGTERM (--exit-signal-handler) or --exit-duration-in-mins: no final evaluation."""
    final_valid_loss: Optional[float] = None
    test_loss: Optional[float] = None
    model: list = None
    optimizer: object = None
    opt_param_scheduler: object = None


# ---- model / optimizer --------------------------------------------------------------------------------------
def get_model(model_provider_func, model_type=ModelType.encoder_or_decoder, wrap_with_ddp=True):
    """Build the model (under ``torch.device('meta')`` with ``--init-model-with-meta-device``), then wrap it in
    ``FullyShardedDataParallel`` or ``DistributedDataParallel`` as ``--use-megatron-fsdp`` and
    ``--data-parallel-sharding-strategy`` ask (both materialize a meta model). Returns a list with one model chunk."""
    args = get_args()
    config = core_transformer_config_from_args(args)
    device = default_device()

    def build(**stage):  # stage: pre_process, post_process (and vp_stage) of this rank's model chunk
        if config.init_model_with_meta_device:
            with torch.device("meta"):
                return model_provider_func(**stage)
        if device.type == "cuda" and not args.use_cpu_initialization:
            with torch.device(device):
                return model_provider_func(**stage)
        return model_provider_func(**stage).to(device)

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # this rank's stage (virtual chunks: several)
        from megatron.training.pipeline_training import build_pipeline_model_chunks

        return build_pipeline_model_chunks(build, config, args, wrap_with_ddp)
    model = build(pre_process=True, post_process=True)
    if parallel_state.get_data_parallel_rank() == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f" > number of parameters on data-parallel rank 0: {n}", flush=True)
    if not wrap_with_ddp:
        return [model]
    from megatron.core.distributed.data_parallel_wrapper import wrap_data_parallel

    # --data-parallel-sharding-strategy under --use-megatron-fsdp picks FSDP2 (optim_grads[_params]) or DDP
    # (optim with the distributed optimizer, no_shard): see data_parallel_wrapper.py
    from megatron.core.distributed.data_parallel_wrapper import resolve_num_buckets

    wrapped = wrap_data_parallel(config, resolve_num_buckets(ddp_config_from_args(args), [model]), model)
    groups = getattr(wrapped, "unit_groups", None)
    if groups is not None:  # Megatron-FSDP: which modules share one FSDP2 unit (--suggested-communication-unit-size)
        joined = [f"{g[0]}..{g[-1].rsplit('.', 1)[-1]}" if len(g) > 1 else g[0] for g in groups]
        print_rank_0(f" > Megatron-FSDP units (besides the root): {len(groups)}: {', '.join(joined)}")
    return [wrapped]


def get_optimizer_param_scheduler(optimizer) -> OptimizerParamScheduler:
    """The schedule counted in samples (upstream's convention): from the ``--lr-*-iters`` x global batch size,
    or the ``--lr-*-samples`` with ``--train-samples``; ``--lr-warmup-fraction`` x the decay steps warms up."""
    args = get_args()
    gbs = args.global_batch_size
    if getattr(args, "train_samples", None) is not None:
        decay_steps, warmup_steps, wd_steps = args.lr_decay_samples, args.lr_warmup_samples, args.train_samples
    else:
        decay_steps, warmup_steps = args.lr_decay_iters * gbs, args.lr_warmup_iters * gbs
        wd_steps = args.train_iters * gbs
    if getattr(args, "lr_warmup_fraction", None) is not None:
        warmup_steps = int(args.lr_warmup_fraction * decay_steps)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=max(wd_steps, 1),
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )


def setup_model_and_optimizer(model_provider_func, model_type=ModelType.encoder_or_decoder):
    args = get_args()
    from megatron.core.transformer.cuda_graphs import use_capture_stream

    use_capture_stream(args.cuda_graph_impl)  # before the model and its data-parallel hooks exist
    model = get_model(model_provider_func, model_type)
    from megatron.core.optimizer import get_megatron_optimizer

    optimizer = get_megatron_optimizer(optimizer_config_from_args(args), model)
    opt_param_scheduler = get_optimizer_param_scheduler(optimizer)
    args.iteration, args.num_floating_point_operations_so_far = 0, 0
    if args.load or args.pretrained_checkpoint:
        start = time.time()
        args.iteration, args.num_floating_point_operations_so_far = load_checkpoint(
            model, optimizer, opt_param_scheduler
        )
        if args.iteration > 0 or args.finetune:
            _report_checkpoint_io("load", args.load or args.pretrained_checkpoint, time.time() - start,
                                  args.iteration)
    return model, optimizer, opt_param_scheduler


# ---- checkpoint timing, TensorBoard, throughput ----------------------------------------------------------
def _checkpoint_bytes(ckpt_dir: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(ckpt_dir):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def _report_checkpoint_io(kind: str, base_dir: str, seconds: float, iteration: int) -> str:
    """Print (global rank 0) and write to TensorBoard how long a checkpoint save/load of ``iteration`` took, its
    bytes on disk and the rate. ``kind``: 'save' or 'load'."""
    line = ""
    if get_rank() == 0:
        step_dir = os.path.join(base_dir, f"iter_{iteration:07d}")
        size = _checkpoint_bytes(step_dir) if os.path.isdir(step_dir) else 0
        rate = size / seconds / 1e9 if seconds > 0 else 0.0
        verb = "saved" if kind == "save" else "loaded"
        line = (f" {verb} checkpoint iteration {iteration} {'to' if kind == 'save' else 'from'} {base_dir} in "
                f"{seconds:.2f} s ({size / 1e6:.1f} MB, {rate:.3f} GB/s)")
        print(line, flush=True)
    writer = get_scalar_writer()
    if writer is not None:
        writer.add_scalar(f"{kind}-checkpoint-time", seconds, iteration)
    return line


def num_floating_point_operations(args, batch_size: int) -> float:
    """Model FLOPs of one training iteration over ``batch_size`` sequences: 3 x forward (forward + backward),
    forward = 2 x (matmul parameters used per token) x tokens + attention scores and values (4 x seq x heads x
    head dim per token and layer, the full square as upstream counts it) + the output layer (2 x hidden x
    padded vocab per token). No recomputation; MoE layers count the top-k experts and the router."""
    h, s, layers = args.hidden_size, args.seq_length, args.num_layers
    heads = args.num_attention_heads
    head_dim = args.kv_channels or h // heads
    groups = args.num_query_groups if args.group_query_attention else heads
    attn_params = h * head_dim * (heads + 2 * groups) + heads * head_dim * h
    gate = 2 if args.swiglu or getattr(args, "quick_geglu", False) else 1

    def mlp(ffn):
        return h * ffn * gate + ffn * h

    if args.num_experts is not None:
        moe = args.moe_router_topk * mlp(args.moe_ffn_hidden_size) + h * args.num_experts
        from megatron.core.transformer.transformer_layer import is_moe_layer

        freq = SimpleNamespace(num_moe_experts=args.num_experts, moe_layer_freq=args.moe_layer_freq)
        n_moe = sum(is_moe_layer(freq, i) for i in range(1, layers + 1))
        mlp_params = n_moe * moe + (layers - n_moe) * mlp(args.ffn_hidden_size)
    else:
        mlp_params = layers * mlp(args.ffn_hidden_size)
    per_token = 2 * (layers * attn_params + mlp_params) + layers * 4 * s * heads * head_dim
    per_token += 2 * h * args.padded_vocab_size
    return 3.0 * per_token * batch_size * s


def _memory_scalars() -> Dict[str, float]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"mem-allocated-bytes": float(torch.cuda.memory_allocated()),
                "mem-max-allocated-bytes": float(torch.cuda.max_memory_allocated()),
                "mem-reserved-bytes": float(torch.cuda.memory_reserved())}
    return {"mem-rss-bytes": float(current_rss_bytes())}


def moe_aux_losses(args, iteration: int) -> Dict[str, float]:
    """This iteration's MoE auxiliary losses as upstream logs them (``moe_utils.reduce_moe_losses``), written to
    TensorBoard (with ``--moe-per-layer-logging`` also each layer's, ``moe/<name>_layer_<i>``, as upstream); {}
    without any (every rank calls this: the reduction is collective)."""
    if args.num_experts is None:
        return {}
    from megatron.core.transformer.moe.moe_utils import LOAD_BALANCING_LOSS_NAMES, reduce_moe_losses
    from megatron.core.transformer.transformer_layer import is_moe_layer

    names = []
    if args.moe_aux_loss_coeff > 0 and args.moe_router_load_balancing_type != "none":
        names.append(LOAD_BALANCING_LOSS_NAMES[args.moe_router_load_balancing_type])
    if args.moe_z_loss_coeff:
        names.append("z_loss")
    config = SimpleNamespace(num_moe_experts=args.num_experts, moe_layer_freq=args.moe_layer_freq)
    moe_layers = sum(is_moe_layer(config, i) for i in range(1, args.num_layers + 1))
    mtp = args.mtp_num_layers or 0  # MTP depths' MoE layers (the last layer's kind) count after the decoder's
    moe_layers += mtp * is_moe_layer(config, args.num_layers)
    scalars, per_layer = reduce_moe_losses(names, args.num_layers + mtp, moe_layers, args.num_microbatches)
    writer = get_scalar_writer()
    if writer is not None and iteration % args.tensorboard_log_interval == 0:
        for name, value in scalars.items():
            writer.add_scalar(name, value, iteration)
            for i, v in enumerate(per_layer[name] if args.moe_per_layer_logging else ()):
                writer.add_scalar(f"moe/{name}_layer_{i}", v, iteration)
    return scalars


def mtp_losses(args, iteration: int) -> Dict[str, float]:
    """This iteration's multi-token prediction losses (``mtp_<k> loss``, as upstream logs them), written to
    TensorBoard; {} without MTP (every rank calls this: the reduction is collective)."""
    if not args.mtp_num_layers:
        return {}
    from megatron.core.transformer.multi_token_prediction import reduce_mtp_losses

    scalars = reduce_mtp_losses(args.mtp_num_layers, args.num_microbatches)
    writer = get_scalar_writer()
    if writer is not None and iteration % args.tensorboard_log_interval == 0:
        for name, value in scalars.items():
            writer.add_scalar(name, value, iteration)
    return scalars


def write_training_scalars(iteration: int, loss: float, lr: float, grad_norm: float, seconds: float,
                           loss_scale: float = 1.0) -> None:
    """TensorBoard scalars of one iteration (the last rank, every ``--tensorboard-log-interval`` iterations)."""
    args = get_args()
    writer = get_scalar_writer()
    if writer is None or iteration % args.tensorboard_log_interval != 0:
        return
    tokens = args.global_batch_size * args.seq_length
    writer.add_scalar("lm loss", loss, iteration)
    writer.add_scalar("learning-rate", lr, iteration)
    writer.add_scalar("grad-norm", grad_norm, iteration)
    writer.add_scalar("loss-scale", loss_scale, iteration)
    writer.add_scalar("batch-size", args.global_batch_size, iteration)
    writer.add_scalar("tokens-per-sec", tokens / seconds if seconds > 0 else 0.0, iteration)
    if args.log_timers_to_tensorboard:
        writer.add_scalar("iteration-time", seconds, iteration)
    if args.log_throughput:
        flops = num_floating_point_operations(args, args.global_batch_size)
        writer.add_scalar("throughput", flops / seconds / 1e12 / args.world_size if seconds > 0 else 0.0, iteration)
    for name, value in _memory_scalars().items():
        writer.add_scalar(name, value, iteration)


# ---- data ------------------------------------------------------------------------------------------------
def _collate(samples: List[dict], device) -> dict:
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]).to(device) for k in samples[0]}


def build_data_iterator(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                        device=None):
    """This DP rank's micro-batches from global sample ``consumed_samples`` on (see the module docstring)."""
    if dataset is None:
        return None
    device = device or default_device()

    def _gen():
        start = consumed_samples
        step = micro_batch_size * dp_size
        while True:
            first = start + dp_rank * micro_batch_size
            if start + step > len(dataset):
                raise RuntimeError(
                    f"dataset {type(dataset).__name__} exhausted: micro-step at sample {start} needs {step} "
                    f"samples, it has {len(dataset)}"
                )
            yield _collate([dataset[i] for i in range(first, first + micro_batch_size)], device)
            start += step

    return iter(_gen())


def build_train_valid_test_datasets(train_valid_test_dataset_provider):
    args = get_args()
    gbs = args.global_batch_size
    eval_runs = (args.train_iters // args.eval_interval + 1) if args.eval_interval else 1
    num_samples = [args.train_iters * gbs, eval_runs * args.eval_iters * gbs, args.eval_iters * gbs]
    print_rank_0(f" > datasets target sizes (train, valid, test): {num_samples}")
    return train_valid_test_dataset_provider(num_samples)


# ---- steps -----------------------------------------------------------------------------------------------
def _unpack_loss(out):
    """loss_func output: ``(loss, {'lm loss': ...})`` (a mean) or ``(loss_sum, num_tokens, {...})``."""
    cp = parallel_state.get_context_parallel_world_size()
    if isinstance(out, tuple) and len(out) == 3:
        loss, num_tokens, reported = out
        loss = loss / num_tokens
        value = reported.get("lm loss", loss.detach())
        if isinstance(value, torch.Tensor) and value.numel() == 2:
            if cp > 1:  # the CP group's loss sum over its tokens
                value = value.detach().float().clone()
                torch.distributed.all_reduce(value, group=parallel_state.get_context_parallel_group())
            value = value[0] / value[1]
        return loss, value
    if isinstance(out, tuple) and len(out) == 2:  # as upstream's schedule: multiplied by the CP size (the grads
        loss, reported = out  # are averaged over data x context parallel ranks)
        return loss * cp, reported.get("lm loss", loss.detach()) if isinstance(reported, dict) else loss.detach()
    return out * cp, out.detach()


def _loss_sum_and_tokens(out) -> torch.Tensor:
    """``[loss sum, tokens]`` (float32) of a loss function's output under --calculate-per-token-loss."""
    if not (isinstance(out, tuple) and len(out) == 3):
        raise TypeError("--calculate-per-token-loss: the loss function must return (loss_sum, num_tokens, "
                        "{'lm loss': [sum, num_tokens]})")
    loss, num_tokens, _ = out
    return torch.stack([loss.detach().float().reshape(()),
                        torch.as_tensor(num_tokens).float().reshape(()).to(loss.device)])


def _per_token_mean(sum_and_tokens: torch.Tensor) -> torch.Tensor:
    """Loss sum / tokens of this rank's ``[loss sum, tokens]`` summed over the data (x context) parallel ranks
    (collective)."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        sum_and_tokens = sum_and_tokens.to(parallel_state.collective_device(group))
        torch.distributed.all_reduce(sum_and_tokens, group=group)
    return sum_and_tokens[0] / sum_and_tokens[1].clamp(min=1.0)


def _aux_loss_scale(factor: float, loss_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``factor`` x the fp16 loss scale as a 0-dim float32 tensor where the loss scale lives (on the device with
    fp16: no host read of it per step); float64 product rounded once, the value ``torch.tensor(factor *
    float(loss_scale))`` gives."""
    if loss_scale is None:
        return torch.tensor(factor)
    return (loss_scale.detach().reshape(-1)[0].double() * factor).float()


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config=None):
    """One iteration: gradient accumulation over ``args.num_microbatches``, grad sync, optimizer step,
    scheduler step, expert-bias update. Returns (lm loss averaged over micro-batches and DP, grad norm,
    update_successful)."""
    args = get_args()
    chunk = model[0]
    n = args.num_microbatches
    for m in model:
        if hasattr(m, "zero_grad_buffer"):
            m.zero_grad_buffer()
    optimizer.zero_grad()
    # --calculate-per-token-loss (upstream's formula): each micro-batch's SUMMED loss is back-propagated as it is;
    # finalize_model_grads divides the gradients by the tokens of the whole global batch (summed over DP)
    per_token = bool(getattr(args, "calculate_per_token_loss", False))
    get_loss_scale = getattr(optimizer, "get_loss_scale", None)  # fp16 loss scaling, where the optimizer has it
    loss_scale = get_loss_scale() if callable(get_loss_scale) else None
    if args.num_experts is not None:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        # as upstream: the aux-loss gradient scaled like the main loss's (the fp16 loss scale included, which the
        # optimizer divides out of every gradient), per micro-batch unless per-token; with context parallelism x the
        # CP size (each CP rank's aux loss is its share of the sequence's; grads are averaged over data x context)
        cp = parallel_state.get_context_parallel_world_size()
        MoEAuxLossAutoScaler.set_loss_scale(_aux_loss_scale(1.0 if per_token else cp / n, loss_scale))
    if args.mtp_num_layers:  # the MTP loss's gradient scaled as the main loss's (upstream's MTPLossAutoScaler)
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        MTPLossAutoScaler.set_loss_scale(_aux_loss_scale(1.0 if per_token else 1.0 / n, loss_scale))
    reported, token_sums = [], []
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # the schedule also finalizes the grads
        from megatron.training.pipeline_training import pipeline_forward_backward

        reported = pipeline_forward_backward(forward_step_func, data_iterator, model, optimizer, forward_only=False)
        n = 0
    for i in range(n):
        sync_ctx = chunk.no_sync() if (i < n - 1 and hasattr(chunk, "no_sync")) else nullcontext()
        with sync_ctx:
            output, loss_func = forward_step_func(data_iterator, chunk)
            out = loss_func(output)
            if per_token:
                loss = out[0]
                token_sums.append(_loss_sum_and_tokens(out))
            else:
                loss, value = _unpack_loss(out)
                loss = loss / n
                reported.append(value.detach().float().reshape(()))
            if loss_scale is not None:  # fp16: scaled loss (1 otherwise); the optimizer unscales the grads
                loss = loss * loss_scale.to(loss.device).reshape(())
            loss.backward()
    tokens = torch.stack(token_sums).sum(0) if per_token else None  # [loss sum, tokens] of this DP rank
    if n:  # DP grad sync, then sequence-parallel grads summed over TP (per-token: divided by the global token count)
        finalize_model_grads(model, num_tokens=tokens[1] if per_token else None)
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        opt_param_scheduler.step(increment=args.global_batch_size)
    if args.moe_router_enable_expert_bias:
        from megatron.core.transformer.moe.expert_bias import update_expert_bias

        update_expert_bias(model, parallel_state.get_data_parallel_group(with_context_parallel=True))
    if per_token:  # the lm loss of the global batch: its loss sum over its tokens
        loss = _per_token_mean(tokens)
    else:
        loss = average_losses_across_data_parallel_group([torch.stack(reported).mean()])[0]
    gn = float(grad_norm) if grad_norm is not None else float("nan")
    return loss, gn, update_successful


@torch.no_grad()
def evaluate(forward_step_func, dataset, model, eval_iters: int):
    """Mean lm loss over ``eval_iters`` global batches of ``dataset`` from its first sample."""
    args = get_args()
    chunk = model[0]
    for m in model:
        m.eval()
    it = build_data_iterator(dataset, 0, args.micro_batch_size, parallel_state.get_data_parallel_rank(),
                             parallel_state.get_data_parallel_world_size())
    values, per_token = [], bool(getattr(args, "calculate_per_token_loss", False))
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        from megatron.training.pipeline_training import pipeline_forward_backward

        iters = [build_data_iterator(dataset, 0, args.micro_batch_size, parallel_state.get_data_parallel_rank(),
                                     parallel_state.get_data_parallel_world_size()) for _ in model]
        values = [pipeline_forward_backward(forward_step_func, iters, model, None, forward_only=True)[0]
                  for _ in range(eval_iters)]
        eval_iters = 0
    for _ in range(eval_iters * args.num_microbatches):
        output, loss_func = forward_step_func(it, chunk)
        out = loss_func(output)
        values.append(_loss_sum_and_tokens(out) if per_token else _unpack_loss(out)[1].detach().float().reshape(()))
    for m in model:
        m.train()
    if per_token:  # --calculate-per-token-loss: over every token of the evaluated batches
        return float(_per_token_mean(torch.stack(values).sum(0)))
    return float(average_losses_across_data_parallel_group([torch.stack(values).mean()])[0])


def training_log(iteration, loss_avg, lr, grad_norm, elapsed, iters, loss_scale=1.0, skipped=0, nan_iters=0,
                 num_zeros=None, params_norm=None, moe_losses=None) -> str:
    args = get_args()
    per_iter = elapsed / max(iters, 1)
    tokens_per_s = args.global_batch_size * args.seq_length / per_iter if per_iter > 0 else 0.0
    throughput = ""
    if args.log_throughput and per_iter > 0:
        tflops = num_floating_point_operations(args, args.global_batch_size) / per_iter / 1e12 / args.world_size
        throughput = f" throughput per GPU (TFLOP/s/GPU): {tflops:.3f} |"
    line = (
        f" iteration {iteration:8d}/{args.train_iters:8d} |"
        f" consumed samples: {args.consumed_train_samples:12d} |"
        f" elapsed time per iteration (ms): {per_iter * 1000:.1f} |"
        f" tokens/s: {tokens_per_s:.1f} |"
        f"{throughput}"
        f" learning rate: {lr:.6E} |"
        f" global batch size: {args.global_batch_size:5d} |"
        f" lm loss: {loss_avg:.6E} |"
        f"{''.join(f' {k}: {v:.6E} |' for k, v in (moe_losses or {}).items())}"
        f" loss scale: {loss_scale:.1f} |"
        f" grad norm: {grad_norm:.3f} |"
        f"{'' if num_zeros is None else f' num zeros: {num_zeros} |'}"
        f"{'' if params_norm is None else f' params norm: {params_norm:.3f} |'}"
        f" number of skipped iterations: {skipped:3d} |"
        f" number of nan iterations: {nan_iters:3d} |"
        f" {memory_report()} |"
    )
    print_rank_0(line)
    return line


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, valid_dataset,
          result: TrainingResult, on_iteration_end: Optional[Callable] = None):
    args = get_args()
    iteration = args.iteration
    for m in model:
        m.train()
    interval_losses, t0, iters, interval_moe = [], time.time(), 0, {}
    if args.num_experts is not None:  # the first iteration's MoE losses are its own
        from megatron.core.transformer.moe.moe_utils import clear_moe_losses

        clear_moe_losses()
    if args.mtp_num_layers:  # likewise the MTP losses
        from megatron.core.transformer.multi_token_prediction import clear_mtp_losses

        clear_mtp_losses()
    skipped, nan_iters = 0, 0  # per log interval, as upstream
    saved_at = None
    flops_per_iteration = num_floating_point_operations(args, args.global_batch_size)
    cuda_graphs = _build_cuda_graphs(model)  # --cuda-graph-impl: per-layer graphs after the warm-up steps
    profiler = TrainingProfiler(args, get_rank(), iteration, printer=print)  # --profile (profiling.py)
    control = RunControl(args, _TRAIN_START_TIME)  # --exit-signal-handler, --manual-gc, ...
    try:
        while iteration < args.train_iters:
            t_step = time.time()
            loss_scale = _loss_scale_value(optimizer)  # the scale this iteration's backward used
            profiler.before_step(iteration)
            if cuda_graphs is not None:
                cuda_graphs.before_step()  # captures when the eager warm-up steps are done
                result.cuda_graph_regions = cuda_graphs.graphed_regions()
            loss, grad_norm, ok = train_step(forward_step_func, train_data_iterator, model, optimizer,
                                             opt_param_scheduler)
            profiler.after_step(iteration + 1)
            iteration += 1
            args.iteration = iteration
            args.consumed_train_samples += args.global_batch_size
            args.num_floating_point_operations_so_far += flops_per_iteration
            value = float(loss)
            result.loss_scales[iteration] = loss_scale
            moe = {**moe_aux_losses(args, iteration), **mtp_losses(args, iteration)}  # logged after lm loss
            if moe:
                result.moe_losses[iteration] = moe
                for k, v in moe.items():
                    interval_moe[k] = interval_moe.get(k, 0.0) + v
            if not ok:
                skipped += 1
                result.skipped_iterations += 1
            if not math.isfinite(value) and getattr(args, "check_for_nan_in_loss_and_grad", True):
                raise TrainingStopped(
                    f"lm loss is {value} at iteration {iteration} (not finite); that iteration's update was "
                    f"{'skipped' if not ok else 'applied'} (--no-check-for-nan-in-loss-and-grad to go on)"
                )
            nan_iters += int(not math.isfinite(value))
            result.losses[iteration] = value
            result.grad_norms[iteration] = grad_norm
            lr = optimizer.param_groups[0]["lr"]
            result.learning_rates[iteration] = lr
            interval_losses.append(value)
            iters += 1
            write_training_scalars(iteration, value, lr, grad_norm, time.time() - t_step, loss_scale)
            if on_iteration_end is not None:
                on_iteration_end(iteration, model, value)
            if iteration % args.log_interval == 0:
                # --log-num-zeros-in-grad / --log-params-norm: this iteration's (the grads are zeroed next step)
                num_zeros = optimizer.count_zeros() if args.log_num_zeros_in_grad else None
                params_norm = optimizer.get_params_norm() if args.log_params_norm else None
                result.params_norms[iteration], result.num_zeros[iteration] = params_norm, num_zeros
                writer = get_scalar_writer()
                for name, value in (("params-norm", params_norm), ("num-zeros", num_zeros)):
                    if writer is not None and value is not None:
                        writer.add_scalar(name, value, iteration)
                training_log(iteration, sum(interval_losses) / len(interval_losses), lr, grad_norm, time.time() - t0,
                             iters, loss_scale, skipped, nan_iters, num_zeros=num_zeros, params_norm=params_norm,
                             moe_losses={k: v / len(interval_losses) for k, v in interval_moe.items()})
                interval_losses, t0, iters, interval_moe = [], time.time(), 0, {}
                skipped, nan_iters = 0, 0
            t_extra = time.time()  # evaluation and saving are not counted in the iteration time
            control.after_step(iteration)
            if args.async_save:  # advance the tracker of background saves that finished on every rank
                maybe_finalize_async_save(blocking=False)
            if (valid_dataset is not None and args.eval_iters > 0 and args.eval_interval
                    and iteration % args.eval_interval == 0):
                control.around_evaluation()
                v = evaluate_and_print(forward_step_func, valid_dataset, model, iteration, "validation")
                control.around_evaluation()
                result.valid_losses[iteration] = v
            # saves (persistent / non-persistent) and exits (SIGTERM, duration, interval): run_control.py
            reason, saved = control.save_and_decide_exit(
                iteration, lambda non_persistent=False: timed_save_checkpoint(
                    iteration, model, optimizer, opt_param_scheduler, non_persistent=non_persistent))
            saved_at = iteration if saved else saved_at
            t0 += time.time() - t_extra
            if reason is not None:
                print_rank_0(reason)
                result.exit_reason, result.interrupted = reason, control.interrupted
                break
    finally:  # an error (a non-finite loss, a failed save) still ends the profile and writes its trace
        if cuda_graphs is not None:  # the graphs' memory is released; evaluation after training runs eagerly
            result.cuda_graph_replays = cuda_graphs.replays()
            cuda_graphs.remove()
        profiler.close()
        control.close()
    return iteration, saved_at


def _build_cuda_graphs(model):
    """``transformer.cuda_graphs.CudaGraphHelper`` of the model chunks with ``--cuda-graph-impl`` local /
    transformer_engine, else None."""
    from megatron.core.transformer.cuda_graphs import build_cuda_graph_helper
    from megatron.core.utils import get_model_config

    return build_cuda_graph_helper(model, get_model_config(model[0]))


def _loss_scale_value(optimizer) -> float:
    get_loss_scale = getattr(optimizer, "get_loss_scale", None)
    return float(get_loss_scale().reshape(-1)[0]) if callable(get_loss_scale) else 1.0


def timed_save_checkpoint(iteration, model, optimizer, opt_param_scheduler, non_persistent=False) -> None:
    """``save_checkpoint`` with its duration, size and rate printed (and written to TensorBoard)."""
    args = get_args()
    start = time.time()
    save_checkpoint(iteration, model, optimizer, opt_param_scheduler, args.num_floating_point_operations_so_far,
                    non_persistent_ckpt=non_persistent)
    if not args.async_save:  # an asynchronous save reports when it is scheduled and when it is finalized
        where = non_persistent_dir(args, args.save) if non_persistent else args.save
        _report_checkpoint_io("save", where, time.time() - start, iteration)


def evaluate_and_print(forward_step_func, dataset, model, iteration: int, name: str) -> float:
    """Mean lm loss over ``--eval-iters`` global batches of ``dataset``, printed on rank 0 with its perplexity
    and written to TensorBoard (``validation``/``test`` ``loss``, and ``ppl`` with
    ``--log-validation-ppl-to-tensorboard``)."""
    args = get_args()
    value = evaluate(forward_step_func, dataset, model, args.eval_iters)
    ppl = math.exp(min(20.0, value))
    print_rank_0(f" {name} loss at iteration {iteration} | lm loss value: {value:.6E} | lm loss PPL: {ppl:.6E} |")
    writer = get_scalar_writer()
    if writer is not None:
        writer.add_scalar(f"lm loss {name}", value, iteration)
        if args.log_validation_ppl_to_tensorboard:
            writer.add_scalar(f"lm loss {name} ppl", ppl, iteration)
    return value


def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}, get_embedding_ranks=None,
             get_position_embedding_ranks=None, non_loss_data_func=None, args=None, on_iteration_end=None):
    """Initialize, build model + optimizer (+ load), build data, train, save at the end.

    ``args``: the command line as a list (default ``sys.argv[1:]``). ``on_iteration_end(iteration, model, loss)``
    is called after each iteration (tests). Returns a ``TrainingResult``.
    """
    start = time.time()
    initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults, args=args)
    args = get_args()
    global _TRAIN_START_TIME
    _TRAIN_START_TIME = start  # --exit-duration-in-mins counts from here (upstream's name)
    if args.save:  # before any work: --save writable and this job's alone (all ranks stop otherwise)
        check_save_dir(args.save)
    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(model_provider, model_type)
    if not args.skip_train:  # before any step: its saves replace no checkpoint and move no tracker back
        check_save_target(args, args.iteration)
        if args.save and args.async_save and args.save_interval:  # the first save then blocks only for its copy
            warm_up_async_save(model, optimizer, opt_param_scheduler)
    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(train_valid_test_dataset_provider)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    train_iter = build_data_iterator(train_ds, args.consumed_train_samples, args.micro_batch_size, dp_rank, dp_size)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # every model chunk reads the micro-batches
        train_iter = [train_iter] + [build_data_iterator(train_ds, args.consumed_train_samples, args.micro_batch_size,
                                                         dp_rank, dp_size) for _ in model[1:]]
    print_rank_0(f" > setup done in {time.time() - start:.2f}s; training from iteration {args.iteration} "
                 f"(consumed samples {args.consumed_train_samples}), {args.num_microbatches} micro-batch(es) "
                 f"per iteration, data-parallel size {dp_size}")
    result = TrainingResult(model=model, optimizer=optimizer, opt_param_scheduler=opt_param_scheduler)
    iteration, saved_at = args.iteration, None
    start_iteration = iteration
    if args.skip_train:
        print_rank_0(" skipping training (--skip-train is on): evaluating only")
    elif args.train_iters > args.iteration:
        iteration, saved_at = train(forward_step_func, model, optimizer, opt_param_scheduler, train_iter, valid_ds,
                                    result, on_iteration_end)
    if args.save and iteration > start_iteration and saved_at != iteration:
        timed_save_checkpoint(iteration, model, optimizer, opt_param_scheduler)
    if args.async_save:  # at exit: wait for the background saves and advance the tracker
        maybe_finalize_async_save(blocking=True, terminate=True)
    # As upstream: the validation and test sets are evaluated at the end (with --eval-iters > 0); not after a
    # SIGTERM or --exit-duration-in-mins (the job is about to be stopped)
    if args.eval_iters > 0 and valid_ds is not None and not result.interrupted:
        result.final_valid_loss = evaluate_and_print(forward_step_func, valid_ds, model, iteration, "validation")
    if args.eval_iters > 0 and test_ds is not None and not result.interrupted:
        result.test_loss = evaluate_and_print(forward_step_func, test_ds, model, iteration, "test")
    writer = get_scalar_writer()
    if writer is not None:
        writer.flush()
    result.iteration = iteration
    return result
