"""Meta-device initialisation that never clobbers real tensors.

A model built under ``with torch.device('meta'):`` may still hold tensors on a real device (the MoE router's
``expert_bias`` buffer is created with an explicit device). ``torch.nn.Module.to_empty`` gives EVERY tensor new,
uninitialised storage, so such a buffer silently becomes garbage. Here storage is given only to ``is_meta`` tensors,
with the mechanism ``to_empty`` itself uses (``Module._apply(fn, recurse=False)``), but with an ``is_meta`` guard in
``fn``: a tensor that is already real is returned unchanged.

Moving a parameter from meta to a real device creates a NEW ``Parameter`` object (the tensor types are not
shallow-copy compatible), and so does FSDP2 (DTensor parameters). Attributes set on the old object (``allreduce``,
``sequence_parallel``, ``shared``, anything custom in its ``__dict__``) are carried over with
:func:`copy_param_attributes`, and maps keyed by parameters (param -> name, optimizer param groups / state) are
updated with :func:`remap_param_keyed_maps`.
"""
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

from megatron.core.dist_utils import default_device
from megatron.core.dtensor_utils import local_chunk_range

__all__ = [
    "copy_param_attributes",
    "materialize_meta_tensors",
    "materialize_meta_module",
    "remap_param_keyed_maps",
    "meta_tensor_names",
    "has_meta_tensors",
    "materialize_unit",
    "module_names",
    "rebind_params",
    "snapshot_params",
]


def copy_param_attributes(old: torch.Tensor, new: torch.Tensor) -> None:
    """Copy the Python attributes of ``old`` (its ``__dict__``: ``allreduce``, ``sequence_parallel``, ``shared``,
    custom ones) onto ``new``. Private attributes the new object already has (e.g. DTensor internals) are kept."""
    if old is new:
        return
    own = getattr(new, "__dict__", {})
    for k, v in getattr(old, "__dict__", {}).items():
        if k.startswith("_") and k in own:
            continue
        setattr(new, k, v)


def _make_fn(device) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:  # only meta tensors get storage; real tensors are returned untouched
            return torch.empty_like(t, device=device)
        return t

    return fn


def materialize_meta_tensors(module: torch.nn.Module, device) -> Dict[torch.nn.Parameter, torch.nn.Parameter]:
    """Give storage to the meta parameters and buffers DIRECTLY owned by ``module`` (recurse=False); leave every
    non-meta tensor as it is. Returns ``{old Parameter: new Parameter}`` for parameters that got a new object; the
    old objects' attributes are copied onto the new ones. Values are uninitialised (call ``reset_parameters``)."""
    before = dict(module._parameters)
    if not any(t is not None and t.is_meta for t in list(before.values()) + list(module._buffers.values())):
        return {}
    # snapshot the attributes: with torch.__future__.set_swap_module_params_on_conversion(True), _apply keeps the
    # Parameter object but swaps its __dict__ (attributes) away
    saved = {name: dict(getattr(p, "__dict__", {})) for name, p in before.items() if p is not None}
    module._apply(_make_fn(device), recurse=False)
    old_to_new = {}
    for name, old in before.items():
        new = module._parameters.get(name)
        if old is None or new is None:
            continue
        own = new.__dict__
        for k, v in saved[name].items():
            if not (k.startswith("_") and k in own):
                setattr(new, k, v)
        if new is not old:
            old_to_new[old] = new
    return old_to_new


def meta_tensor_names(module: torch.nn.Module) -> List[str]:
    names = [n for n, p in module.named_parameters(remove_duplicate=False) if p.is_meta]
    names += [n for n, b in module.named_buffers(remove_duplicate=False) if b.is_meta]
    return names


def has_meta_tensors(module: torch.nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers())


def _retie(module: torch.nn.Module, seen: Dict[int, torch.nn.Parameter], originals: Dict[str, torch.nn.Parameter]):
    """A meta Parameter registered in several modules must stay ONE Parameter: the second module gets the object
    the first materialisation produced (not a second copy)."""
    for name, old in originals.items():
        if old is None or not old.is_meta:
            continue
        if id(old) in seen:
            module._parameters[name] = seen[id(old)]
        else:
            seen[id(old)] = module._parameters[name]


