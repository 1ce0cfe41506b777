"""The precision-aware optimizer (``--use-precision-aware-optimizer``): Adam moments kept in a lower precision.

Upstream 0.19.2 builds it on Transformer Engine's FusedAdam; this fork's :class:`PrecisionAwareAdamW` is torch only
(CPU and GPU) and follows FusedAdam's storage rules, state by state (``--exp-avg-dtype``, ``--exp-avg-sq-dtype``):

- ``fp32``: the plain tensor;
- ``bf16``: the values rounded to bfloat16, no scale;
- ``fp16``: the values divided by a per-tensor fp32 scale ``absmax / (fp16 max / 2)``, stored in float16;
- ``fp8``: the values divided by a per-tensor fp32 scale ``absmax / 448``, stored as float8 e4m3 (1 byte).

A step reads each state as fp32 (stored value x scale), runs torch's AdamW arithmetic in fp32 on it (the same
kernel as ``torch.optim.AdamW(foreach=True)``, fused on CUDA; on fp32 states and gradients the very same results), and
stores it back, recomputing the scale from the new absmax. The parameters it updates are the fp32 main params (the
distributed optimizer's slices, Megatron-FSDP's fp32 shards); their gradients may be bf16 (``--main-grads-dtype
bf16``: no fp32 copy of the reduced gradient is kept), read as fp32 inside the step. The scale of a state is kept
beside it as ``<name>_scale`` (a 0-dim fp32 tensor; 1 before the first step).

Checkpoints hold the states as upstream's do: unscaled fp32 values under the usual keys (``exp_avg``,
``exp_avg_sq``): ``state_dict()`` returns them (FusedAdam's ``get_unscaled_state``), ``load_state_dict`` stores them
in this optimizer's precision (``set_scaled_state``), so checkpoints interchange between precisions and with
upstream. A load across precisions says so in one line (:func:`log_state_conversion`).
"""
import logging
from typing import Dict, List, Optional

import torch

from megatron.core.dtensor_utils import as_layout_of, is_dtensor as _is_dtensor

logger = logging.getLogger(__name__)

STATE_KEYS = ("exp_avg", "exp_avg_sq")

