"""Optimizer construction: ``get_megatron_optimizer(config, model_chunks)`` -> ``MegatronOptimizer``."""
from typing import Callable, List, Optional, Union

import torch

from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.distributed.param_layout import upstream_module_order

HAVE_EMERGING_OPTIMIZERS = False  # upstream's Muon / Lion etc. are not part of this fork

__all__ = ["OptimizerConfig", "MegatronOptimizer", "ChainedOptimizer", "DistributedOptimizer", "get_megatron_optimizer", "get_param_groups"]



_FUSED_ADAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

def _named_params(chunk: torch.nn.Module):
    """(name, param) with the UNWRAPPED model's names (DDP / FSDP wrappers expose ``param_to_name``)."""
    p2n = getattr(chunk, "param_to_name", None)
    if p2n is not None:
        return [(n, p) for p, n in p2n.items()]
    return list(chunk.named_parameters())


def _default_no_wd(name: str, param: torch.Tensor) -> bool:
    return name.endswith(".bias") or len(param.shape) == 1


def get_param_groups(
    model_chunks: List[torch.nn.Module],
    no_weight_decay_cond: Optional[Callable] = None,
    scale_lr_cond: Optional[Callable] = None,
    lr_mult: float = 1.0,
    lr: Optional[float] = None,
    min_lr: Optional[float] = None,
    decoupled_lr: Optional[float] = None,
    decoupled_min_lr: Optional[float] = None,
):
    """Param groups keyed by (wd_mult, lr_mult, is_expert_parallel), with upstream's group keys (``wd_mult``,
    ``lr_mult``, ``is_expert_parallel``, ``is_decoupled_lr``, ``max_lr``, ``min_lr``) that
    ``OptimizerParamScheduler`` reads. Biases and 1-D params (norms) get no weight decay by default."""
    groups = {}
    names = {}
    for chunk in model_chunks:
        for name, p in _named_params(chunk):
            if not p.requires_grad:
                continue
            no_wd = no_weight_decay_cond(name, p) if no_weight_decay_cond is not None else _default_no_wd(name, p)
            scale_lr = scale_lr_cond(name, p) if scale_lr_cond is not None else False
            decoupled = decoupled_lr is not None and is_embedding_or_output_parameter(name, p)
            key = (0.0 if no_wd else 1.0, lr_mult if scale_lr else 1.0, not getattr(p, "allreduce", True), decoupled)
            groups.setdefault(key, []).append(p)
            names[p] = name
    out = []
    for (wd_mult, lm, is_expert, decoupled), params in groups.items():
        out.append(
            {
                "params": params,
                "wd_mult": wd_mult,
                "lr_mult": lm,
                "is_expert_parallel": is_expert,
                "is_decoupled_lr": decoupled,
                "max_lr": decoupled_lr if decoupled else lr,
                "min_lr": (decoupled_min_lr if decoupled_min_lr is not None else min_lr) if decoupled else min_lr,
            }
        )
    return out, names


