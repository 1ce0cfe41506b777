"""FP8 extra state of the TE layer wrappers, saved as plain data (no pickle of code-bearing objects).

What Transformer Engine itself does (read in TE's public source, 2.x up to 2.20):

- ``TransformerEngineBaseModule.get_extra_state()`` returns a ``torch.uint8`` tensor. It is EMPTY when the module holds
  no FP8 state (FP8 never enabled; recent TE also for the stateless recipes: current/tensorwise scaling, MXFP8,
  blockwise FP8, NVFP4). Otherwise it holds ``pickle.dumps(state)`` with ``state = {"recipe": <the Recipe object>,
  "extra_fp8_variables": {plain fp8_meta entries: num_gemms, fp8_checkpoint, fp8_max_fwd, ...}}`` plus, for
  delayed scaling, ``scale_fwd`` / ``amax_history_fwd`` / ``scale_bwd`` / ``amax_history_bwd`` (CPU float32 tensors
  of shape ``(n,)`` and ``(amax_history_len, n)``, ``n`` = 3 x num_gemms forward and 2 x num_gemms backward
  quantizers). The pickled recipe object is what makes the payload code-bearing. TE 1.x stored an ``io.BytesIO``
  (``torch.save`` of a similar dict, without ``recipe``, with ``scale_inv_*``).
- ``set_extra_state(state)`` accepts ``None`` and an empty tensor (no-ops), a non-empty byte tensor (unpickled) and
  the deprecated ``io.BytesIO``. It copies scale and amax history into ``fp8_meta["scaling_fwd"/"scaling_bwd"]``
  (a ``DelayedScalingRecipeState``; the module's ``Float8Quantizer`` objects view these tensors) after
  ``init_fp8_meta_tensors(recipe)``. TE 2.20 classifies the pickle without executing it (``pickletools``) and refuses
  a stateful (delayed-scaling) or unknown payload with "Refusing to load pickled Transformer Engine extra state for
  <module> ... set NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1"; stateless payloads are ignored. TE offers NO non-pickle
  form that carries delayed-scaling state.

What this module does instead (``_TEWrapperMixin`` in te_layers.py calls it):

- save: the empty ``uint8`` tensor when there is no FP8 state or the recipe is stateless (byte-identical to TE, so
  such checkpoints stay interchangeable with upstream); for delayed scaling a plain dict (:data:`FORMAT`, version,
  recipe class name and its plain fields, the plain ``fp8_meta`` entries, the four tensors on CPU) that
  ``torch.load(weights_only=True)`` accepts. Upstream Megatron/TE cannot read this dict (TE raises "Unsupported
  checkpoint format"): the price of not pickling code.
- load of our dict: the module's state is (re)initialised for the recipe the run uses (from ``config``) and scale
  and amax history are copied in place, so delayed scaling continues exactly where it stopped. A different amax
  history length is truncated / zero-padded as TE does when the recipe's length changes; a different number of
  quantizers is an error. When the run does not use delayed scaling the saved state is not needed and is skipped.
- load of TE's own pickled format (upstream checkpoints, or ours from before this format): never unpickled by us.
  A stateless payload (no delayed-scaling keys) is skipped: nothing is lost. A delayed-scaling or unrecognisable
  payload raises an error naming the module and the opt-in, unless the user set
  ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` (TE's own opt-in, honoured on purpose: one switch for one risk); then
  the value goes to TE's own ``set_extra_state``. Re-saving converts such a checkpoint to the safe format.
"""
import io
import os
import pickletools
from typing import Any, Callable

import torch

FORMAT = "megatron.te_fp8_extra_state"
VERSION = 1
UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
DIRECTIONS = ("fwd", "bwd")
TENSOR_KEYS = tuple(f"{kind}_{d}" for d in DIRECTIONS for kind in ("scale", "amax_history"))
# fp8_meta entries that describe this process's global amax buffers, not the model: never saved or restored
_TRANSIENT_META = frozenset({"buffer_index_and_autocast_key", "global_fp8_buffer_pos_fwd_recompute"})
_PICKLE_STRING_OPS = frozenset(
    {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "BINUNICODE8", "SHORT_BINUNICODE"}
)