# the flag values upstream accepts and the torch dtypes they map to (upstream's own args map fp8 to torch.uint8: TE's
# FP8 tensors; torch's float8_e4m3fn is the storage here)
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}
FP8_STORAGE = torch.float8_e4m3fn
# the largest stored magnitude of a scaled state (FusedAdam's ranges: half of fp16's max, fp8 e4m3's max)
_SCALED_RANGE = {torch.float16: torch.finfo(torch.float16).max / 2.0, FP8_STORAGE: 448.0}
GATHER_NUMEL = 2**25  # the most state elements a step unscales to fp32 at a time (bounds the fp32 temporaries)


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``'bf16'`` (a name given as a string is returned as it is)."""
    if isinstance(dtype, str):
        return dtype
    for name, d in DTYPE_NAMES.items():
        if d == dtype:
            return name
    if dtype == FP8_STORAGE:
        return "fp8"
    raise ValueError(f"not an optimizer state dtype: {dtype} (one of {sorted(DTYPE_NAMES)})")


def as_state_dtype(value, what: str) -> torch.dtype:
    """A flag value (``'bf16'``) or a torch dtype as the torch dtype of upstream's config (fp8: ``torch.uint8``);
    ValueError naming ``what`` otherwise."""
    if isinstance(value, str):
        if value not in DTYPE_NAMES:
            raise ValueError(f"{what}: {value!r} is not one of {sorted(DTYPE_NAMES)}")
        return DTYPE_NAMES[value]
    if value == FP8_STORAGE:
        return torch.uint8
    if value not in DTYPE_NAMES.values():
        raise ValueError(f"{what}: {value} is not one of torch.float32 / bfloat16 / float16 / uint8 (fp8)")
    return value


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a state of config dtype ``dtype`` is stored in (fp8, ``torch.uint8`` in the config: float8 e4m3)."""
    return FP8_STORAGE if dtype == torch.uint8 else dtype


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) whose ``exp_avg`` / ``exp_avg_sq`` are stored in
    ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (torch.float32, bfloat16, float16, or uint8 = fp8, as upstream's
    OptimizerConfig), scaled per tensor for fp16 / fp8 (see the module docstring)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 exp_avg_dtype: torch.dtype = torch.float32, exp_avg_sq_dtype: torch.dtype = torch.float32):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.state_dtypes = {"exp_avg": storage_dtype(as_state_dtype(exp_avg_dtype, "exp_avg_dtype")),
                             "exp_avg_sq": storage_dtype(as_state_dtype(exp_avg_sq_dtype, "exp_avg_sq_dtype"))}

    # ---- state storage (FusedAdam's get_unscaled_state / set_scaled_state) ------------------------------------
    def initialize_state(self, p: torch.Tensor) -> None:
        """Zero moments in their storage dtypes, scales 1, step 0 (what a first step would create)."""
        st = self.state[p]
        st["step"] = torch.tensor(0.0, dtype=torch.float32)
        for name in STATE_KEYS:
            st[name] = torch.zeros_like(p, dtype=self.state_dtypes[name], memory_format=torch.preserve_format)
            if self.state_dtypes[name] in _SCALED_RANGE:
                st[name + "_scale"] = torch.ones((), dtype=torch.float32, device=_device_of(p))

    @torch.no_grad()
    def get_unscaled_state(self, p: torch.Tensor, name: str) -> torch.Tensor:
        """State ``name`` of ``p`` as fp32 values (a new tensor unless it is stored in fp32: then the state itself)."""
        st = self.state[p]
        value = st[name]
        if value.dtype == torch.float32:
            return value
        out = value.float()
        scale = st.get(name + "_scale")
        if scale is not None:
            _local(out).mul_(scale)  # a DTensor state (Megatron-FSDP): its local shard, with its own scale
        return out

    @torch.no_grad()
    def set_scaled_state(self, p: torch.Tensor, name: str, unscaled: torch.Tensor) -> None:
        """Store fp32 ``unscaled`` values as state ``name`` of ``p`` in its storage dtype (fp16 / fp8: with a new
        per-tensor scale, absmax / range; a zero tensor gets scale 0, as FusedAdam)."""
        st = self.state[p]
        if name not in st:
            self.initialize_state(p)
        dest = st[name]
        if unscaled is dest:
            return
        if _is_dtensor(dest):  # Megatron-FSDP: the local shards (a plain value: the local shard or the whole tensor)
            dest, unscaled = _local(dest), _local(as_layout_of(unscaled, st[name]))
        unscaled = unscaled.reshape(dest.shape)
        rng = _SCALED_RANGE.get(dest.dtype)
        if rng is None:
            dest.copy_(unscaled)
            return
        scale = st[name + "_scale"]
        scale.copy_(unscaled.abs().amax().float() / rng)
        inv = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
        dest.copy_(unscaled.float() * inv)

    # ---- step --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            batch = []
            numel = 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self.initialize_state(p)
                batch.append(p)
                numel += p.numel()
                if numel >= GATHER_NUMEL:
                    self._step_params(group, batch)
                    batch, numel = [], 0
            if batch:
                self._step_params(group, batch)
        return loss

    def _step_params(self, group: dict, params: List[torch.Tensor]) -> None:
        """torch's AdamW arithmetic on ``params`` with their moments read as fp32 and stored back."""
        from torch.optim.adam import adam

        grads = [p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype) for p in params]
        moments = {name: [self.get_unscaled_state(p, name) for p in params] for name in STATE_KEYS}
        steps = [self.state[p]["step"] for p in params]
        beta1, beta2 = group["betas"]
        fused = all(p.device.type == "cuda" for p in params) and all(p.dtype == torch.float32 for p in params)
        if fused:  # torch's fused kernel keeps the step count on the device
            for p, s in zip(params, steps):
                if s.device != p.device:
                    self.state[p]["step"] = s.to(p.device)
            steps = [self.state[p]["step"] for p in params]
        # foreach elsewhere (CPU too): a few multi-tensor ops instead of ~10 per tensor
        adam(params, grads, moments["exp_avg"], moments["exp_avg_sq"], [], steps, fused=True if fused else None,
             foreach=None if fused else True,
             decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        for name in STATE_KEYS:
            if self.state_dtypes[name] != torch.float32:
                for p, value in zip(params, moments[name]):
                    self.set_scaled_state(p, name, value)

    # ---- state_dict: unscaled fp32, as FusedAdam's (and upstream's checkpoints) -------------------------------
    def state_dict(self) -> dict:
        sd = super().state_dict()
        by_index = dict(enumerate(p for g in self.param_groups for p in g["params"]))
        for idx, st in sd["state"].items():
            p = by_index[idx]
            new = {}
            for k, v in st.items():
                if k.endswith("_scale") and k[: -len("_scale")] in STATE_KEYS:
                    continue
                new[k] = self.get_unscaled_state(p, k).clone() if k in STATE_KEYS else v
            sd["state"][idx] = new
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load unscaled values (fp32 or any float dtype) and store them in this optimizer's precision."""
        super().load_state_dict(state_dict)  # torch casts the moments to the parameters' dtype (fp32)
        for p, st in list(self.state.items()):
            loaded = {name: st[name] for name in STATE_KEYS if name in st}
            step = st.get("step")
            self.initialize_state(p)
            if step is not None:
                st["step"] = step if isinstance(step, torch.Tensor) else torch.tensor(float(step))
            for name, value in loaded.items():
                self.set_scaled_state(p, name, value.float())


def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _device_of(p: torch.Tensor) -> torch.device:
    return _local(p).device


# ---- hooks of the distributed optimizer (distrib_optimizer.py) ---------------------------------------------------
def main_grad_dtype(config, reduce_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the distributed optimizer's main grads: bf16 with ``--main-grads-dtype bf16`` where the
    gradients are reduced in bf16 (``--bf16`` without fp32 accumulation, as upstream then sets), else fp32."""
    if (getattr(config, "use_precision_aware_optimizer", False) and getattr(config, "main_grads_dtype", None)
            == torch.bfloat16 and reduce_dtype == torch.bfloat16):
        return torch.bfloat16
    return torch.float32


def slice_state(optimizer, main: torch.Tensor) -> Dict[str, torch.Tensor]:
    """{``fp32_param``: ``main`` (detached), state key: its state} of one main param (dim > 0 tensors): the
    precision-aware optimizer's moments as fp32 values (the state itself where it is fp32, else a copy)."""
    st = optimizer.state.get(main, {})
    out = {"fp32_param": main.detach()}
    aware = isinstance(optimizer, PrecisionAwareAdamW)
    for k, v in st.items():
        if k == "step" or not isinstance(v, torch.Tensor) or v.dim() == 0:
            continue
        out[k] = optimizer.get_unscaled_state(main, k) if aware and k in STATE_KEYS else v
    return out


def set_slice_state(optimizer, main: torch.Tensor, key: str, dest: torch.Tensor, value: torch.Tensor) -> None:
    """Load ``value`` (fp32, or another float dtype) into state ``key`` of ``main`` (``dest``: what
    :func:`slice_state` gave for it): stored in the optimizer's precision."""
    if isinstance(optimizer, PrecisionAwareAdamW) and key in STATE_KEYS:
        optimizer.set_scaled_state(main, key, value.float())
    else:
        dest.copy_(value.reshape(dest.shape))


def is_precision_aware(optimizer) -> bool:
    return isinstance(optimizer, PrecisionAwareAdamW)


def state_bytes(optimizer: torch.optim.Optimizer, keys=STATE_KEYS) -> int:
    """Bytes held by the optimizer's ``keys`` states (and their scales) over all its parameters (local shards)."""
    total = 0
    for st in optimizer.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and (k in keys or (k.endswith("_scale") and k[: -len("_scale")] in keys)):
                local = getattr(v, "_local_tensor", v)
                total += local.numel() * local.element_size()
    return total


# ---- loads across precisions --------------------------------------------------------------------------------------
def checkpoint_state_dtypes(saved_args) -> Dict[str, str]:
    """The moments' precision of the run that wrote a checkpoint, from its saved ``args`` (ours and upstream's both
    keep ``exp_avg_dtype`` / ``exp_avg_sq_dtype``; absent or without ``--use-precision-aware-optimizer``: fp32)."""
    get = saved_args.get if isinstance(saved_args, dict) else (lambda k, d=None: getattr(saved_args, k, d))
    out = {}
    aware = bool(get("use_precision_aware_optimizer", False))
    for name in STATE_KEYS:
        value = get(f"{name}_dtype", None) if aware else None
        try:
            out[name] = dtype_name(as_state_dtype(value, name)) if value is not None else "fp32"
        except ValueError:
            out[name] = str(value)
    return out


def own_state_dtypes(optimizer) -> Dict[str, str]:
    """{state: 'fp32' / 'bf16' / 'fp16' / 'fp8'} of an optimizer (a torch one: fp32)."""
    if isinstance(optimizer, PrecisionAwareAdamW):
        return {name: dtype_name(optimizer.state_dtypes[name]) for name in STATE_KEYS}
    return {name: "fp32" for name in STATE_KEYS}


def conversion_message(saved: Optional[Dict[str, str]], mine: Dict[str, str]) -> Optional[str]:
    """The one line a load across precisions logs (None where the precisions are the same or unknown)."""
    if not saved:
        return None
    diffs = [f"{k} {saved[k]} -> {mine[k]}" for k in STATE_KEYS if k in saved and saved[k] != mine.get(k)]
    if not diffs:
        return None
    return ("optimizer checkpoint: Adam moments saved in another precision, converted on load (" + ", ".join(diffs)
            + "; the checkpoint holds them as fp32 values, stored here as --exp-avg-dtype / --exp-avg-sq-dtype say)")


def log_state_conversion(optimizer, metadata: Optional[dict]) -> Optional[str]:
    """Log (rank 0) and return :func:`conversion_message` for a load given ``metadata['checkpoint_state_dtypes']``
    (set by the training loop's load from the checkpoint's args)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    msg = conversion_message((metadata or {}).get("checkpoint_state_dtypes"), own_state_dtypes(inner))
    if msg is not None:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning(msg)
    return msg