def materialize_module_tree(
    module: torch.nn.Module,
    device,
    init: bool = True,
    old_to_new: Optional[Dict] = None,
    _seen: Optional[Dict] = None,
    modules: Optional[Iterable[torch.nn.Module]] = None,
    names: Optional[Dict[int, str]] = None,
) -> Dict[torch.nn.Parameter, torch.nn.Parameter]:
    """Materialise ``module`` module by module in ``module.modules()`` order (or the given ``modules``), each with
    :func:`materialize_meta_tensors` then (``init``) its own ``reset_parameters()``. Returns ``old_to_new``.

    With ``init``, a module that owns meta tensors but has no ``reset_parameters()`` is an error naming it (its
    qualified name from ``names``, ``{id(module): name}``, when given): its values would be left uninitialised."""
    old_to_new = {} if old_to_new is None else old_to_new
    seen = {} if _seen is None else _seen
    for m in module.modules() if modules is None else modules:
        originals = dict(m._parameters)
        fn = getattr(m, "reset_parameters", None)
        if init and not callable(fn):
            meta = [n for n, t in originals.items() if t is not None and t.is_meta and id(t) not in seen]
            meta += [n for n, b in m._buffers.items() if b is not None and b.is_meta]
            if meta:
                where = (names or {}).get(id(m))
                label = f"{where!r} ({type(m).__name__})" if where else type(m).__name__
                raise RuntimeError(
                    f"meta-device init: module {label} has tensors {meta} on the meta device but no "
                    "reset_parameters() to initialise them; give it a reset_parameters() or build it on a real device"
                )
        materialize_meta_tensors(m, device)
        _retie(m, seen, originals)
        if init and callable(fn):
            with torch.no_grad():
                fn()
        # after reset: a module's own reset_parameters may itself replace a Parameter (e.g. TE quantized init)
        for name, old in originals.items():
            new = m._parameters.get(name)
            if old is not None and new is not None and new is not old:
                copy_param_attributes(old, new)
                old_to_new[old] = new
    return old_to_new


# ---- the construction steps DDP and Megatron-FSDP share -----------------------------------------------------
ParamSnapshot = List[Tuple[torch.nn.Module, str, torch.nn.Parameter]]


def snapshot_params(module: torch.nn.Module) -> ParamSnapshot:
    """Every ``(owning module, name, Parameter)`` of ``module`` now: what :func:`rebind_params` compares with."""
    return [(m, n, p) for m in module.modules() for n, p in m._parameters.items() if p is not None]


def module_names(module: torch.nn.Module) -> Dict[int, str]:
    """``{id(submodule): qualified name}`` for error messages."""
    return {id(m): n for n, m in module.named_modules(remove_duplicate=False)}


def materialize_unit(
    unit: torch.nn.Module,
    device,
    seen: Optional[Dict] = None,
    modules: Optional[Iterable[torch.nn.Module]] = None,
    names: Optional[Dict[int, str]] = None,
    what: str = "meta-device init",
) -> None:
    """Step "materialise one unit": give storage to ``unit``'s meta tensors and run each module's
    ``reset_parameters()`` in ``modules()`` order (only ``modules`` when given: the root's own modules, one at a
    time). ``seen`` keeps parameters tied across calls one object. Nothing is kept that would hold the full-size
    tensors alive (the old -> new mapping is rebuilt at the end by :func:`rebind_params`). With ``modules=None``,
    a meta tensor left in the unit afterwards is an error naming it."""
    materialize_module_tree(unit, device, init=True, old_to_new={}, _seen={} if seen is None else seen,
                            modules=modules, names=names)
    if modules is None:
        left = meta_tensor_names(unit)
        if left:
            raise RuntimeError(f"{what}: tensors still on the meta device: {left[:10]}")


def rebind_params(originals: ParamSnapshot, maps: Iterable = ()) -> Dict[torch.nn.Parameter, torch.nn.Parameter]:
    """Step "rebind": for every snapshotted parameter whose module now holds another object (meta -> device,
    FSDP2's DTensor), copy the original's attributes onto the live one; remap ``maps`` (see
    :func:`remap_param_keyed_maps`). Returns ``{original Parameter: live Parameter}``."""
    old_to_new = {}
    for m, n, orig in originals:
        live = m._parameters.get(n)
        if live is not None and live is not orig:
            copy_param_attributes(orig, live)
            old_to_new[orig] = live
    remap_param_keyed_maps(old_to_new, *maps)
    return old_to_new