def empty_extra_state() -> torch.Tensor:
    """What TE stores for a module without FP8 state: an empty uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8)


def _is_plain(value: Any) -> bool:
    if isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    return False


def _is_delayed(recipe) -> bool:
    delayed = getattr(recipe, "delayed", None)
    return bool(delayed()) if callable(delayed) else False


def _recipe_fields(recipe) -> dict:
    """The recipe's plain settings (enums by name), for the record; the load takes the recipe from the run's config."""
    out = {}
    for name, value in vars(recipe).items():
        if name.startswith("_"):
            continue
        if hasattr(value, "name") and isinstance(getattr(value, "name"), str) and not isinstance(value, str):
            value = value.name  # enum member (fp8_format)
        if value is None or _is_plain(value):
            out[name] = value
    return out


def save_extra_state(module) -> Any:
    """The module's FP8 extra state as weights_only-loadable data (see the module docstring)."""
    meta = getattr(module, "fp8_meta", None) or {}
    has_fp8 = meta.get("fp8_checkpoint") or getattr(module, "fp8", False) or getattr(module, "fp8_calibration", False)
    recipe = meta.get("recipe")
    if not has_fp8 or not _is_delayed(recipe) or "scaling_fwd" not in meta or "scaling_bwd" not in meta:
        return empty_extra_state()
    state = {
        "format": FORMAT,
        "version": VERSION,
        "recipe": type(recipe).__name__,
        "recipe_fields": _recipe_fields(recipe),
        "fp8_meta": {
            k: v for k, v in meta.items() if isinstance(k, str) and k not in _TRANSIENT_META and _is_plain(v)
        },
    }
    for d in DIRECTIONS:
        scaling = meta[f"scaling_{d}"]
        state[f"scale_{d}"] = scaling.scale.detach().to("cpu", copy=True)
        state[f"amax_history_{d}"] = scaling.amax_history.detach().to("cpu", copy=True)
    return state


def load_extra_state(module, state: Any, recipe, te_set_extra_state: Callable[[Any], None]) -> None:
    """Restore ``state`` (what :func:`save_extra_state` or TE wrote) into ``module``.

    ``recipe``: the quantization recipe the run uses (None without FP8). ``te_set_extra_state``: TE's own
    ``set_extra_state``, used only for TE's pickled format with the unsafe opt-in.
    """
    name = type(module).__name__
    if state is None:
        return
    if isinstance(state, torch.Tensor):
        if state.numel() == 0:
            return  # TE: no FP8 state
        if state.dtype != torch.uint8 or state.dim() != 1:
            raise ValueError(f"{name}: extra state is a {state.dtype} tensor of shape {tuple(state.shape)}; expected "
                             f"a 1-D uint8 tensor (Transformer Engine) or a dict in format {FORMAT!r}")
        data = state.detach().cpu().numpy().tobytes()
        if not _te_pickle_carries_state(data):
            return  # a stateless recipe's payload: nothing to restore, and it is never unpickled
        _legacy(name, state, te_set_extra_state)
        return
    if isinstance(state, io.BytesIO):  # TE 1.x format
        _legacy(name, state, te_set_extra_state)
        return
    if isinstance(state, dict) and state.get("format") == FORMAT:
        _apply(module, name, state, recipe)
        return
    raise ValueError(
        f"{name}: unsupported extra state of type {type(state).__name__}; expected None, a uint8 tensor "
        f"(Transformer Engine) or a dict in format {FORMAT!r}"
    )


def _te_pickle_carries_state(data: bytes) -> bool:
    """Whether a TE pickle payload holds delayed-scaling state (or cannot be recognised), read with ``pickletools``
    (which parses opcodes and executes nothing)."""
    strings = set()
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in _PICKLE_STRING_OPS:
                strings.add(arg.decode("utf-8", "replace") if isinstance(arg, bytes) else arg)
            elif op.name == "GLOBAL" and isinstance(arg, str):  # protocols 0-3: "module name"
                strings.update(arg.split())
    except Exception:  # not a pickle: unrecognisable
        return True
    if "recipe" not in strings:
        return True  # TE 1.x (delayed scaling only) or not TE's shape
    return any(k in strings for k in TENSOR_KEYS) or "DelayedScaling" in strings


def _legacy(name: str, state, te_set_extra_state) -> None:
    if os.environ.get(UNSAFE_PICKLE_ENV) == "1":
        te_set_extra_state(state)
        return
    raise RuntimeError(
        f"{name}: refusing to unpickle Transformer Engine's pickled FP8 (delayed-scaling) extra state; unpickling can "
        "execute arbitrary code, and nothing was executed. Such state is written by upstream Megatron / Transformer "
        "Engine, and by this project before it saved FP8 extra state as plain tensors. If you trust this checkpoint, "
        f"set {UNSAFE_PICKLE_ENV}=1 to let Transformer Engine load it; saving again then writes the safe format."
    )


