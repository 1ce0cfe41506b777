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