def is_embedding_or_output_parameter(name: str, param) -> bool:
    """The input embedding's and the output layer's weights (upstream's ``is_embedding_or_output_parameter``): what
    ``--decoupled-lr`` applies to."""
    if getattr(param, "is_embedding_or_output_parameter", False):
        return True
    return name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight")


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: Union[torch.nn.Module, List[torch.nn.Module]],
    no_weight_decay_cond: Optional[Callable] = None,
    scale_lr_cond: Optional[Callable] = None,
    lr_mult: float = 1.0,
    **unused,
) -> MegatronOptimizer:
    """AdamW (``config.optimizer == 'adam'``) or SGD over the model chunks' parameters.

    Parameters that are bf16/fp16 plain tensors (DDP with ``--bf16``) or quantized weights (TE FP8/FP4, also as
    FSDP2 DTensor shards, with ``--fp8-param-gather``) get fp32 main copies that the optimizer updates; fp32
    FSDP2 parameters (DTensor, already the main params) are optimised directly, so their optimizer state is
    sharded too. ``config.use_distributed_optimizer`` with plain data parallelism gives a
    ``DistributedOptimizer`` (main params and state sharded over DP ranks), as do chunks that
    ``wrap_data_parallel`` wrapped for Megatron-FSDP's ``optim`` strategy; ``config.fp16`` a grad scaler
    (``grad_scaler.py``: static with ``loss_scale``, else dynamic).
    """
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    if config.lr is None:
        raise ValueError("OptimizerConfig.lr (--lr) must be set")
    min_lr = config.min_lr if config.min_lr is not None else 0.0
    groups, names = get_param_groups(model_chunks, no_weight_decay_cond, scale_lr_cond, lr_mult, config.lr, min_lr,
                                     config.decoupled_lr, config.decoupled_min_lr)
    from megatron.core.optimizer.grad_scaler import build_grad_scaler

    params = [p for g in groups for p in g["params"]]
    grad_scaler = build_grad_scaler(config, params[0].device if params else None)

    def make_optimizer(param_groups):
        for g in param_groups:
            g["weight_decay"] = config.weight_decay * g["wd_mult"]
            g["lr"] = config.lr * g["lr_mult"]
        if config.optimizer == "adam" and config.use_precision_aware_optimizer:
            from megatron.core.optimizer.precision_aware import PrecisionAwareAdamW, remainders_enabled

            return PrecisionAwareAdamW(param_groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                       eps=config.adam_eps, weight_decay=config.weight_decay,
                                       exp_avg_dtype=config.exp_avg_dtype, exp_avg_sq_dtype=config.exp_avg_sq_dtype,
                                       store_param_remainders=remainders_enabled(config))
        if config.optimizer == "adam":
            # On CUDA: torch's fused AdamW (one multi-tensor kernel per step, step counts kept on the device; works on
            # FSDP2 DTensor shards). Its per-step host cost is a small fraction of foreach AdamW's, which launches
            # ~10 multi-tensor ops (each dispatched per DTensor) and reads every param's CPU step count: on one GPU
            # that host time is most of what Megatron-FSDP costs over DDP. Elsewhere torch's default (foreach).
            ps = [p for g in param_groups for p in g["params"]]
            fused = bool(ps) and all(p.device.type == "cuda" and p.dtype in _FUSED_ADAM_DTYPES for p in ps)
            return torch.optim.AdamW(
                param_groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                weight_decay=config.weight_decay, **({"fused": True} if fused else {}),
            )
        return torch.optim.SGD(param_groups, lr=config.lr, momentum=config.sgd_momentum,
                               weight_decay=config.weight_decay)

    ddp_configs = [c.ddp_config for c in model_chunks if getattr(c, "ddp_config", None) is not None]
    use_fsdp = any(c.use_megatron_fsdp for c in ddp_configs)
    # Megatron-FSDP's 'optim' (ZeRO-1) strategy: DDP chunks (wrap_data_parallel) whose optimizer state is sharded
    zero1 = bool(ddp_configs) and not use_fsdp and all(
        c.data_parallel_sharding_strategy == "optim" and c.use_distributed_optimizer for c in ddp_configs)
    if (config.use_distributed_optimizer or zero1) and not use_fsdp:
        # plain data parallelism: ZeRO-1 sharding of main params and optimizer state (distrib_optimizer.py)
        if not ddp_configs or not all(c.use_distributed_optimizer for c in ddp_configs):
            raise ValueError(
                "use_distributed_optimizer (--use-distributed-optimizer): the model chunks must be wrapped in "
                "DistributedDataParallel with ddp_config.use_distributed_optimizer=True (the optimizer then "
                "reduce-scatters the gradients instead of DDP all-reducing them)"
            )
        return DistributedOptimizer(
            make_optimizer, config, groups, names, grad_scaler=grad_scaler,
            grad_reduce_in_fp32=any(c.grad_reduce_in_fp32 for c in ddp_configs),
            check_for_nan_in_grad=any(c.check_for_nan_in_grad for c in ddp_configs),
            chunk_params=[upstream_module_order([(n, p) for n, p in _named_params(c) if p.requires_grad])
                          for c in model_chunks],
            ddp_config=ddp_configs[0], model_chunks=model_chunks,
        )
    if any(c.use_distributed_optimizer and not c.use_megatron_fsdp for c in ddp_configs):
        raise ValueError(
            "a DistributedDataParallel chunk has ddp_config.use_distributed_optimizer=True (it leaves the gradient "
            "reduction to the optimizer) but OptimizerConfig.use_distributed_optimizer is False"
        )
    model_params = [p for g in groups for p in g["params"]]
    from megatron.core.optimizer.optimizer import _fp32_main_param, _is_quantized_param, _needs_main_param

    main_params = None
    if any(_needs_main_param(p) for p in model_params):
        main_params = []
        for g in groups:
            # low-precision and quantized (FP8/FP4) params get fp32 main copies; fp32 params (FSDP's sharded main
            # params) are optimised directly. Quantized weights are never updated in their own format.
            mains = [_fp32_main_param(p) if _needs_main_param(p) or _is_quantized_param(p) else p for p in g["params"]]
            main_params.extend(mains)
            g["params"] = mains
    opt = make_optimizer(groups)
    return MegatronOptimizer(opt, config, model_params, names, main_params, grad_scaler=grad_scaler)
