"""MegatronOptimizer: a torch.optim optimizer (AdamW / SGD) with global grad-norm clipping, fp32 main params for
bf16/fp16 models, and ``sharded_state_dict`` for dist_checkpointing. Works with plain tensors (DDP) and with FSDP2
DTensor parameters (Megatron-FSDP: the optimizer state is then sharded like the parameters)."""
import math
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_utils import get_world_size, is_distributed
from megatron.core.dist_utils import foreach_copy as _foreach_copy
from megatron.core.dtensor_utils import as_layout_of as _as_layout_of
from megatron.core.dtensor_utils import is_dtensor as _is_dtensor  # the one DTensor check


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor object itself (no autograd ``to_local`` call, the same object every time: its
    identity tells whether the optimizer replaced a state tensor; everything here runs without grad); any other
    tensor as it is."""
    if not _is_dtensor(t):
        return t
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()


def _locals(tensors: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
    """:func:`_local` of each tensor (None stays None), in one pass (called per step on every gradient)."""
    out = []
    for t in tensors:
        if t is not None and _is_dtensor(t):
            local = getattr(t, "_local_tensor", None)
            t = local if isinstance(local, torch.Tensor) else t.to_local()
        out.append(t)
    return out


def _is_quantized_param(p: torch.Tensor) -> bool:
    """A TE quantized weight (``--fp8-param-gather`` / ``--fp4-param-gather``), plain or as a DTensor's shard."""
    from megatron.core.fp8_utils import is_quantized_tensor

    return is_quantized_tensor(_local(p))


def _needs_main_param(p: torch.Tensor) -> bool:
    """Needs an fp32 main copy: a bf16/fp16 tensor (DDP with --bf16; FSDP shards kept in bf16 beside FP8
    weights) or a quantized weight."""
    if _is_quantized_param(p):
        return True
    return p.is_floating_point() and p.dtype in (torch.float16, torch.bfloat16)


def _fp32_main_param(p: torch.Tensor) -> torch.nn.Parameter:
    """fp32 copy of ``p``'s values in ``p``'s layout (a DTensor shard stays a DTensor with the same placement)."""
    from megatron.core.fp8_utils import dequantize, is_quantized_tensor

    local = _local(p).detach()
    local = (dequantize(local) if is_quantized_tensor(local) else local).float().clone()
    if _is_dtensor(p):
        from torch.distributed.tensor import DTensor

        local = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                   stride=p.stride())
    return torch.nn.Parameter(local, requires_grad=p.requires_grad)


@torch.no_grad()
def scale_tensors_(tensors: List[torch.Tensor], factor: float) -> None:
    """Multiply plain (local) tensors in place by ``factor``: the fp32 ones (main grads: the usual case) with one
    ``torch._foreach_mul_`` per device (the same products as ``t.mul_(factor)``, without a launch and, for DTensors,
    a dispatch per tensor); others one by one (``_foreach_mul_`` rounds a scalar factor differently for bf16)."""
    groups: Dict[torch.device, List[torch.Tensor]] = {}
    for t in tensors:
        if t.dtype == torch.float32:
            groups.setdefault(t.device, []).append(t)
        else:
            t.mul_(factor)
    for ts in groups.values():
        torch._foreach_mul_(ts, factor)


FP32_MAIN_PARAMS_KEYS = ("optimizer.state.fp32_param", "optimizer.state.param")
"""Where a checkpoint keeps fp32 main params besides the model weights, by key prefix: DDP with --bf16 / --fp16
(``fp32_param``) and upstream's ``fully_reshardable`` distributed optimizer (``param``)."""


def fp32_main_params_location(tensor_keys) -> Optional[str]:
    """Where a checkpoint with these tensor keys keeps the fp32 main params: a key prefix of
    :data:`FP32_MAIN_PARAMS_KEYS` (DDP / the distributed optimizer with --bf16 / --fp16, or FP8 weights), ``"model"``
    (an optimizer state without them: the weights are the main params, Megatron-FSDP's fp32 shards or a fp32 run), or
    None (no optimizer state, or another layout)."""
    keys = list(tensor_keys)
    for prefix in FP32_MAIN_PARAMS_KEYS:  # first: fp32 weights may be quantized values (FP8 params, fp32 nominal)
        if any(k.startswith(prefix + ".") for k in keys):
            return prefix
    return "model" if any(k.startswith("optimizer.state.") for k in keys) else None


def fp32_main_params_request(opt, metadata: Optional[dict]) -> Optional[str]:
    """What ``opt.sharded_state_dict`` asks for besides its own state when loading a checkpoint whose fp32 main
    params are at ``metadata["checkpoint_fp32_main_params"]``: None where the checkpoint's layout is the one this
    optimizer writes itself (main params as ``fp32_param``, or none beside fp32 weights), else that location."""
    where = (metadata or {}).get("checkpoint_fp32_main_params")
    if where is None:
        return None
    if opt.main_params is not None:
        return None if where == "optimizer.state.fp32_param" else where
    if where == "model":
        return None
    fp32 = all(_local(p).dtype == torch.float32 for p in opt.model_params)
    return where if fp32 else None


def _sharded_like(sh, tensor: torch.Tensor, prefix: Optional[str]):
    """``sh`` (a parameter's ShardedTensor) for ``tensor``: key ``<prefix>.<key>``, or ``sh``'s own key for None."""
    import dataclasses

    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    out = make_sharded_optimizer_tensor(sh, tensor, prefix or "_")
    return out if prefix else dataclasses.replace(out, key=sh.key)