def materialize_meta_module(module: torch.nn.Module, device=None, init: bool = True, maps: Iterable = ()):
    """Materialise a meta-built ``module`` on ``device`` (default: current CUDA device, else CPU), module by
    module in ``module.modules()`` order, calling each module's ``reset_parameters()`` right after its own tensors
    got storage, so values equal an eagerly built model's with the same seed. Tensors that are already real
    (``expert_bias``) are never touched. Parameter attributes are carried over and every map in ``maps``
    (dicts keyed by params, lists of params, torch optimizers, MegatronOptimizers) is remapped to the new
    Parameters. Returns ``{old Parameter: new Parameter}``. Raises if a meta tensor is left over, or (``init``)
    if a module with meta tensors has no ``reset_parameters()``. The whole model is one unit here (DDP)."""
    if device is None:
        device = default_device()
    originals = snapshot_params(module)
    if init:
        materialize_unit(module, device, names=module_names(module), what="materialize_meta_module")
    else:
        materialize_module_tree(module, device, init=False)
        left = meta_tensor_names(module)
        if left:
            raise RuntimeError(f"materialize_meta_module: tensors still on the meta device: {left[:10]}")
    return rebind_params(originals, maps)


# ---- remapping maps keyed by parameters ----------------------------------------------------------------
def _final(old_to_new: Dict, p):
    """Follow ``old -> new -> newer`` chains (materialisation, then FSDP2 sharding)."""
    seen = 0
    while p in old_to_new and seen < 8:
        p = old_to_new[p]
        seen += 1
    return p


def _state_like(value, new_param):
    """Move an optimizer-state tensor of the old (full) parameter into the layout of ``new_param`` (its DTensor
    shard when FSDP2 sharded it); anything else is returned as is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, torch.Tensor) or value.is_meta:
        return value
    if isinstance(new_param, DTensor) and not isinstance(value, DTensor) and tuple(value.shape) == tuple(new_param.shape):
        out = torch.zeros_like(new_param, dtype=value.dtype)
        local = out.to_local()
        start, length = local_chunk_range(new_param, "optimizer state")
        if length:
            local.copy_(value[start:start + length].to(local.device))
        return out
    return value


def remap_param_keyed_maps(old_to_new: Dict, *maps) -> None:
    """Update, in place, every map that refers to parameters in ``old_to_new`` (keys: old objects).

    Supported: dicts (keys that are old params are replaced; values that are old params too), lists (elements),
    sets, ``torch.optim.Optimizer`` (param groups and ``state``; state tensors of a parameter FSDP2 has sharded are
    sharded the same way) and objects with a ``remap_params(old_to_new)`` method (MegatronOptimizer).
    """
    if not old_to_new:
        return
    for m in maps:
        if m is None:
            continue
        if hasattr(m, "remap_params") and callable(m.remap_params):
            m.remap_params(old_to_new)
        elif isinstance(m, torch.optim.Optimizer):
            for group in m.param_groups:
                group["params"] = [_final(old_to_new, p) for p in group["params"]]
            moved = {}
            for p, st in list(m.state.items()):
                new = _final(old_to_new, p)
                if new is not p:
                    moved[new] = {k: _state_like(v, new) for k, v in st.items()}
                    del m.state[p]
            m.state.update(moved)
        elif isinstance(m, dict):
            items = list(m.items())
            m.clear()
            for k, v in items:
                k2 = _final(old_to_new, k) if isinstance(k, torch.Tensor) else k
                v2 = _final(old_to_new, v) if isinstance(v, torch.Tensor) else v
                m[k2] = v2
        elif isinstance(m, list):
            m[:] = [_final(old_to_new, p) if isinstance(p, torch.Tensor) else p for p in m]
        elif isinstance(m, set):
            items = list(m)
            m.clear()
            m.update(_final(old_to_new, p) if isinstance(p, torch.Tensor) else p for p in items)
        else:
            raise TypeError(f"remap_param_keyed_maps: cannot remap a {type(m).__name__}")
