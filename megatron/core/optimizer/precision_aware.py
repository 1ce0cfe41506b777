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

``store_param_remainders`` (upstream's OptimizerConfig field, default True; no flag, as upstream): a bf16 parameter
stepped by this optimizer (the distributed optimizer hands it the bf16 weight's own slice instead of an fp32 copy under
``--bf16``) has its fp32 master kept as the low 16 bits only (state ``master_param``, int16), beside the bf16 weight
that holds the high 16 bits: 2 B per parameter instead of 4. The rule is TE FusedAdam's (its param-remainder
kernel): the bf16 weight is the fp32 master's high half rounded up when the remainder's top bit is set (to nearest,
ties away from zero), and the master is rebuilt exactly from the two (:func:`merge_fp32` / :func:`split_fp32`). A
step rebuilds the fp32 masters, runs the same fp32 AdamW on them, and splits them back, so the masters take the very
values whole fp32 mains take; the bf16 weights equal the fp32 mains cast to bf16 except where a master's low half is
exactly 0x8000 (a tie: rounded away from zero here, to even by a cast).

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
_VALUE_KEYS = STATE_KEYS + ("master_param",)  # states held as fp32 values in a state_dict

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


def split_fp32(master: torch.Tensor):
    """fp32 values -> (bf16 weights, int16 remainders): the high 16 bits, plus one where the low half's top bit is
    set (to nearest, ties away from zero; wrapping as int16 arithmetic, as TE's kernel), and the low 16 bits."""
    halves = master.detach().float().contiguous().view(torch.int16).view(*master.shape, 2)  # little-endian: [lo, hi]
    low, high = halves[..., 0], halves[..., 1]
    return (high + (low < 0).to(torch.int16)).view(torch.bfloat16), low.clone()