@torch.no_grad()
def sum_of_squared_norms(tensors: List[torch.Tensor], device) -> torch.Tensor:
    """``sum(||t||_2 ** 2)`` over plain (local) tensors as a float64 scalar on ``device``, without a host sync: one
    fp32 norm per tensor (the reduction upcasts as it reads: no float64 copy of a large gradient), computed by
    ``torch._foreach_norm`` per (device, dtype) group (a few fused launches instead of four per tensor), then squared
    and summed in float64."""
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    parts = [torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float32)).to(device, torch.float64).square().sum()
             for ts in groups.values()]
    if len(parts) == 1:
        return parts[0]  # the value 0.0 + parts[0] would have: no zeros and add launched for the usual one group
    total = torch.zeros((), dtype=torch.float64, device=device)
    for part in parts:
        total += part
    return total


def norm_kind(param) -> Optional[str]:
    """Where ``param``'s gradient counts in the global norm on this rank: ``'dense'``, ``'expert'`` (``allreduce``
    False: summed over the expert groups), or None for a tensor-parallel duplicate (a TP-replicated parameter off TP
    rank 0, see ``param_is_not_tensor_parallel_duplicate``). Fixed for a parameter, so callers may keep it."""
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

    if not param_is_not_tensor_parallel_duplicate(param) or getattr(param, "tied_output_copy", False):
        return None  # a TP duplicate, or the last pipeline stage's copy of tied word embeddings
    return "dense" if getattr(param, "allreduce", True) else "expert"


@torch.no_grad()
def dtensor_shard_group(t) -> Optional[dist.ProcessGroup]:
    """The process group of the mesh dimension a DTensor is sharded on (Megatron-FSDP: the data-parallel or, for
    experts, the expert-data-parallel group; under hybrid sharding the inner, sharding group); None when it is
    not sharded (replicated on every mesh dimension)."""
    from torch.distributed.tensor import Shard

    dims = [i for i, pl in enumerate(t.placements) if isinstance(pl, Shard)]
    if not dims:
        return None
    return t.device_mesh.get_group(mesh_dim=dims[-1])


def global_grad_norm(entries, shard_group=None, kinds: Optional[List[Optional[str]]] = None) -> float:
    """L2 norm over ``entries`` = ``(model parameter, local gradient or None)`` pairs with each value counted once:
    a TP-split parameter on every TP rank, a TP-replicated one on TP rank 0 only
    (``param_is_not_tensor_parallel_duplicate``). The squares are summed over ``shard_group`` first when the local
    gradients are shards of it (Megatron-FSDP's mesh, the distributed optimizer's DP group; a dict ``{'dense':
    group, 'expert': group}`` when the two kinds are sharded over different groups), then dense ones over the
    tensor-parallel group and expert ones (``allreduce=False``) over the expert tensor x model parallel group (each EP
    rank holds other experts), then both over the pipeline group (each stage holds other layers). ``kinds``: each entry's :func:`norm_kind`, when the caller keeps them. Collective;
    the same value on every rank."""
    grads = {"dense": [], "expert": []}
    for i, (mp, g) in enumerate(entries):
        kind = None if g is None else (kinds[i] if kinds is not None else norm_kind(mp))
        if kind is not None:
            grads[kind].append(g)
    return grad_norm_of_kinds(grads, shard_group)


def grad_norm_of_kinds(grads: Dict[str, List[torch.Tensor]], shard_group=None) -> float:
    """:func:`global_grad_norm` of local tensors already split by kind (``{'dense': [...], 'expert': [...]}``): the
    same sums and collectives. A kind with no tensor on this rank costs nothing (no zero tensor, no add) unless a
    collective sums it with other ranks' values."""
    device = parallel_state.collective_device() if is_distributed() else torch.device("cpu")
    groups = shard_group if isinstance(shard_group, dict) else {kind: shard_group for kind in grads}
    shard_reduce = {}
    for kind in grads:
        group = groups.get(kind)
        shard_reduce[kind] = group is not None and dist.get_world_size(group) > 1
    mp_groups = {}
    for kind, group in (("dense", parallel_state.get_tensor_model_parallel_group(check_initialized=False)),
                        ("expert", parallel_state.get_expert_tensor_and_model_parallel_group(check_initialized=False))):
        mp_groups[kind] = group if group is not None and get_world_size(group) > 1 else None
    pp_group = parallel_state.get_pipeline_model_parallel_group(check_initialized=False)
    pp = pp_group is not None and get_world_size(pp_group) > 1
    sums = {kind: sum_of_squared_norms(ts, device) for kind, ts in grads.items()
            if ts or shard_reduce[kind] or mp_groups.get(kind) is not None or pp}
    for kind, t in sums.items():
        if shard_reduce[kind]:
            dist.all_reduce(t, group=groups[kind])
    for kind in ("dense", "expert"):
        if kind in sums and mp_groups[kind] is not None:
            dist.all_reduce(sums[kind], group=mp_groups[kind])
    if pp:
        both = torch.stack([sums["dense"], sums["expert"]])
        dist.all_reduce(both, group=pp_group)
        sums = {"dense": both[0], "expert": both[1]}
    if not sums:
        return 0.0
    parts = list(sums.values())
    total_t = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    total = float(total_t.item())
    return math.sqrt(total) if math.isfinite(total) else float("nan")