def _apply(module, name: str, state: dict, recipe) -> None:
    version = state.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise ValueError(f"{name}: extra state format {FORMAT!r} version {version!r}; this code reads up to {VERSION}")
    present = [k for k in TENSOR_KEYS if k in state]
    if not present:
        return
    if len(present) != len(TENSOR_KEYS) or not all(isinstance(state[k], torch.Tensor) for k in TENSOR_KEYS):
        raise ValueError(f"{name}: delayed-scaling extra state needs tensors {list(TENSOR_KEYS)}, has {present}")
    saved_meta = state.get("fp8_meta")
    if not isinstance(saved_meta, dict) or not isinstance(saved_meta.get("num_gemms"), int):
        raise ValueError(f"{name}: delayed-scaling extra state lacks fp8_meta['num_gemms']")
    if recipe is None or not _is_delayed(recipe):
        return  # this run does not use delayed scaling: the saved scales are not needed
    meta = module.fp8_meta
    meta.update({k: v for k, v in saved_meta.items() if k not in _TRANSIENT_META and _is_plain(v)})
    meta.pop("global_fp8_buffer_pos_fwd_recompute", None)
    meta["recipe"] = recipe
    module.init_fp8_meta_tensors(recipe)
    with torch.no_grad():
        for d in DIRECTIONS:
            scaling = meta[f"scaling_{d}"]
            scale, hist = state[f"scale_{d}"], state[f"amax_history_{d}"]
            if scale.shape != scaling.scale.shape or hist.dim() != 2 or hist.shape[1] != scaling.amax_history.shape[1]:
                raise ValueError(
                    f"{name}: saved {d} scale {tuple(scale.shape)} / amax history {tuple(hist.shape)} do not fit this "
                    f"module's {tuple(scaling.scale.shape)} / {tuple(scaling.amax_history.shape)} (a different layer?)"
                )
            scaling.scale.copy_(scale)
            dst = scaling.amax_history
            rows = min(dst.shape[0], hist.shape[0])  # a changed amax_history_len: truncate / zero-pad, as TE does
            dst[:rows].copy_(hist[:rows])
            dst[rows:].zero_()


# ---- grouped linears (TE GroupedLinear: one module, num_gemms experts) ----------------------------------------
# TE keeps the quantizers of a grouped linear kind-major: forward ``[input_0..input_{n-1}, weight_0.., output_0..]``
# (3 x n), backward 2 x n, as upstream's TEGroupedLinear splits them. A checkpoint holds one ``_extra_state`` per
# expert in the layout of a single linear (num_gemms 1), so grouped and sequential experts interchange it.
_KINDS = {"fwd": 3, "bwd": 2}


def split_gemm_state(state: Any, num_gemms: int, gemm: int) -> Any:
    """Expert ``gemm``'s extra state (a single linear's layout) out of a grouped linear's ``state``. States without
    delayed-scaling tensors (the empty tensor, stateless dicts) are the same for every expert."""
    if not (isinstance(state, dict) and state.get("format") == FORMAT and "scale_fwd" in state):
        return state
    out = {k: v for k, v in state.items() if k not in TENSOR_KEYS}
    out["fp8_meta"] = dict(state.get("fp8_meta", {}), num_gemms=1)
    for d, kinds in _KINDS.items():
        out[f"scale_{d}"] = state[f"scale_{d}"].view(kinds, num_gemms)[:, gemm].clone()
        hist = state[f"amax_history_{d}"]
        out[f"amax_history_{d}"] = hist.view(hist.shape[0], kinds, num_gemms)[:, :, gemm].clone()
    return out


def merge_gemm_states(states: list, name: str = "grouped linear") -> Any:
    """The inverse of :func:`split_gemm_state`: one grouped state out of the experts' states (in local order)."""
    delayed = [isinstance(s, dict) and s.get("format") == FORMAT and "scale_fwd" in s for s in states]
    if not any(delayed):
        return states[0]
    if not all(delayed):
        raise ValueError(f"{name}: some experts' extra state holds delayed-scaling FP8 state and some does not")
    first = states[0]
    out = {k: v for k, v in first.items() if k not in TENSOR_KEYS}
    out["fp8_meta"] = dict(first.get("fp8_meta", {}), num_gemms=len(states))
    for d, kinds in _KINDS.items():
        out[f"scale_{d}"] = torch.stack([s[f"scale_{d}"].reshape(kinds) for s in states], dim=1).reshape(-1)
        hists = [s[f"amax_history_{d}"] for s in states]
        rows = hists[0].shape[0]
        if any(h.shape != (rows, kinds) for h in hists):
            raise ValueError(f"{name}: experts' {d} amax histories differ in shape: {[tuple(h.shape) for h in hists]}")
        out[f"amax_history_{d}"] = torch.stack(hists, dim=2).reshape(rows, -1)
    return out
