"""Learning-rate and weight-decay schedule (upstream's ``OptimizerParamScheduler`` interface).

Steps are counted in whatever unit the caller increments by (the training loop uses samples: it calls
``step(increment=global_batch_size)``, with warmup/decay lengths given in samples).

lr: linear warmup from ``init_lr`` to ``max_lr`` over ``lr_warmup_steps``, then ``constant`` (``max_lr``),
``linear`` or ``cosine`` decay to ``min_lr`` at ``lr_decay_steps``, ``min_lr`` after (``inverse-square-root`` too).
Weight decay: ``constant`` (``start_wd``), ``linear`` or ``cosine`` from ``start_wd`` to ``end_wd`` over
``wd_incr_steps``. A param group's ``lr_mult`` / ``wd_mult`` (default 1; 0 for groups created with
``weight_decay == 0`` when ``start_wd > 0``, i.e. the no-decay group) scale its values.
"""
import math
from typing import Optional

_LR_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
_WD_STYLES = ("constant", "linear", "cosine")


class OptimizerParamScheduler:
    def __init__(
        self,
        optimizer,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: bool = True,
        override_opt_param_scheduler: bool = False,
    ):
        if lr_decay_style not in _LR_STYLES:
            raise ValueError(f"--lr-decay-style {lr_decay_style!r}: choose one of {', '.join(_LR_STYLES)}")
        if wd_incr_style not in _WD_STYLES:
            raise ValueError(f"--weight-decay-incr-style {wd_incr_style!r}: choose one of {', '.join(_WD_STYLES)}")
        if not 0.0 <= min_lr <= max_lr:
            raise ValueError(f"need 0 <= --min-lr ({min_lr}) <= --lr ({max_lr})")
        if lr_decay_steps <= 0:
            raise ValueError(f"lr_decay_steps must be positive (--lr-decay-iters), got {lr_decay_steps}")
        if lr_warmup_steps < 0 or lr_warmup_steps >= lr_decay_steps and lr_decay_style != "constant":
            raise ValueError(
                f"--lr-warmup-iters ({lr_warmup_steps} steps) must be in [0, --lr-decay-iters ({lr_decay_steps} steps))"
            )
        if use_checkpoint_opt_param_scheduler and override_opt_param_scheduler:
            raise ValueError("use_checkpoint_opt_param_scheduler and override_opt_param_scheduler are exclusive")
        self.optimizer = optimizer
        self.init_lr = float(init_lr)
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.lr_warmup_steps = int(lr_warmup_steps)
        self.lr_decay_steps = int(lr_decay_steps)
        self.lr_decay_style = lr_decay_style
        self.start_wd = float(start_wd)
        self.end_wd = float(end_wd)
        self.wd_incr_steps = int(wd_incr_steps)
        self.wd_incr_style = wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        # The per-group peak / minimum learning rates the arguments gave (decoupled embedding lr, ...): a loaded
        # optimizer state brings the saving run's, which --override-opt_param-scheduler must not keep.
        self._arg_group_lrs = [{k: g[k] for k in ("max_lr", "min_lr") if k in g} for g in self._groups()]
        for group in self._groups():
            group.setdefault("lr_mult", 1.0)
            group.setdefault("wd_mult", 0.0 if group.get("weight_decay", 1.0) == 0.0 and self.start_wd > 0 else 1.0)
        self.step(0)

    def _groups(self):
        return self.optimizer.param_groups if self.optimizer is not None else []

    def get_wd(self) -> float:
        if self.wd_incr_style == "constant":
            return self.start_wd
        if self.wd_incr_steps <= 0 or self.num_steps >= self.wd_incr_steps:
            return self.end_wd
        ratio = self.num_steps / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self, param_group: Optional[dict] = None) -> float:
        max_lr, min_lr = self.max_lr, self.min_lr
        if param_group is not None:
            if param_group.get("max_lr") is not None:
                max_lr = param_group["max_lr"]
            if param_group.get("min_lr") is not None:
                min_lr = param_group["min_lr"]
        n = self.num_steps
        if self.lr_warmup_steps > 0 and n <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * n / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return max_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup = max(self.lr_warmup_steps, 1)
            return max(min_lr, max_lr * math.sqrt(warmup) / math.sqrt(max(n, 1)))
        if n > self.lr_decay_steps:
            return min_lr
        ratio = (n - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int) -> None:
        self.num_steps += int(increment)
        wd = self.get_wd()
        for group in self._groups():
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _check_and_set(self, cls_value, sd_value, name: str):
        if self.override_opt_param_scheduler:
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise ValueError(
                f"OptimizerParamScheduler: {name} is {cls_value} in the arguments but {sd_value} in the checkpoint; "
                "pass --use-checkpoint-opt_param-scheduler or --override-opt_param-scheduler"
            )
        return sd_value

    def load_state_dict(self, sd: dict) -> None:
        self.max_lr = self._check_and_set(self.max_lr, sd.get("max_lr", self.max_lr), "learning rate (--lr)")
        self.min_lr = self._check_and_set(self.min_lr, sd.get("min_lr", self.min_lr), "minimum learning rate (--min-lr)")
        self.lr_warmup_steps = self._check_and_set(
            self.lr_warmup_steps, sd.get("lr_warmup_steps", self.lr_warmup_steps), "warmup steps (--lr-warmup-iters / --lr-warmup-samples)"
        )
        self.lr_decay_steps = self._check_and_set(
            self.lr_decay_steps, sd.get("lr_decay_steps", self.lr_decay_steps), "total number of decay steps (--lr-decay-iters / --lr-decay-samples)"
        )
        self.lr_decay_style = self._check_and_set(
            self.lr_decay_style, sd.get("lr_decay_style", self.lr_decay_style), "learning rate decay style (--lr-decay-style)"
        )
        for name, flag in (("start_wd", "--start-weight-decay"), ("end_wd", "--end-weight-decay"),
                           ("wd_incr_steps", "--train-iters"), ("wd_incr_style", "--weight-decay-incr-style")):
            if name == "wd_incr_steps" and self.wd_incr_style == "constant" and sd.get("wd_incr_style") == "constant":
                continue  # irrelevant for a constant weight decay (it follows --train-iters)
            if name in sd:
                setattr(self, name, self._check_and_set(getattr(self, name), sd[name], f"{name} ({flag})"))
        if self.override_opt_param_scheduler:
            self._restore_arg_group_lrs()
        num_steps = sd.get("num_steps", sd.get("num_iters", 0))
        self.num_steps = 0
        self.step(int(num_steps))

    def _restore_arg_group_lrs(self) -> None:
        """Put the arguments' per-group ``max_lr`` / ``min_lr`` back into the optimizer's param groups, over those a
        loaded optimizer state carried (the checkpoint's --lr / --min-lr / --decoupled-lr)."""
        groups = self._groups()
        if len(groups) != len(self._arg_group_lrs):
            raise ValueError(f"--override-opt_param-scheduler: the optimizer has {len(groups)} param groups after the "
                             f"load, {len(self._arg_group_lrs)} when the scheduler was built")
        for group, lrs in zip(groups, self._arg_group_lrs):
            group.update(lrs)
