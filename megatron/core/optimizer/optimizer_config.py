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
    log_num_zeros_in_grad: bool = False
    barrier_with_L1_time: bool = False
    timers: Optional[object] = None
    config_logger_dir: str = ""

    def __post_init__(self):
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer (--optimizer) must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 are mutually exclusive")