def merge_fp32(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """(bf16 weights, int16 remainders) -> the fp32 values :func:`split_fp32` split (bit-exact)."""
    out = torch.empty(*weight.shape, 2, dtype=torch.int16, device=weight.device)
    out[..., 0] = remainder
    torch.sub(weight.detach().view(torch.int16), (remainder < 0).to(torch.int16), out=out[..., 1])
    return out.view(torch.float32).view(weight.shape)


def remainders_enabled(config) -> bool:
    """Whether the distributed optimizer keeps bf16 weights' fp32 masters as remainders (upstream's conditions:
    the precision-aware optimizer with fp32 main params, ``store_param_remainders`` and ``--bf16``)."""
    return bool(getattr(config, "use_precision_aware_optimizer", False)
                and getattr(config, "store_param_remainders", False) and getattr(config, "bf16", False)
                and getattr(config, "main_params_dtype", torch.float32) == torch.float32)


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a state of config dtype ``dtype`` is stored in (fp8, ``torch.uint8`` in the config: float8 e4m3)."""
    return FP8_STORAGE if dtype == torch.uint8 else dtype


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) whose ``exp_avg`` / ``exp_avg_sq`` are stored in
    ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (torch.float32, bfloat16, float16, or uint8 = fp8, as upstream's
    OptimizerConfig), scaled per tensor for fp16 / fp8 (see the module docstring)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 exp_avg_dtype: torch.dtype = torch.float32, exp_avg_sq_dtype: torch.dtype = torch.float32,
                 store_param_remainders: bool = False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.state_dtypes = {"exp_avg": storage_dtype(as_state_dtype(exp_avg_dtype, "exp_avg_dtype")),
                             "exp_avg_sq": storage_dtype(as_state_dtype(exp_avg_sq_dtype, "exp_avg_sq_dtype"))}
        self.store_param_remainders = store_param_remainders

    def has_remainder(self, p: torch.Tensor) -> bool:
        """``p`` is a bf16 weight whose fp32 master is its ``master_param`` remainder (see the module docstring)."""
        return self.store_param_remainders and p.dtype == torch.bfloat16

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 master of ``p``: rebuilt from weight and remainder (a new tensor), else ``p`` itself."""
        if not self.has_remainder(p):
            return p.detach()
        if "master_param" not in self.state[p]:
            self.initialize_state(p)
        return merge_fp32(p, self.state[p]["master_param"])

    @torch.no_grad()
    def set_master(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Store fp32 ``value`` as the master of ``p``: with a remainder both halves (the bf16 weight too)."""
        if not self.has_remainder(p):
            p.copy_(value.reshape(p.shape))
            return
        if "master_param" not in self.state[p]:
            self.initialize_state(p)
        weight, rem = split_fp32(value.reshape(p.shape))
        p.copy_(weight)
        self.state[p]["master_param"].copy_(rem)

    # ---- state storage (FusedAdam's get_unscaled_state / set_scaled_state) ------------------------------------
    def initialize_state(self, p: torch.Tensor) -> None:
        """Zero moments in their storage dtypes, scales 1, step 0 (what a first step would create)."""
        st = self.state[p]
        st["step"] = torch.tensor(0.0, dtype=torch.float32)
        for name in STATE_KEYS:
            st[name] = torch.zeros_like(p, dtype=self.state_dtypes[name], memory_format=torch.preserve_format)
            if self.state_dtypes[name] in _SCALED_RANGE:
                st[name + "_scale"] = torch.ones((), dtype=torch.float32, device=_device_of(p))
        if self.has_remainder(p):  # the master starts as the weight (remainder 0, as FusedAdam)
            st["master_param"] = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.preserve_format)

    @torch.no_grad()
    def get_unscaled_state(self, p: torch.Tensor, name: str) -> torch.Tensor:
        """State ``name`` of ``p`` as fp32 values (a new tensor unless it is stored in fp32: then the state itself);
        ``master_param``: the fp32 master rebuilt from its remainder (not the int16 remainder FusedAdam returns)."""
        if name == "master_param":
            return self.master(p)
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
        if name == "master_param":
            self.set_master(p, unscaled)
            return
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

        masters = [self.master(p) for p in params]  # fp32: the params, or rebuilt from weight and remainder
        grads = [p.grad if p.grad.dtype == m.dtype else p.grad.to(m.dtype) for p, m in zip(params, masters)]
        moments = {name: [self.get_unscaled_state(p, name) for p in params] for name in STATE_KEYS}
        steps = [self.state[p]["step"] for p in params]
        beta1, beta2 = group["betas"]
        fused = all(p.device.type == "cuda" for p in params) and all(m.dtype == torch.float32 for m in masters)
        if fused:  # torch's fused kernel keeps the step count on the device
            for p, s in zip(params, steps):
                if s.device != p.device:
                    self.state[p]["step"] = s.to(p.device)
            steps = [self.state[p]["step"] for p in params]
        # foreach elsewhere (CPU too): a few multi-tensor ops instead of ~10 per tensor
        adam(masters, grads, moments["exp_avg"], moments["exp_avg_sq"], [], steps, fused=True if fused else None,
             foreach=None if fused else True,
             decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        for p, m in zip(params, masters):
            if m is not p and self.has_remainder(p):
                self.set_master(p, m)
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
                new[k] = self.get_unscaled_state(p, k).clone() if k in _VALUE_KEYS else v
            sd["state"][idx] = new
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load unscaled values (fp32 or any float dtype) and store them in this optimizer's precision (the
        moments and an fp32 ``master_param`` are kept out of torch's load, which would cast them to the param's
        dtype: bf16 for a weight with a remainder)."""
        values, rest = {}, {}
        for idx, st in state_dict["state"].items():
            values[idx] = {k: v for k, v in st.items() if k in _VALUE_KEYS}
            rest[idx] = {k: v for k, v in st.items() if k not in _VALUE_KEYS}
        super().load_state_dict({**state_dict, "state": rest})
        by_index = dict(enumerate(p for g in self.param_groups for p in g["params"]))
        for idx, loaded in values.items():
            p = by_index[idx]
            st = self.state[p]
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
    """{``fp32_param``: the fp32 main (``main`` detached, or rebuilt from a bf16 weight slice and its remainder: a
    copy), state key: its state} of one main param (dim > 0 tensors): the precision-aware optimizer's moments as fp32
    values (the state itself where it is fp32, else a copy)."""
    st = optimizer.state.get(main, {})
    aware = isinstance(optimizer, PrecisionAwareAdamW)
    out = {"fp32_param": optimizer.master(main) if aware else main.detach()}
    for k, v in st.items():
        if k in ("step", "master_param") or not isinstance(v, torch.Tensor) or v.dim() == 0:
            continue
        out[k] = optimizer.get_unscaled_state(main, k) if aware and k in STATE_KEYS else v
    return out


def set_slice_state(optimizer, main: torch.Tensor, key: str, dest: torch.Tensor, value: torch.Tensor) -> None:
    """Load ``value`` (fp32, or another float dtype) into state ``key`` of ``main`` (``dest``: what
    :func:`slice_state` gave for it): stored in the optimizer's precision (``fp32_param`` of a weight slice with a
    remainder: both halves, the bf16 weight and the remainder)."""
    if isinstance(optimizer, PrecisionAwareAdamW) and key in STATE_KEYS:
        optimizer.set_scaled_state(main, key, value.float())
    elif key == "fp32_param" and isinstance(optimizer, PrecisionAwareAdamW) and optimizer.has_remainder(main):
        optimizer.set_master(main, value.float())
    else:
        dest.copy_(value.reshape(dest.shape))


def has_remainder(optimizer, main: torch.Tensor) -> bool:
    """``main`` is a bf16 weight slice whose fp32 master is a remainder (``store_param_remainders``)."""
    return isinstance(optimizer, PrecisionAwareAdamW) and optimizer.has_remainder(main)


def main_param_bytes(optimizer, main_params) -> int:
    """Bytes the fp32 main params take: whole fp32 copies, or the int16 remainders of bf16 weight slices (the
    weights' high halves are the model's own weights)."""
    total = 0
    for m in main_params:
        if has_remainder(optimizer, m):
            rem = optimizer.state.get(m, {}).get("master_param")
            total += 0 if rem is None else rem.numel() * rem.element_size()
        else:
            total += m.numel() * m.element_size()
    return total


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
