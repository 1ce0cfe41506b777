"""Megatron-FSDP on PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) and DTensor.

``FullyShardedDataParallel(config, ddp_config, module, process_group=None)`` applies ``fully_shard`` to every
``TransformerLayer`` (the FSDP unit; consecutive layers are joined into one FSDP2 unit up to
``ddp_config.suggested_communication_unit_size`` elements, see :func:`group_units` / :func:`default_unit_size`) and
then to the root module, over a 1-D ``DeviceMesh`` built from the
data-parallel group. Parameters, gradients and (since the optimizer sees DTensor parameters) optimizer state are
sharded on dim 0, ``torch.chunk``-style (uneven or empty shards are possible). With ``config.bf16`` / ``fp16``
compute runs in that dtype while the sharded (main) parameters stay fp32 and gradients are reduced in fp32
(``MixedPrecisionPolicy``). Buffers (the MoE router's ``expert_bias``) are not sharded: every rank holds the same
replica (``update_expert_bias`` all-reduces the token counts).

Meta-device init: when the model was built under ``with torch.device('meta')``, the model is materialised module
by module in ``model.modules()`` order: a whole FSDP unit is materialised at full size (only its meta tensors get
storage, see ``meta_init.py``), its modules' ``reset_parameters()`` run (same RNG order as eager init, so values are
bit-identical to an eagerly initialised model), and then the unit's group is sharded, so peak memory stays about
one group above the sharded model. With untied embeddings the GPT's ``embedding`` and ``output_layer`` are units too;
the root's remaining modules (final norm; embedding and output layer when tied) are materialised and initialised
in their place in that order and sharded last. New Parameter objects (meta -> device, then FSDP2's
DTensor parameters) get the old objects' attributes, and ``param_keyed_maps`` passed in are remapped.
"""
import contextlib
import warnings
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Type

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_utils import default_device
from megatron.core.dtensor_utils import local_chunk_range
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.meta_init import (
    has_meta_tensors,
    materialize_unit,
    meta_tensor_names,
    module_names,
    rebind_params,
    snapshot_params,
)
from megatron.core.fp8_utils import is_quantized_tensor
from megatron.core.transformer.module import MegatronModule


