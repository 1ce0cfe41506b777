"""fp16 loss scaling (upstream's ``MegatronGradScaler`` family): the loss is multiplied by ``scale`` before the
backward pass and the gradients by ``inv_scale`` before the optimizer step.

``ConstantGradScaler`` (``--loss-scale``) never changes the scale. ``DynamicGradScaler`` (``--fp16`` without
``--loss-scale``): after ``hysteresis`` iterations with inf/nan gradients (not necessarily in a row: the counter
is only reset by a growth) the scale is multiplied by ``backoff_factor`` (not below ``min_scale``); after
``growth_interval`` iterations in a row without inf/nan it is multiplied by ``growth_factor`` and the hysteresis
counter is reset. ``state_dict()`` has upstream's keys (``scale``, ``growth_tracker``, ``hysteresis_tracker``).
"""
from typing import Dict, Optional

import torch

from megatron.core.dist_utils import default_device


class MegatronGradScaler:
    """Holds the loss scale as a one-element fp32 tensor (upstream's shape) on ``device``."""

    def __init__(self, initial_scale: float, device=None):
        if not initial_scale > 0.0:
            raise ValueError(f"loss scale (--loss-scale / --initial-loss-scale) must be positive, got {initial_scale}")
        self.device = torch.device(device) if device is not None else default_device()
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float32, device=self.device)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> Dict:
        raise NotImplementedError

    def load_state_dict(self, state_dict: Dict) -> None:
        raise NotImplementedError


class ConstantGradScaler(MegatronGradScaler):
    """``--loss-scale``: a fixed scale (a step with inf/nan gradients is still skipped). No state to save."""

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> Dict:
        return {}

    def load_state_dict(self, state_dict: Dict) -> None:
        pass


class DynamicGradScaler(MegatronGradScaler):
    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float, backoff_factor: float,
                 growth_interval: int, hysteresis: int, device=None):
        super().__init__(initial_scale, device)
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(f"--min-loss-scale must be in (0, --initial-loss-scale={initial_scale}], got {min_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"loss scale growth factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"loss scale backoff factor must be in (0, 1), got {backoff_factor}")
        if int(growth_interval) <= 0:
            raise ValueError(f"--loss-scale-window must be positive, got {growth_interval}")
        if int(hysteresis) <= 0:
            raise ValueError(f"--hysteresis must be positive, got {hysteresis}")
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float32, device=self.device)
        self.growth_factor = torch.tensor([float(growth_factor)], dtype=torch.float32, device=self.device)
        self.backoff_factor = torch.tensor([float(backoff_factor)], dtype=torch.float32, device=self.device)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale = self._scale * self.growth_factor

    def state_dict(self) -> Dict:
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict: Dict) -> None:
        missing = [k for k in ("scale", "growth_tracker", "hysteresis_tracker") if k not in state_dict]
        if missing:
            raise KeyError(f"grad_scaler state: missing {missing} (has {sorted(state_dict)})")
        scale = torch.as_tensor(state_dict["scale"], dtype=torch.float32).reshape(-1)
        if scale.numel() != 1 or not torch.isfinite(scale).all() or not float(scale[0]) > 0:
            raise ValueError(f"grad_scaler state: 'scale' must be one positive finite value, got {scale.tolist()}")
        self._scale = scale.to(self.device).clone()
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])


def build_grad_scaler(config, device=None) -> Optional[MegatronGradScaler]:
    """The scaler ``OptimizerConfig`` asks for: None without ``fp16``; ``ConstantGradScaler(loss_scale)`` with a
    static ``loss_scale``; else ``DynamicGradScaler`` (growth x2, backoff x0.5, as upstream)."""
    if not getattr(config, "fp16", False):
        return None
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale, device)
    return DynamicGradScaler(config.initial_loss_scale, config.min_loss_scale, growth_factor=2.0, backoff_factor=0.5,
                             growth_interval=config.loss_scale_window, hysteresis=config.hysteresis, device=device)