def _count_zeros(tensors: List[torch.Tensor]) -> int:
    """Zero elements of ``tensors``: counted on their devices, read on the host once (not once per tensor)."""
    if not tensors:
        return 0
    per_device: Dict[torch.device, torch.Tensor] = {}
    for t in tensors:
        n = (t == 0).sum()
        per_device[t.device] = per_device[t.device] + n if t.device in per_device else n
    return sum(int(v.item()) for v in per_device.values())  # one read per device (one device: one read)


class _CopyPlan:
    """What :meth:`MegatronOptimizer._copy_model_grads_to_main` and ``_copy_main_params_to_model`` need per
    parameter, computed once: ``pairs`` ``(index, model param, main param)`` where they differ; ``quantized`` the
    (model local, main local) pairs of quantized weights (copied one by one); ``plain_groups`` the other pairs'
    local tensors grouped for ``torch._foreach_copy_`` by (device, dtype, source device, source dtype). Valid while
    the two lists are the same objects and every DTensor's local tensor is the one it was built from
    (:meth:`matches`)."""

    def __init__(self, model_params: List[torch.Tensor], main_params: List[torch.Tensor]):
        self.model_params, self.main_params = model_params, main_params
        self.pairs = [(i, mp, main) for i, (mp, main) in enumerate(zip(model_params, main_params)) if mp is not main]
        self.locals = [(t, _local(t)) for _, mp, main in self.pairs for t in (mp, main) if _is_dtensor(t)]
        self.quantized = []
        groups: Dict[tuple, Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}
        for _, mp, main in self.pairs:
            d, s = _local(mp), _local(main)
            if _is_quantized_param(mp):
                self.quantized.append((d, s))
            else:
                ds, ss = groups.setdefault((d.device, d.dtype, s.device, s.dtype), ([], []))
                ds.append(d)
                ss.append(s)
        self.plain_groups = list(groups.values())
        self.grad_locals: Optional[List[Optional[torch.Tensor]]] = None  # see grad_bufs
        self.grad_bufs_of = None

    def grad_bufs(self, opt: "MegatronOptimizer") -> Tuple[List[Optional[torch.Tensor]], List[Optional[torch.Tensor]]]:
        """``opt``'s persistent fp32 main-grad buffers (one per main param, made at its first gradient; kept across
        plans) and their local tensors; a buffer whose shape no longer fits its main param is dropped once per
        plan."""
        bufs = opt._main_grad_bufs
        if bufs is None:
            bufs = opt._main_grad_bufs = [None] * len(self.main_params)
        if self.grad_locals is None or self.grad_bufs_of is not bufs:
            self.grad_bufs_of = bufs
            for i, main in enumerate(self.main_params):
                if bufs[i] is not None and bufs[i].shape != main.shape:
                    bufs[i] = None
            self.grad_locals = [None if b is None else _local(b) for b in bufs]
        return bufs, self.grad_locals

    def matches(self, model_params, main_params) -> bool:
        if model_params is not self.model_params or main_params is not self.main_params:
            return False
        for t, local in self.locals:
            if t._local_tensor is not local:
                return False
        return True


class _LocalStepPlan:
    """What :meth:`MegatronOptimizer._update` swaps into the torch optimizer for one ``step()`` when parameters are
    DTensors, kept across steps: per param group the list of local parameters (a DTensor parameter's detached view
    of its local shard, any other parameter itself) and, per DTensor parameter, an :class:`_LocalEntry`. Valid while
    the optimizer's param groups and their param lists are the same objects holding the same parameters and
    ``optimizer.state`` is the same object (checked by :meth:`matches` every step)."""

    def __init__(self, opt: torch.optim.Optimizer):
        self.state_obj = opt.state
        self.groups = [(g, g["params"], tuple(g["params"])) for g in opt.param_groups]
        self.local_params: List[List[torch.Tensor]] = []
        self.entries: List["_LocalEntry"] = []
        self.plain: List[torch.Tensor] = []  # non-DTensor parameters: their state dicts are used as they are
        for g in opt.param_groups:
            ps = []
            for p in g["params"]:
                if _is_dtensor(p):
                    e = _LocalEntry(p)
                    self.entries.append(e)
                    ps.append(e.view)
                else:
                    self.plain.append(p)
                    ps.append(p)
            self.local_params.append(ps)

    def matches(self, opt: torch.optim.Optimizer) -> bool:
        if opt.state is not self.state_obj or len(opt.param_groups) != len(self.groups):
            return False
        for g, (cg, plist, snapshot) in zip(opt.param_groups, self.groups):
            if g is not cg or g["params"] is not plist or len(plist) != len(snapshot):
                return False
            for a, b in zip(plist, snapshot):
                if a is not b:
                    return False
        for e in self.entries:
            if getattr(e.param, "_local_tensor", None) is not e.local:  # FSDP2 re-created the shard (a reload)
                return False
        return True

    def local_state(self, saved_state) -> defaultdict:
        """The state the torch optimizer sees for this step (keyed by the local parameters); also sets each view's
        ``.grad`` to the local gradient."""
        local_state = defaultdict(dict)
        for p in self.plain:
            local_state[p] = saved_state[p]
        for e in self.entries:
            local_state[e.view] = e.local_state(saved_state)
        return local_state

    def write_back(self, saved_state) -> None:
        for e in self.entries:
            e.write_back(saved_state)