def hybrid_mesh(dp_group: dist.ProcessGroup, instances: int, device_type: str, inner: dist.ProcessGroup,
                outer: dist.ProcessGroup):
    """Hybrid sharding's 2-D ``DeviceMesh`` (``--num-distributed-optimizer-instances N``, ``--outer-dp-sharding-strategy
    no_shard``) over ``dp_group`` (the data-parallel or, for experts, the expert-data-parallel group): dimension 0
    (``dp_replicate``) replicates over the N instances (``outer``: parallel_state's inter-partial group), dimension 1
    (``dp_shard``) shards within one (``inner``: the intra-partial group, one of N contiguous pieces of
    ``dp_group``'s ranks, as upstream). FSDP2 then reduce-scatters within an instance and all-reduces across
    instances (HSDP)."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = dist.get_process_group_ranks(dp_group)
    mesh = torch.tensor(ranks, dtype=torch.int).view(instances, len(ranks) // instances)
    return DeviceMesh.from_group([outer, inner], device_type, mesh=mesh, mesh_dim_names=("dp_replicate", "dp_shard"))


def fsdp_unit_policy(module: torch.nn.Module, unit_types: Tuple[Type[torch.nn.Module], ...]) -> List[torch.nn.Module]:
    """Step "unit policy": the FSDP units, in ``module.modules()`` order: every submodule of a ``unit_types`` type
    (``TransformerLayer``), then, with untied embeddings, the GPT's ``embedding`` and ``output_layer`` (so meta
    init never holds them at full size while the layers are built: peak about one unit group). With tied weights they
    stay in the root (the root's forward uses the embedding weight for the output layer)."""
    units = [m for m in module.modules() if isinstance(m, unit_types) and m is not module]
    if not getattr(module, "share_embeddings_and_output_weights", True):
        for name in ("embedding", "output_layer"):
            m = getattr(module, name, None)
            if isinstance(m, torch.nn.Module) and any(True for _ in m.parameters()) and all(m is not u for u in units):
                units.append(m)
    return units


def group_units(units: List[torch.nn.Module], unit_types: Tuple[Type[torch.nn.Module], ...],
                max_elements: Optional[int]) -> List[List[torch.nn.Module]]:
    """Step "unit groups": consecutive ``unit_types`` units (transformer layers) are joined into one FSDP2 unit
    (``fully_shard([...])``: one all-gather, one reduce-scatter and one set of hooks for all of them) while their
    parameters total at most ``max_elements``; a unit larger than that, and the embedding / output layer, stay
    alone. ``max_elements=None`` keeps one unit per module."""
    groups: List[List[torch.nn.Module]] = []
    size = 0
    for u in units:
        n = sum(p.numel() for p in u.parameters())
        joinable = max_elements is not None and isinstance(u, unit_types)
        if (joinable and groups and isinstance(groups[-1][-1], unit_types) and size + n <= max_elements):
            groups[-1].append(u)
            size += n
        else:
            groups.append([u])
            size = n
    return groups


def is_expert_param(p: torch.Tensor) -> bool:
    """An expert weight (``allreduce=False``: held by one expert-parallel rank, reduced over expert-DP)."""
    return not getattr(p, "allreduce", True)


def expert_submodules(unit: torch.nn.Module) -> List[torch.nn.Module]:
    """The largest submodules of ``unit`` whose parameters are all expert parameters (the MoE layer's ``experts``,
    whatever its class), in ``modules()`` order; each becomes an FSDP2 unit of the expert-data-parallel mesh."""
    out: List[torch.nn.Module] = []
    inside = set()
    for m in unit.modules():
        if m is unit or id(m) in inside:
            continue
        params = list(m.parameters())
        if params and all(is_expert_param(p) for p in params):
            out.append(m)
            inside.update(id(sub) for sub in m.modules())
    return out


DEFAULT_UNIT_ELEMENTS = 2**29
"""The default ``suggested_communication_unit_size`` where layers are joined (see :func:`default_unit_size`): a
group's gradient buffers at the end of its backward (its unsharded gradients, FSDP2's fp32 reduce-scatter input and,
on one rank, its output of the same size, which becomes the sharded gradient every grouping holds: about 10 bytes
per element with bf16 compute, 6 of them transient) stay near 5 GiB, while layers much smaller than this (where
FSDP2's fixed host work per unit and step, a few milliseconds on an H200 host, is comparable with the layer's
compute) are joined. 2**29 keeps the 8 layers of issue 16's GPT (about 50 M elements each) in one unit: on the H200
one unit ran 0.871 of DDP + FP8 with FP8 param gather against 0.830 with 5 + 3 layers under 2**28
(``benchmarks/RESULTS.md``, issue 16 item 2)."""


def default_unit_size(dp_size: int, reshard_after_forward: bool) -> Optional[int]:
    """``suggested_communication_unit_size`` when it is not given (None): :data:`DEFAULT_UNIT_ELEMENTS` with one
    data-parallel rank (parameters kept gathered from forward to backward): nothing is communicated, so there is
    nothing to overlap, and every layer stays gathered whatever the grouping; a group costs only its transient
    gradient buffers, held until its last layer's backward. Otherwise None, one FSDP unit per layer (upstream's
    unit): with communication, a larger unit exposes more of the first all-gather and the last reduce-scatter, and
    under ZeRO-3 keeps more layers unsharded at once; the flag opts in."""
    return DEFAULT_UNIT_ELEMENTS if dp_size == 1 and not reshard_after_forward else None


def _mixed_precision(config):
    """``(compute dtype or None, MixedPrecisionPolicy)``: bf16/fp16 compute with fp32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = torch.bfloat16 if getattr(config, "bf16", False) else (
        torch.float16 if getattr(config, "fp16", False) else None
    )
    if dtype is None:
        return None, MixedPrecisionPolicy()
    return dtype, MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


class FullyShardedDataParallel(MegatronModule):
    """Megatron-FSDP: ``FullyShardedDataParallel(config, ddp_config, module, process_group=None)``.

    ``ddp_config.data_parallel_sharding_strategy``: ``optim_grads_params`` (ZeRO-3, and ``no_shard``, the
    config's default, kept for direct callers) or ``optim_grads`` (ZeRO-2: ``reshard_after_forward=False``, see
    ``distributed/data_parallel_wrapper.py``); ``optim`` is refused here (``wrap_data_parallel`` picks DDP for it).
    An explicit ``reshard_after_forward`` overrides the strategy's.

    Interface (same as ``DistributedDataParallel``): ``.module``, ``forward`` passthrough, ``zero_grad_buffer()``,
    ``finish_grad_sync()``, ``no_sync()``, ``scale_gradients()``, ``param_to_name`` ({live param: name}),
    ``state_dict()`` (the unwrapped model's keys, DTensor values), ``load_state_dict()`` (accepts local shards,
    as ``dist_checkpointing.load`` returns them, or full tensors), ``sharded_state_dict(prefix='')``.
    ``old_to_new_params`` maps every Parameter object the model had before wrapping to the live one.
    """

    init_on_construction = False  # wraps a built (or meta) module; materialisation initialises

    def __init__(
        self,
        config,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        process_group: Optional[dist.ProcessGroup] = None,
        fsdp_unit_modules: Optional[Sequence[Type[torch.nn.Module]]] = None,
        device: Optional[torch.device] = None,
        param_keyed_maps: Iterable = (),
        reshard_after_forward: Optional[bool] = None,
    ):
        super().__init__(config)
        strategy = ddp_config.data_parallel_sharding_strategy
        if strategy == "optim":
            raise ValueError(
                "FullyShardedDataParallel: data_parallel_sharding_strategy (--data-parallel-sharding-strategy) "
                "'optim' shards only the optimizer state: wrap with megatron.core.distributed.wrap_data_parallel "
                "(DistributedDataParallel + DistributedOptimizer)"
            )
        from torch.distributed.device_mesh import DeviceMesh

        self.ddp_config = ddp_config
        self.module = module
        # context-parallel ranks shard like data-parallel ones (upstream's dp_cp group)
        self.process_group = (process_group if process_group is not None
                              else parallel_state.get_data_parallel_group(with_context_parallel=True))
        if self.process_group is None or not dist.is_initialized():
            raise RuntimeError("FullyShardedDataParallel (--use-megatron-fsdp) needs torch.distributed initialised")
        if reshard_after_forward is None:
            # ZeRO-2 keeps the parameters gathered from forward to the end of backward; ZeRO-3 regathers them. With
            # one data-parallel rank a shard is the whole parameter: resharding would only free the compute-dtype
            # copy after forward to cast and "gather" it again in backward (pure overhead), so it is kept instead
            reshard_after_forward = strategy != "optim_grads" and dist.get_world_size(self.process_group) > 1
        self.device = torch.device(device) if device is not None else default_device()
        self.instances = parallel_state.get_num_distributed_optimizer_instances()
        if self.instances > 1:
            if process_group is not None:
                raise ValueError("FullyShardedDataParallel: process_group= cannot be combined with hybrid sharding "
                                 "(--num-distributed-optimizer-instances > 1): its groups come from parallel_state")
            self.mesh = hybrid_mesh(
                self.process_group, self.instances, self.device.type,
                parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True),
                parallel_state.get_inter_partial_data_parallel_group())
        else:
            self.mesh = DeviceMesh.from_group(self.process_group, self.device.type)
        # Expert parallelism: each EP rank holds other experts, so expert weights get their own FSDP2 units over the
        # expert-data-parallel group (the ranks holding the same experts); None without EP (they share ``mesh``)
        self.expert_mesh = None
        if parallel_state.get_expert_model_parallel_world_size() > 1:
            if process_group is not None:
                raise ValueError("FullyShardedDataParallel: process_group= cannot be combined with expert "
                                 "parallelism (--expert-model-parallel-size > 1): the expert-data-parallel group "
                                 "comes from parallel_state")
            edp = parallel_state.get_expert_data_parallel_group()
            if self.instances > 1:  # hybrid: experts replicated across the instances' expert-DP pieces too
                self.expert_mesh = hybrid_mesh(
                    edp, self.instances, self.device.type,
                    parallel_state.get_expert_data_parallel_group(partial_expert_data_parallel=True),
                    parallel_state.get_inter_partial_expert_data_parallel_group())
            else:
                self.expert_mesh = DeviceMesh.from_group(edp, self.device.type)
        if fsdp_unit_modules is None:
            from megatron.core.transformer.transformer_layer import TransformerLayer

            fsdp_unit_modules = (TransformerLayer,)
        self.fsdp_unit_modules = tuple(fsdp_unit_modules)

        self.compute_dtype, self.mp_policy = _mixed_precision(config)
        self.is_meta_init = has_meta_tensors(module)  # an eagerly built (or loaded) model keeps its values
        originals = snapshot_params(module)  # to carry attributes and remap maps at the end
        units = fsdp_unit_policy(module, self.fsdp_unit_modules)
        unit_size = ddp_config.suggested_communication_unit_size  # checked positive by the config
        if unit_size is None:
            unit_size = default_unit_size(dist.get_world_size(self.process_group), reshard_after_forward)
        groups = group_units(units, self.fsdp_unit_modules, unit_size)
        names = module_names(module)
        # parameters kept gathered from forward to backward (one data-parallel rank, or ZeRO-2): ``no_sync`` keeps
        # them gathered across the accumulated micro-batches too (see there)
        self.reshard_after_forward = reshard_after_forward
        self._materialize_and_shard_units(module, groups, reshard_after_forward, names)
        self._finish_root(module, reshard_after_forward)
        self.old_to_new_params = rebind_params(originals, param_keyed_maps)
        self.param_to_name = {p: n for n, p in module.named_parameters()}
        self._sharded_params = list(self.param_to_name)  # FSDP2 puts these same objects back after each backward
        from torch.distributed.fsdp import FSDPModule

        # no_sync sets each FSDP2 module's flags itself (recurse=False): FSDP2's recursive setters walk every
        # submodule, twice per accumulated micro-batch (about 0.5 ms per no_sync on a small CPU against 0.02)
        self._fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
        self.unit_groups = [[names[id(u)] for u in g] for g in groups]  # FSDP2 units below the root, by name
        # GPTModel returns the per-token loss as a ``view``; nothing here modifies it in place, so FSDP2's
        # per-step warning about view outputs is noise for this model
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPGPTModel\) returned a view tensor")

    # ---- construction steps ------------------------------------------------------------------------------
    def _shard(self, m: torch.nn.Module, **kw) -> None:
        """Step "shard": ``fully_shard`` over the data-parallel mesh with the mixed-precision policy."""
        from torch.distributed.fsdp import fully_shard

        kw.setdefault("mesh", self.mesh)
        fully_shard(m, mp_policy=self.mp_policy, **kw)
        if self.instances > 1 and dist.get_backend(self.process_group) == "gloo":
            # gloo's all-reduce has no AVG: hybrid sharding sums over both mesh dimensions, then divides
            (m[0] if isinstance(m, list) else m).set_force_sum_reduction_for_comms(True)

    def _shard_experts(self, m: torch.nn.Module, reshard_after_forward: bool) -> None:
        """Step "shard experts" (expert parallelism): ``fully_shard`` of an expert module over the
        expert-data-parallel mesh, before its layer (the layer's unit then leaves these parameters out). FSDP2
        averages a reduce-scatter over its mesh; an expert's gradient already sums the tokens of its whole EP group,
        so it is divided by the data-parallel size instead, as ``DistributedDataParallel`` does (sum over expert-DP
        / DP). An expert that got no token on some rank still takes part in the reduce-scatter (zeros) so the
        ranks never disagree on the collective."""
        self._shard(m, mesh=self.expert_mesh, reshard_after_forward=reshard_after_forward)
        m.set_gradient_divide_factor(float(dist.get_world_size(self.process_group)))
        group = self.expert_mesh.get_group(mesh_dim=self.expert_mesh.ndim - 1)  # the sharding dimension
        # gloo has no PREMUL_SUM: a sum, then the division; not with one rank on the sharding dimension: torch 2.13's
        # FSDP2 would then divide twice (no reduce-scatter runs there, and the hybrid all-reduce is a plain SUM)
        m.set_force_sum_reduction_for_comms(dist.get_world_size(group) > 1 and dist.get_backend(group) == "gloo")
        m.set_reduce_scatter_unused_params(True)

    def _materialize_and_shard_units(self, module: torch.nn.Module, groups: List[List[torch.nn.Module]],
                                     reshard_after_forward: bool, names: Dict[int, str]) -> None:
        """In ``module.modules()`` order: each unit is materialised at full size (meta init) and cast; a group of
        units is sharded as one FSDP2 unit as soon as its last member is done, before the next group is touched
        (peak about one group); the root's own modules are materialised in their place (tied parameters stay one
        object) and sharded last, by :meth:`_finish_root`. ``names``: ``module_names(module)`` (error messages)."""
        no_reshard = {id(getattr(module, "output_layer", None))}  # its backward follows its forward at once
        group_of = {id(u): g for g in groups for u in g}
        inside_unit = {id(sub) for g in groups for u in g for sub in u.modules() if sub is not u}
        root_seen: Dict = {}  # keeps parameters tied across the root's own modules one object
        for m in list(module.modules()):
            if id(m) in inside_unit:
                continue  # handled together with its unit
            group = group_of.get(id(m))
            if group is not None:
                if self.is_meta_init:
                    materialize_unit(m, self.device, names=names, what="FullyShardedDataParallel (FSDP unit)")
                self._keep_fp32_main_params(m)
                if self.expert_mesh is not None:
                    for e in expert_submodules(m):
                        self._shard_experts(e, reshard_after_forward)
                if m is group[-1]:
                    self._shard(group if len(group) > 1 else m,
                                reshard_after_forward=reshard_after_forward and id(m) not in no_reshard)
            elif self.is_meta_init:
                materialize_unit(m, self.device, seen=root_seen, modules=[m], names=names)

    def _finish_root(self, module: torch.nn.Module, reshard_after_forward: bool = True) -> None:
        """The root: nothing may be left on meta; cast; check FP8 param-gather (after materialisation: meta-built
        TE weights are quantized only then); shard."""
        left = meta_tensor_names(module)
        if left:
            raise RuntimeError(f"FullyShardedDataParallel: tensors still on the meta device: {left[:10]}")
        self._keep_fp32_main_params(module)
        if self.ddp_config.fp8_param_gather:
            self._check_fp8_param_gather(module)
        if self.expert_mesh is not None:  # experts outside the units (a bare MoE layer as the root)
            from torch.distributed.fsdp import FSDPModule

            for e in expert_submodules(module):
                if not isinstance(e, FSDPModule):
                    self._shard_experts(e, reshard_after_forward)
        self._shard(module, reshard_after_forward=reshard_after_forward)

    # ---- construction helpers ----------------------------------------------------------------------------
    def _keep_fp32_main_params(self, m: torch.nn.Module) -> None:
        """With bf16/fp16 compute, the sharded parameters are the fp32 main parameters (upcast in place, same
        Parameter objects) unless ``ddp_config.preserve_fp32_weights`` is False. Quantized (FP8) weights stay.

        With ``--fp8-param-gather`` the other parameters take the quantized weights' nominal dtype instead: FSDP2
        needs one original dtype per unit, and the optimizer keeps fp32 main copies of low-precision shards."""
        from torch.distributed.tensor import DTensor

        if self.ddp_config.fp8_param_gather:
            nominal = next((p.dtype for p in m.parameters() if not isinstance(p, DTensor) and is_quantized_tensor(p)),
                           self.compute_dtype)
            target = nominal
        elif self.compute_dtype is None or not self.ddp_config.preserve_fp32_weights:
            return
        else:
            target = torch.float32
        if target is None:
            return
        for p in m.parameters():
            if isinstance(p, DTensor):
                continue  # already sharded (an FSDP unit, cast before its fully_shard)
            if p.is_floating_point() and p.dtype != target and not is_quantized_tensor(p):
                p.data = p.data.to(target)

    def _check_fp8_param_gather(self, module: torch.nn.Module) -> None:
        """``--fp8-param-gather`` with Megatron-FSDP: the weights must be TE quantized tensors (built under TE's
        ``quantized_model_init``); FSDP2 then all-gathers them in FP8 through their ``fsdp_pre_all_gather`` /
        ``fsdp_post_all_gather`` hooks. Checked on GPU with TE; here only the preconditions are verified."""
        from megatron.core.extensions.transformer_engine import HAVE_TE

        if not HAVE_TE:
            raise RuntimeError("--fp8-param-gather needs Transformer Engine (not installed)")
        from torch.distributed.tensor import DTensor

        local = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()]
        quantized = [p for p in local if is_quantized_tensor(p)]
        if not quantized:
            raise RuntimeError(
                "--fp8-param-gather: no Transformer Engine quantized weights in the model; build it with "
                "--fp8-param-gather so TE layers are created under quantized_model_init (config.fp8_param)"
            )
        if self.compute_dtype is not None and any(p.dtype != self.compute_dtype for p in quantized):
            # FSDP2 only skips its param_dtype cast when the (nominal) dtype already equals it
            warnings.warn(
                "--fp8-param-gather: quantized weights' nominal dtype differs from the bf16/fp16 compute dtype; "
                "build them with params_dtype equal to it so FSDP2 all-gathers FP8 data without casting"
            )
        missing = [type(p).__name__ for p in quantized if not hasattr(p, "fsdp_pre_all_gather")]
        if missing:
            raise RuntimeError(
                f"--fp8-param-gather: this Transformer Engine version's {sorted(set(missing))} has no FSDP2 "
                "all-gather hooks (fsdp_pre_all_gather); upgrade Transformer Engine"
            )

    # ---- forward -----------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ---- gradients ---------------------------------------------------------------------------------------
    def zero_grad_buffer(self) -> None:
        for p in self._sharded_params:
            p.grad = None

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate unsharded gradients without reduce-scatter (the last micro-batch, outside, syncs).

        Where parameters are not resharded after forward (one data-parallel rank, or ZeRO-2: parameters whole
        between forward and backward), they are not resharded after this micro-batch's backward either: the next
        micro-batch reuses the gathered (FP8: quantized) parameters instead of gathering the same values again.
        The syncing micro-batch reshards after its backward, so the optimizer step's new values are gathered at
        the next step. ZeRO-3 on several ranks keeps resharding (its memory bound)."""
        keep_gathered = not self.reshard_after_forward
        self._set_sync(False, keep_gathered)
        try:
            yield
        finally:
            self._set_sync(True, keep_gathered)

    def _set_sync(self, sync: bool, reshard_too: bool) -> None:
        """``set_requires_gradient_sync(sync)`` (and ``set_reshard_after_backward(sync)`` with ``reshard_too``) on
        every FSDP2 module of the model."""
        for m in self._fsdp_modules:
            m.set_requires_gradient_sync(sync, recurse=False)
            if reshard_too:
                m.set_reshard_after_backward(sync, recurse=False)

    def start_grad_sync(self, *unused) -> None:
        pass

    def start_param_sync(self, *unused, **unused_kw) -> None:
        pass

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """FSDP2 has finished the reduce-scatter when backward returns; only the optional NaN check is left
        (``check_for_nan_in_grad``): one max-abs norm per local gradient shard (``torch._foreach_norm`` with
        ``inf``: inf or NaN exactly where the shard has one, no overflow of finite values) and one host sync for all
        of them; the offending parameter is named only when the check fails."""
        if not self.ddp_config.check_for_nan_in_grad:
            return
        named = [(n, p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
                 for n, p in self.module.named_parameters() if p.grad is not None]
        named = [(n, g) for n, g in named if g.numel() > 0]
        if not named:
            return
        groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
        for _, g in named:
            groups.setdefault((g.device, g.dtype), []).append(g)
        maxes = [torch.stack(torch._foreach_norm(gs, float("inf"))).float() for gs in groups.values()]
        if bool(torch.isfinite(torch.cat([m.cpu() for m in maxes]) if len(maxes) > 1 else maxes[0]).all()):
            return
        for n, g in named:
            if not torch.isfinite(g).all():
                raise RuntimeError(f"FullyShardedDataParallel: NaN/Inf in the gradient of {n} (--check-for-nan-in-grad)")

    @torch.no_grad()
    def scale_gradients(self, scaling_factor: float) -> None:
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(scaling_factor)

    def broadcast_params(self) -> None:
        pass  # parameters are sharded; buffers are rank-identical by construction

    # ---- state -------------------------------------------------------------------------------------------
    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def _dp(self) -> Tuple[int, int]:
        return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: Optional[dict] = None) -> dict:
        """The unwrapped model's own ``sharded_state_dict`` (upstream's layout: stacked layers, expert axis, gated
        fc1 chunks, ``_extra_state`` objects): the shared builder (``tensor_parallel.sharded_tensors``) turns each
        DTensor parameter into its local shard (dim 0 of the parameter, ``torch.chunk``-style, possibly uneven or
        empty, placed on global axis ``prepend_axis_num``, ``replica_id=0``); buffers (``expert_bias``) stay
        replicated.
        Keys and global shapes equal a DDP model's, so the checkpoints load into each other."""
        from megatron.core.transformer.module import sharded_state_dict_default

        return sharded_state_dict_default(self.module, prefix, sharded_offsets, metadata)

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Load the unwrapped model's keys. A DTensor parameter accepts a DTensor, its LOCAL shard (what
        ``dist_checkpointing.load`` returns for ``sharded_state_dict()``) or the FULL tensor (its chunk is taken).
        Buffers and other entries go through ``torch.nn.Module.load_state_dict``."""
        from torch.distributed.tensor import DTensor

        own = self.module.state_dict(keep_vars=True)
        # modules that take an ``_extra_state`` key without having one in state_dict() (local linears, see
        # tensor_parallel.layers) accept it here too
        accepted = set(own) | {
            f"{name}.{torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX}".lstrip(".")
            for name, m in self.module.named_modules()
            if type(m).set_extra_state is not torch.nn.Module.set_extra_state
        }
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in accepted]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"FullyShardedDataParallel.load_state_dict: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}"
            )
        rest = {}
        for k, v in state_dict.items():
            if k not in accepted:
                continue
            target = own.get(k)
            if isinstance(target, DTensor):
                self._load_into_dtensor(k, target, v)
            else:
                rest[k] = v
        if rest:
            self.module.load_state_dict(rest, strict=False)
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    @staticmethod
    def _load_into_dtensor(key: str, target, value) -> None:
        from torch.distributed.tensor import DTensor

        local = target.to_local()
        if isinstance(value, DTensor):
            if value.placements == target.placements:
                local.copy_(value.to_local())
                return
            value = value.full_tensor()
        if tuple(value.shape) == tuple(local.shape):
            local.copy_(value)
        elif tuple(value.shape) == tuple(target.shape):
            start, length = local_chunk_range(target, key)
            local.copy_(value[start : start + length])
        else:
            raise RuntimeError(
                f"FullyShardedDataParallel.load_state_dict: {key} has shape {tuple(value.shape)}, expected the local "
                f"shard {tuple(local.shape)} or the full tensor {tuple(target.shape)}"
            )
