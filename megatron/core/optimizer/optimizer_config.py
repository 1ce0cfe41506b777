"""OptimizerConfig with upstream field names."""
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class OptimizerConfig:
    optimizer: str = "adam"
    """'adam' (torch.optim.AdamW: decoupled weight decay, as upstream) or 'sgd'."""
    lr: Optional[float] = None
    min_lr: Optional[float] = None
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    weight_decay: float = 0.01
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    use_precision_aware_optimizer: bool = False
    """Keep the Adam moments in ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` and the main grads in ``main_grads_dtype``
    (``precision_aware.py``; upstream: Transformer Engine's FusedAdam). Needs the distributed optimizer (or
    Megatron-FSDP, which shards the optimizer too) and adam, as upstream."""
    store_param_remainders: bool = True
    """With the precision-aware optimizer, ``bf16`` and the distributed optimizer: keep a bf16 weight's fp32 main
    param as its low 16 bits (int16) beside the weight, which holds the high 16 (2 B per parameter instead of 4;
    ``precision_aware.py``, TE FusedAdam's rule). Upstream's default, and like upstream no command-line flag.
    Checkpoints hold the fp32 main params either way."""
    main_grads_dtype: torch.dtype = torch.float32
    """Main grads' dtype with the precision-aware optimizer: fp32, or bf16 (the reduced bf16 gradient is stepped from
    directly, read as fp32 inside the step)."""
    main_params_dtype: torch.dtype = torch.float32
    """Main params' dtype with the precision-aware optimizer: fp32 (upstream also allows fp16, not built here)."""
    exp_avg_dtype: torch.dtype = torch.float32
    """Adam's first moment's storage dtype with the precision-aware optimizer: float32, bfloat16, float16 or uint8
    (fp8 e4m3, as upstream's config names it); fp16 / fp8 scaled per tensor."""
    exp_avg_sq_dtype: torch.dtype = torch.float32
    """Adam's second moment's storage dtype with the precision-aware optimizer (as ``exp_avg_dtype``)."""
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    sgd_momentum: float = 0.9
    use_distributed_optimizer: bool = False
    overlap_param_gather_with_optimizer_step: bool = False
    clip_grad: float = 1.0
    """Clip the global gradient L2 norm to this value (0: no clipping, the norm is still computed)."""
    grad_norm_skip_threshold: float = float("inf")
    """Skip the update (parameters and optimizer state unchanged, ``update_successful=False``) when the global grad
    norm, before clipping, exceeds this value. Off by default (inf), as upstream."""
    log_num_zeros_in_grad: bool = False
    barrier_with_L1_time: bool = False
    timers: Optional[object] = None
    config_logger_dir: str = ""

    def __post_init__(self):
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer (--optimizer) must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 are mutually exclusive")
        self._check_loss_scale()
        self._check_precision_aware()

    def _check_precision_aware(self) -> None:
        """Upstream's rules for the precision-aware optimizer's dtypes (and this fork's one refusal: fp16 main
        params)."""
        from megatron.core.optimizer.precision_aware import as_state_dtype

        flags = {"main_grads_dtype": "--main-grads-dtype", "main_params_dtype": "--main-params-dtype",
                 "exp_avg_dtype": "--exp-avg-dtype", "exp_avg_sq_dtype": "--exp-avg-sq-dtype"}
        for field, flag in flags.items():
            setattr(self, field, as_state_dtype(getattr(self, field), f"{field} ({flag})"))
        if not self.use_precision_aware_optimizer:
            for field, flag in flags.items():
                if getattr(self, field) != torch.float32:
                    raise ValueError(f"{field} ({flag}) can only be fp32 without use_precision_aware_optimizer "
                                     "(--use-precision-aware-optimizer)")
            return
        if self.optimizer != "adam":
            raise ValueError(f"use_precision_aware_optimizer (--use-precision-aware-optimizer) is only supported with "
                             f"optimizer 'adam' (--optimizer), got {self.optimizer!r}")
        if not self.use_distributed_optimizer:
            raise ValueError("use_precision_aware_optimizer (--use-precision-aware-optimizer) is only supported with "
                             "the distributed optimizer (--use-distributed-optimizer, or --use-megatron-fsdp), as "
                             "upstream")
        if self.main_grads_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"main_grads_dtype (--main-grads-dtype) must be fp32 or bf16, got {self.main_grads_dtype}")
        if self.main_params_dtype == torch.float16:
            raise ValueError("main_params_dtype (--main-params-dtype) fp16 is not implemented in this fork (the main "
                             "params stay fp32; the Adam moments and main grads can be reduced): use fp32")
        if self.main_params_dtype != torch.float32:
            raise ValueError(f"main_params_dtype (--main-params-dtype) must be fp32 or fp16, got "
                             f"{self.main_params_dtype}")
        if self.fp16 and self.main_grads_dtype == torch.bfloat16:
            raise ValueError("main_grads_dtype (--main-grads-dtype) bf16 needs bf16 training (--bf16), not --fp16")

    def _check_loss_scale(self) -> None:
        """The fp16 loss scale: static (``loss_scale``) or dynamic (initial/min scale, window, hysteresis)."""
        if self.loss_scale is not None:
            if not self.fp16:
                raise ValueError(f"loss_scale (--loss-scale={self.loss_scale!r}) is the static fp16 loss scale: it "
                                 "needs fp16 (--fp16); bf16 and fp32 need no loss scaling")
            if not self.loss_scale > 0:
                raise ValueError(f"loss_scale (--loss-scale={self.loss_scale!r}) must be positive")
            return
        if not self.fp16:
            return
        if not self.initial_loss_scale > 0:
            raise ValueError(f"initial_loss_scale (--initial-loss-scale={self.initial_loss_scale!r}) must be positive")
        if not 0 < self.min_loss_scale <= self.initial_loss_scale:
            raise ValueError(f"min_loss_scale (--min-loss-scale={self.min_loss_scale!r}) must be in "
                             f"(0, initial_loss_scale (--initial-loss-scale={self.initial_loss_scale!r})]")
        if not self.loss_scale_window >= 1:
            raise ValueError(f"loss_scale_window (--loss-scale-window={self.loss_scale_window!r}) must be >= 1")
        if self.hysteresis < 1:
            raise ValueError(f"hysteresis (--hysteresis={self.hysteresis!r}) must be >= 1")