class _LocalEntry:
    """One DTensor parameter of :class:`_LocalStepPlan`: its local tensor, a detached view of it, and the dict of
    local state tensors handed to the torch optimizer, with the (DTensor) entries of the live state dict it was made
    from (rebuilt when any differs) and the local tensors put in it (what the optimizer created or replaced is
    written back to the live state)."""

    __slots__ = ("param", "local", "view", "live", "live_items", "st", "st_items")

    def __init__(self, p: torch.Tensor):
        self.param = p
        self.local = _local(p)
        self.view = self.local.detach()
        self.live = self.live_items = self.st = self.st_items = None

    def local_state(self, saved_state) -> dict:
        p = self.param
        g = p.grad
        self.view.grad = None if g is None else _local(g)
        live = saved_state[p]
        items = self.live_items
        fresh = live is self.live and items is not None and len(live) == len(items)
        if fresh:
            for k, v in items:
                if live.get(k) is not v:
                    fresh = False
                    break
        if not fresh:
            self.live = live
            self.live_items = tuple(live.items())
            self.st = {k: _local(v) for k, v in self.live_items}
            self.st_items = tuple(self.st.items())
        return self.st

    def write_back(self, saved_state) -> None:
        self.view.grad = None
        st, items = self.st, self.st_items
        if st is None:
            return
        same = len(st) == len(items)
        if same:
            for k, v in items:
                if st.get(k) is not v:
                    same = False
                    break
        if same:
            return
        live = saved_state[self.param]
        for k, v in st.items():
            if not isinstance(v, torch.Tensor) or _local(live.get(k)) is not v:
                live[k] = _as_layout_of(v, self.param) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
        self.live = self.live_items = self.st = self.st_items = None  # rebuilt from the live state next step


class MegatronOptimizer:
    """Wraps ``optimizer`` (built over ``main params``: the model params themselves, or fp32 copies of bf16/fp16
    model params). ``step()`` returns ``(update_successful, grad_norm, num_zeros_in_grad)``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config,
        model_params: List[torch.Tensor],
        param_to_name: Dict[torch.Tensor, str],
        main_params: Optional[List[torch.Tensor]] = None,
        grad_scaler=None,
    ):
        self.optimizer = optimizer
        self.grad_scaler = grad_scaler  # fp16: a MegatronGradScaler (grad_scaler.py); None otherwise
        self.config = config
        self.model_params = list(model_params)  # in optimizer param order (groups concatenated)
        self.main_params = list(main_params) if main_params is not None else None
        self.param_to_name = dict(param_to_name)
        self._main_grad_bufs: Optional[List[Optional[torch.Tensor]]] = None  # fp32 main grads, made on first step
        self._copy_plan_cache: Optional[_CopyPlan] = None  # see _copy_plan
        self._norm_kinds: Optional[List[Optional[str]]] = None  # per model param (norm_kind), on first step
        self._kind_groups: Optional[Dict[str, dist.ProcessGroup]] = None  # see _shard_groups
        self._local_plan: Optional[_LocalStepPlan] = None  # see _update
        opt_order = [p for g in optimizer.param_groups for p in g["params"]]
        expected = self.main_params if self.main_params is not None else self.model_params
        if len(opt_order) != len(expected) or any(a is not b for a, b in zip(opt_order, expected)):
            raise ValueError("MegatronOptimizer: optimizer param order differs from the given model/main params")

    # ---- torch.optim-like surface ------------------------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    def get_parameters(self) -> List[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def get_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def get_loss_scale(self) -> torch.Tensor:
        """The factor the training loop multiplies the loss by: the fp16 loss scale, else 1."""
        if self.grad_scaler is None:
            return torch.tensor([1.0], dtype=torch.float32)
        return self.grad_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params + (self.main_params or []):
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad = None

    def remap_params(self, old_to_new: Dict) -> None:
        """Point at new Parameter objects (meta-init / FSDP2 wrapping after the optimizer was built)."""
        from megatron.core.distributed.fsdp.meta_init import _final, remap_param_keyed_maps

        self.model_params = [_final(old_to_new, p) for p in self.model_params]
        self._copy_plan_cache = None  # rebuilt for the new objects
        self._norm_kinds = self._kind_groups = None
        self._local_plan = None
        self.param_to_name = {_final(old_to_new, p): n for p, n in self.param_to_name.items()}
        if self.main_params is None:
            remap_param_keyed_maps(old_to_new, self.optimizer)

    # ---- gradients ---------------------------------------------------------------------------------------
    def _copy_plan(self) -> "_CopyPlan":
        """The per-parameter facts of the main <-> model copies, kept while ``model_params`` and ``main_params`` are
        the same lists (``remap_params`` makes a new one) and the DTensors' local tensors the same objects."""
        plan = self._copy_plan_cache
        if plan is None or not plan.matches(self.model_params, self.main_params):
            plan = self._copy_plan_cache = _CopyPlan(self.model_params, self.main_params)
        return plan

    @torch.no_grad()
    def _copy_model_grads_to_main(self) -> None:
        """main.grad = the model grad in fp32. A plain fp32 gradient of the main param's shape (DDP's fp32 reduced
        ``main_grad``, ``--accumulate-allreduce-grads-in-fp32``) IS the main grad, no copy (as upstream's
        ``main_grad.float()``: 4 bytes per parameter less). Others go into one persistent fp32 buffer per main param,
        all copied by one ``torch._foreach_copy_`` over the local tensors (not a new tensor and a DTensor dispatch per
        param)."""
        if self.main_params is None:
            return
        plan = self._copy_plan()
        bufs, locs = plan.grad_bufs(self)
        dst, src = [], []
        for i, mp, main in plan.pairs:
            g = getattr(mp, "main_grad", None)
            if g is None:
                g = mp.grad
            if g is None:
                main.grad = None
                continue
            if (g.dtype == torch.float32 and g.shape == main.shape and g.device == main.device
                    and not _is_dtensor(g) and not _is_dtensor(main)):
                main.grad = g
                continue
            buf = bufs[i]
            if buf is None:
                buf = bufs[i] = torch.empty_like(main, dtype=torch.float32)
                locs[i] = _local(buf)
            dst.append(locs[i])
            # under no_grad: no detach (a DTensor detach is a dispatch per parameter)
            src.append(g._local_tensor if _is_dtensor(g) else g)
            main.grad = buf
        _foreach_copy(dst, src)

    @torch.no_grad()
    def _copy_main_params_to_model(self) -> None:
        """The updated fp32 main params into the model params: plain (bf16/fp16) ones by one ``_foreach_copy_`` of
        the local tensors (the same rounding as ``copy_``), quantized weights one by one, each quantizing the fp32 value
        on ``copy_`` with its own quantizer (one rounding, as upstream's master-weight cast; no bf16 copy first). The
        local tensors and their (device, dtype) groups are kept (:class:`_CopyPlan`)."""
        if self.main_params is None:
            return
        plan = self._copy_plan()
        for dst, src in plan.quantized:
            dst.copy_(src)
        for dsts, srcs in plan.plain_groups:
            torch._foreach_copy_(dsts, srcs)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 main params from the model params (upstream's name): after the model alone was loaded
        (``--no-load-optim``, ``--finetune``), else the next step would write the stale main values back."""
        if self.main_params is None:
            return
        for mp, main in zip(self.model_params, self.main_params):
            if mp is not main:
                _local(main).copy_(_local(_fp32_main_param(mp)))

    def _grads(self) -> List[torch.Tensor]:
        return [p.grad for p in self.get_parameters() if p.grad is not None]

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """Global L2 norm of the gradients (``global_grad_norm``; DTensor grads: their local shards, summed over
        their mesh). Same value on every rank."""
        return self._global_norm([p.grad for p in self.get_parameters()])

    @torch.no_grad()
    def get_params_norm(self) -> float:
        """Global L2 norm of the (main) parameters, each value counted once as in :meth:`get_grad_norm`
        (``--log-params-norm``; upstream's ``calc_params_l2_norm``). Collective."""
        return self._global_norm([p.detach() for p in self.get_parameters()])

    def _global_norm(self, tensors: List[Optional[torch.Tensor]]) -> float:
        """``global_grad_norm`` of one tensor per model parameter (None: not counted)."""
        return grad_norm_of_kinds(self._local_by_kind(_locals(tensors)), shard_group=self._shard_groups())

    def _local_by_kind(self, local: List[Optional[torch.Tensor]]) -> Dict[str, List[torch.Tensor]]:
        """``{'dense': [...], 'expert': [...]}``: the given local tensors (one per model parameter, None: not
        counted) by the parameters' kept :func:`norm_kind` (None: a TP duplicate, left out)."""
        out = {"dense": [], "expert": []}
        for t, kind in zip(local, self._kept_norm_kinds()):
            if t is not None and kind is not None:
                out[kind].append(t)
        return out

    def _shard_groups(self) -> Dict[str, dist.ProcessGroup]:
        """{norm kind: the group its DTensor parameters are sharded over} (Megatron-FSDP: dense over data-parallel,
        experts over expert-data-parallel), from the parameters (a gradient may be None on one rank only); computed
        on the first call, reset by :meth:`remap_params`."""
        if self._kind_groups is None:
            self._kind_groups = {}
            for p, kind in zip(self.get_parameters(), self._kept_norm_kinds()):
                if kind is not None and kind not in self._kind_groups and _is_dtensor(p):
                    self._kind_groups[kind] = dtensor_shard_group(p)
        return self._kind_groups

    def _kept_norm_kinds(self) -> List[Optional[str]]:
        """:func:`norm_kind` of every model parameter, computed on the first call (fixed per parameter; reset by
        :meth:`remap_params`)."""
        if self._norm_kinds is None:
            self._norm_kinds = [norm_kind(mp) for mp in self.model_params]
        return self._norm_kinds

    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        """Compute the global grad norm (``get_grad_norm``) and, when ``clip_grad > 0``, scale the grads so it is at
        most ``clip_grad``. The local gradients are collected once for both."""
        local = _locals([p.grad for p in self.get_parameters()])
        present = [g for g in local if g is not None]
        if not present:
            return 0.0
        norm = grad_norm_of_kinds(self._local_by_kind(local), shard_group=self._shard_groups())
        if clip_grad > 0 and math.isfinite(norm):
            coef = clip_grad / (norm + 1e-6)
            if coef < 1.0:
                scale_tensors_(present, coef)
        return norm

    @torch.no_grad()
    def count_zeros(self) -> int:
        """Zeros in the gradients: DTensor shards are summed over the data-parallel group (every rank takes part:
        the set of parameters is the same on all ranks; expert shards of every EP rank are in it, replicas of
        hybrid sharding counted once), plain (replicated) grads are counted locally."""
        grads = self._grads()
        sharded = [g for g in grads if _is_dtensor(g)]
        plain = _count_zeros([g for g in grads if not _is_dtensor(g)])
        local = _count_zeros([_local(g) for g in sharded])
        if sharded and is_distributed():
            t = torch.tensor([local], dtype=torch.int64, device=_local(sharded[0]).device)
            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            if group is not None:
                dist.all_reduce(t, group=group)
            # hybrid sharding: each shard is held by every instance of the data-parallel group
            local = int(t.item()) // parallel_state.get_num_distributed_optimizer_instances()
        return local + plain

    @torch.no_grad()
    def _unscale_and_check_for_inf(self) -> bool:
        """fp16: multiply the main grads by ``1/loss scale``; whether any rank of the data-parallel or the
        model-parallel (tensor x pipeline) group has an inf/nan main grad (all-reduced, so every rank takes the same decision)."""
        inv = self.grad_scaler.inv_scale
        groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
        for g in self._grads():
            local = _local(g)
            groups.setdefault((local.device, local.dtype), []).append(local)
        found = torch.zeros(1, dtype=torch.float32)
        # one fused multiply-and-check per device and dtype (torch's AMP kernel: the same products as ``mul_``),
        # the inf/nan flag kept on the device: one host read below instead of one per gradient
        for (device, _), grads in groups.items():
            flag = torch.zeros(1, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv.to(device))
            found = torch.maximum(found.to(device), flag)
        if is_distributed():
            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            found = found.to(parallel_state.collective_device(group))
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
            mp_group = parallel_state.get_model_parallel_group(check_initialized=False)
            if mp_group is not None and get_world_size(mp_group) > 1:  # every TP rank and pipeline stage agrees
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=mp_group)
        return bool(found.item() > 0)

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        """Clip and step. Returns ``(update_successful, grad_norm, num_zeros_in_grad)``. fp16 (a grad scaler): the
        grads are unscaled and an inf/nan on any rank skips the step and updates the scaler (upstream returns
        ``(False, None, None)`` then). A non-finite grad norm, or one above ``config.grad_norm_skip_threshold``,
        also skips the update (parameters and optimizer state unchanged) and returns ``update_successful=False``."""
        self._copy_model_grads_to_main()
        if self.grad_scaler is not None:
            found_inf = self._unscale_and_check_for_inf()
            self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None, None
        grad_norm = self.clip_grad_norm(self.config.clip_grad)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        if not math.isfinite(grad_norm) or grad_norm > self.config.grad_norm_skip_threshold:
            return False, grad_norm, num_zeros
        self._update()
        self._copy_main_params_to_model()
        return True, grad_norm, num_zeros

    @torch.no_grad()
    def _update(self) -> None:
        """Step "update": the torch optimizer's ``step()``. DTensor parameters (Megatron-FSDP's shards) are updated
        through their local tensors: for that one call the param groups hold plain detached views of the local
        shards (their ``.grad`` the local gradient) and ``optimizer.state`` the local tensors of their (DTensor)
        state, so torch's fused / foreach kernels run without a DTensor dispatch per call (on one GPU that dispatch
        was most of the host time of the optimizer step). The same storage is updated, so parameters and state stay
        the DTensors everyone else sees; a state entry the optimizer created (its lazy init at a parameter's first
        step) or replaced is put back as a DTensor in the parameter's layout.

        The views, the local param lists and each parameter's dict of local state tensors are kept from step to
        step (:class:`_LocalStepPlan`: no ``detach`` and no rebuilt dicts per parameter and step); every step checks,
        by identity, that the param groups, the state dicts and their entries and the parameters' local tensors are
        still the ones they were built from, and rebuilds what changed (a loaded checkpoint, remapped parameters)."""
        opt = self.optimizer
        plan = self._local_plan
        if plan is None or not plan.matches(opt):
            params = [p for g in opt.param_groups for p in g["params"]]
            if not any(_is_dtensor(p) for p in params):
                self._local_plan = None
                opt.step()
                return
            plan = self._local_plan = _LocalStepPlan(opt)
        saved_params = [g["params"] for g in opt.param_groups]
        saved_state = opt.state
        try:
            opt.state = plan.local_state(saved_state)
            for g, ps in zip(opt.param_groups, plan.local_params):
                g["params"] = ps
            opt.step()
        finally:
            for g, ps in zip(opt.param_groups, saved_params):
                g["params"] = ps
            opt.state = saved_state
            plan.write_back(saved_state)

    # ---- state -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_state(self) -> None:
        """Create zero optimizer state for params that have none yet (the same values torch's lazy init gives,
        so a later step is unchanged): needed to describe the state's shapes before a checkpoint load."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                st = self.optimizer.state[p]
                if len(st) > 0:
                    continue
                if hasattr(self.optimizer, "initialize_state"):  # precision_aware.PrecisionAwareAdamW
                    self.optimizer.initialize_state(p)
                elif isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                    # fused / capturable Adam keep the step count on the parameter's device (as torch's lazy init)
                    on_device = group.get("fused") or group.get("capturable")
                    st["step"] = torch.tensor(0.0, dtype=torch.float32, device=_local(p).device if on_device else None)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group.get("amsgrad", False):
                        st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif isinstance(self.optimizer, torch.optim.SGD):
                    if group.get("momentum", 0) != 0 and group.get("dampening", 0) == 0:
                        st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    elif group.get("momentum", 0) != 0:
                        raise NotImplementedError("SGD with dampening: state cannot be pre-initialised exactly")

    def state_dict(self) -> dict:
        sd = self.optimizer.state_dict()
        if self.main_params is None:
            return sd
        out = {"optimizer": sd, "fp32_from_fp16_params": [p.detach().clone() for p in self.main_params]}
        if self.grad_scaler is not None:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        return out

    def _load_grad_scaler(self, state_dict: dict) -> None:
        """Upstream's ``grad_scaler`` entry: restored into this optimizer's scaler; a checkpoint without it (not
        fp16) keeps the scaler's initial state; one with it and no scaler here (not --fp16 now) ignores it."""
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load ``state_dict()`` output, or what ``dist_checkpointing.load`` returned for ``sharded_state_dict``
        (plain local shards where the state is a DTensor: they are put back into the parameter's layout)."""
        self._load_grad_scaler(state_dict)
        if "optimizer" in state_dict and "state" not in state_dict:
            inner, mains = state_dict["optimizer"], state_dict.get("fp32_from_fp16_params")
        else:  # the plain layout; with fp32 main params read from the model weights beside it (sharded_state_dict)
            inner, mains = state_dict, state_dict.get("fp32_from_fp16_params")
        inner = {k: v for k, v in inner.items() if k != "fp32_from_fp16_params"}
        inner["state"] = {k: v if k == "common_step" else dict(v) for k, v in inner.get("state", {}).items()}
        self._local_param_groups(inner)
        self.optimizer.load_state_dict(inner)
        for p in self.get_parameters():
            st = self.optimizer.state.get(p)
            if not st:
                continue
            for k, v in list(st.items()):
                if k != "step" and isinstance(v, torch.Tensor) and v.dim() > 0:
                    st[k] = _as_layout_of(v, p)
        if mains is not None:
            # without main params (Megatron-FSDP, fp32 DDP) the fp32 values go into the parameters themselves
            targets = self.main_params if self.main_params is not None else self.model_params
            flat = [t for g in mains for t in g] if mains and isinstance(mains[0], (list, tuple)) else list(mains)
            if len(flat) != len(targets):
                raise RuntimeError(f"fp32_from_fp16_params: {len(flat)} tensors, expected {len(targets)}")
            for main, v in zip(targets, flat):
                _local(main).copy_(_local(_as_layout_of(v, main)))
            if self.main_params is not None:
                self._copy_main_params_to_model()

    def _local_param_groups(self, inner: dict) -> None:
        """In place: the param groups' ``params`` become this optimizer's own (the saving layout may have held other
        parameters, e.g. another expert-parallel size), states of indices it does not have are dropped, and a
        common Adam step (``state["common_step"]``, see ``sharded_state_dict``; in our older checkpoints each
        group's ``step``) replaces each state's ``step``."""
        live = self.optimizer.state_dict()["param_groups"]
        groups = inner.get("param_groups", [])
        # upstream's (and ours since) common Adam step: ``state["common_step"]``, one value for every parameter
        common_step = inner["state"].pop("common_step", None)
        if common_step is not None and not (isinstance(common_step, (int, float)) or (
                isinstance(common_step, torch.Tensor) and common_step.numel() == 1)):
            raise ValueError(f"optimizer checkpoint: optimizer.state.common_step must be one number, got "
                             f"{type(common_step).__name__} {getattr(common_step, 'shape', '')}")
        if len(groups) != len(live):
            raise ValueError(f"optimizer checkpoint has {len(groups)} param groups, this optimizer {len(live)} "
                             "(weight-decay / lr-mult / expert groups differ)")
        inner["param_groups"] = []
        ids = set()
        for g, lg in zip(groups, live):
            g = dict(g)
            step = g.pop("step", None)  # where our older checkpoints kept the common step
            step = common_step if common_step is not None else step
            g["params"] = list(lg["params"])
            inner["param_groups"].append(g)
            ids.update(g["params"])
            for i in g["params"]:
                st = inner["state"].get(i)
                if step is not None and st:
                    st["step"] = torch.tensor(float(step), dtype=torch.float32)
        inner["state"] = {k: v for k, v in inner["state"].items() if k in ids and v}

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           metadata: Optional[dict] = None, **unused) -> dict:
        """The optimizer's ``state_dict()`` with each state tensor of the param named ``n`` replaced by a
        ShardedTensor shaped like that param's ShardedTensor in ``model_sharded_state_dict`` (key
        ``optimizer.state.<exp_avg|exp_avg_sq|momentum_buffer>.<param key>``; fp32 main params
        ``optimizer.state.fp32_param.<param key>``). ``step`` and the param-group hyper-parameters stay plain
        (common state).

        Loading another engine's checkpoint (``metadata["checkpoint_fp32_main_params"]``, see
        :func:`fp32_main_params_request`): the fp32 main params are read from where that checkpoint keeps them, the
        optimizer state's ``fp32_param`` / ``param`` (DDP / the distributed optimizer with --bf16) or the fp32 model
        weights (Megatron-FSDP, whose sharded weights are the main params), into this optimizer's main params or,
        without them (Megatron-FSDP), into its fp32 parameters: the resume continues from the exact fp32 values."""
        from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

        self.init_state()
        if is_loading:  # a checkpoint of other moment precisions: said in one line (precision_aware.py)
            from megatron.core.optimizer.precision_aware import log_state_conversion

            log_state_conversion(self.optimizer, metadata)
        sd = self.optimizer.state_dict()
        sd["state"] = {k: dict(v) for k, v in sd["state"].items()}  # never modify the live state dicts
        shs = [self._param_sharded_tensor(p, model_sharded_state_dict) for p in self.model_params]
        opt_params = self.get_parameters()
        for idx, (sh, p) in enumerate(zip(shs, opt_params)):
            st = sd["state"].get(idx)
            if st is None:
                continue
            for k, v in list(st.items()):
                if k == "step" or not isinstance(v, torch.Tensor) or v.dim() == 0:
                    continue
                st[k] = make_sharded_optimizer_tensor(sh, v, f"optimizer.state.{k}")
        # The saving and loading layouts may hold different parameters (expert parallelism): as upstream, the param
        # lists stay local, and the Adam step, the same for every parameter, is saved once as upstream's
        # ``optimizer.state.common_step`` (the per-index steps' indices belong to the saving layout). Steps that
        # differ per parameter stay per index. (Older checkpoints of ours kept the common step in each param group
        # as ``step``: ``_local_param_groups`` still reads it.)
        from megatron.core.dist_checkpointing import LocalNonpersistentObject

        steps = {float(st["step"]) for st in sd["state"].values() if "step" in st}
        for g in sd["param_groups"]:
            g["params"] = LocalNonpersistentObject(list(g["params"]))
        if len(steps) == 1:
            common = next(st["step"] for st in sd["state"].values() if "step" in st)
            for st in sd["state"].values():
                st.pop("step", None)
            sd["state"]["common_step"] = common.detach().clone() if isinstance(common, torch.Tensor) else common
        where = fp32_main_params_request(self, metadata) if is_loading else None
        if where == "model":  # the fp32 model weights of the checkpoint: next to the plain layout it was saved in
            sd["fp32_from_fp16_params"] = [_sharded_like(sh, self._main_param_target(i), None)
                                           for i, sh in enumerate(shs)]
            return sd
        if self.main_params is None and where is None:
            return sd
        prefix = where or "optimizer.state.fp32_param"
        mains = [_sharded_like(sh, self._main_param_target(i), prefix) for i, sh in enumerate(shs)]
        out = {"optimizer": sd, "fp32_from_fp16_params": mains}
        if self.grad_scaler is not None:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        return out

    def _main_param_target(self, i: int) -> torch.Tensor:
        """Where the ``i``-th fp32 main param is saved from / loaded into: the main param's local tensor, or, for an
        optimizer without main params loading another engine's (``sharded_state_dict``), an fp32 copy of the
        parameter's local values (copied back into the parameter by ``load_state_dict``, after the model's own
        weights were loaded into it; elements the checkpoint does not hold keep their values)."""
        if self.main_params is not None:
            return _local(self.main_params[i]).detach()
        # the parameter's values: elements the checkpoint does not hold (vocabulary rows padded differently) keep them
        return _local(self.model_params[i]).detach().float().clone()

    def _param_sharded_tensor(self, p, model_sharded_state_dict: dict):
        """The ShardedTensor of parameter ``p``: the one of ``p``'s name, else the one holding ``p`` itself (several
        model chunks, the virtual pipeline stages, repeat local names: their entries are chunk-prefixed), else the
        one whose key ends with the name."""
        name = self.param_to_name.get(p)
        if name is None:
            raise KeyError("MegatronOptimizer.sharded_state_dict: a parameter has no name (param_to_name)")
        if name in model_sharded_state_dict:
            return model_sharded_state_dict[name]
        cache = getattr(self, "_sharded_by_param", None)
        if cache is None or cache[0] is not model_sharded_state_dict:
            by_param = {id(v.data): v for v in model_sharded_state_dict.values()
                        if hasattr(v, "global_offset") and isinstance(getattr(v, "data", None), torch.Tensor)}
            self._sharded_by_param = cache = (model_sharded_state_dict, by_param)
        hit = cache[1].get(id(p))
        if hit is not None and hit.data is p:
            return hit
        hits = [k for k in model_sharded_state_dict if k.endswith("." + name)]
        if len(hits) == 1:
            return model_sharded_state_dict[hits[0]]
        raise KeyError(
            f"MegatronOptimizer.sharded_state_dict: no ShardedTensor for parameter {name!r} in the model's "
            f"sharded state dict (candidates: {hits[:5]})"
        )


class ChainedOptimizer:
    """Several MegatronOptimizers stepped as one (upstream's name; e.g. dense and expert parameters optimized
    separately). ``step()`` steps every one and returns (all succeeded, the first grad norm, summed zeros)."""

    def __init__(self, chained_optimizers: List[MegatronOptimizer]):
        if not chained_optimizers:
            raise ValueError("ChainedOptimizer: chained_optimizers is empty")
        self.chained_optimizers = list(chained_optimizers)

    @property
    def param_groups(self) -> list:
        return [g for opt in self.chained_optimizers for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.chained_optimizers:
            opt.zero_grad(set_to_none)

    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        results = [opt.step() for opt in self.chained_optimizers]
        zeros = [r[2] for r in results if r[2] is not None]
        return all(r[0] for r in results), results[0][1], (sum(zeros) if zeros else None)

    def state_dict(self) -> list:
        return [opt.state_dict() for opt in self.chained_optimizers]

    def load_state_dict(self, state_dict: list) -> None:
        if len(state_dict) != len(self.chained_optimizers):
            raise ValueError(f"ChainedOptimizer.load_state_dict: {len(state_dict)} states for "
                             f"{len(self.chained_optimizers)} optimizers")
        for opt, state in zip(self.chained_optimizers, state_dict):
            opt.load_state_dict(state)

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False, **kwargs) -> dict:
        """One optimizer: its sharded state dict; several: ``{index: sharded state dict}``."""
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        return {i: opt.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
                for i, opt in enumerate(self.chained_optimizers)}
