"""Process groups, with upstream megatron-core 0.19's API and rank layout.

Layout: ``RankGenerator`` turns an order string (default ``tp-cp-ep-dp-pp``; the leftmost kind varies fastest across
global ranks) into the rank lists of every group. ``initialize_model_parallel`` builds real groups for tensor, data
(with and without context), context, model (tp-pp), pipeline, embedding, position embedding, tensor+data,
tensor+context parallelism, and the expert groups: expert-model, expert-tensor (size defaults to the tensor size),
expert-tensor+model, expert-tensor+model+pipeline, expert-data. Tensor, pipeline (with virtual stages: the interleaved
schedule), context and expert sizes > 1 are accepted (context parallelism: ``transformer/context_parallel.py``); the
features listed in ``_refuse_unsupported`` (hierarchical context parallelism among them) are refused with a message
naming the flag.

Before ``initialize_model_parallel`` the layout is pure data parallelism: the groups spanning every rank in that
layout (data, expert-data, tensor+data) are the default (WORLD) group, or None without torch.distributed; model
parallel sizes are 1 and ranks 0, so single-process code needs no set-up. The other groups raise "... is not
initialized" as upstream's do (``check_initialized=False``: None).

Groups with the same ranks, backend and options are created once and shared, e.g. the data-parallel group with and
without context parallelism while the context size is 1, or the expert-tensor and tensor groups.
"""
import contextlib
import math
import warnings
from datetime import timedelta
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import dist_utils

try:
    import einops  # noqa: F401

    HAVE_EINOPS = True  # upstream's flag (einops is optional)
except ImportError:
    HAVE_EINOPS = False

_KINDS = ("tp", "cp", "ep", "dp", "pp", "gtp_remat")

# Upstream's wording for each group, used in "... is not initialized".
_DESCRIPTIONS = {
    "dp": "data parallel group",
    "dp_cp": "data parallel group with context parallel combined",
    "dp_gloo": "data parallel group-gloo",
    "dp_cp_gloo": "data parallel group-gloo with context parallel combined",
    "cp": "context parallel group",
    "mp": "model parallel group",
    "tp": "tensor model parallel group",
    "pp": "pipeline_model parallel group",
    "embd": "embedding group",
    "pos_embd": "position embedding group",
    "tp_dp": "tensor and data parallel group",
    "tp_dp_cp": "tensor and data parallel group with context parallel combined",
    "tp_cp": "tensor and context parallel group",
    "ep": "expert model parallel group",
    "etp": "Expert tensor parallel group",
    "etp_ep": "Expert tensor and model parallel group",
    "etp_ep_pp": "Expert tensor-model-pipeline parallel group",
    "edp": "Expert data parallel group",
    "edp_gloo": "Expert data parallel group-gloo",
    "intra_dp_cp": "Intra partial data parallel group with context parallel combined",
    "intra_dp_cp_gloo": "Intra partial data parallel group-gloo with context parallel combined",
    "inter_dp_cp": "Inter partial data parallel group",
    "intra_edp": "Intra partial expert data parallel group",
    "inter_edp": "Inter partial expert data parallel group",
    "intra_dist_opt": "Intra distributed optimizer instance group",
    "inter_dist_opt": "Inter distributed optimizer instance group",
    "gtp_remat": "generalized tensor parallel group",
    "egtp_remat": "expert generalized tensor parallel group",
}
# Groups that hold every rank in the pure data-parallel layout used before initialisation.
_WORLD_BEFORE_INIT = {"dp", "dp_cp", "tp_dp", "tp_dp_cp", "edp", "intra_dist_opt"}

_INITIALIZED = False
_NUM_INSTANCES = {"n": 1}  # --num-distributed-optimizer-instances (hybrid sharding under Megatron-FSDP)
_GROUPS: Dict[str, dist.ProcessGroup] = {}  # name -> this rank's group
_RANKS: Dict[str, List[int]] = {}  # name -> global ranks of this rank's group
_CREATED: Dict[tuple, object] = {}  # (ranks, backend, options) -> group, so equal groups are created once
_OVERRIDES: Dict[str, Optional[int]] = {}  # values of the set_* functions
_VIRTUAL_PIPELINE = {"size": None, "rank": None}
_LAYOUT: Dict[str, "RankGenerator"] = {}  # "dense" / "expert": the rank generators of initialize_model_parallel
_GLOBAL_MEMORY_BUFFER = None


# ---------------------------------------------------------------------------------------------- rank layout
def generate_masked_orthogonal_rank_groups(world_size: int, parallel_size: List[int], mask: List[bool]) -> List[List[int]]:
    """Rank groups of the parallelism kinds selected by ``mask``.

    ``parallel_size`` lists the size of each kind in layout order: global rank = i0 + i1*s0 + i2*s0*s1 + ...
    A group varies the masked indices (the first one fastest) and fixes the others; groups are enumerated with the
    first unmasked index fastest. E.g. sizes [2, 3, 4] (tp, dp, pp), mask [False, True, False] ->
    [[0, 2, 4], [1, 3, 5], [6, 8, 10], ..., [19, 21, 23]].
    """
    if math.prod(parallel_size) != world_size:
        raise ValueError(f"world_size {world_size} != product of parallel sizes {list(parallel_size)}")
    # C-order grid with the first kind on the last (fastest) axis; move unmasked axes first, masked axes last.
    grid = torch.arange(world_size).reshape(list(reversed(parallel_size)))
    axes = list(range(len(parallel_size)))  # axis a holds kind len-1-a
    unmasked = [a for a in axes if not mask[len(axes) - 1 - a]]
    masked = [a for a in axes if mask[len(axes) - 1 - a]]
    group_size = math.prod(parallel_size[i] for i in range(len(mask)) if mask[i])
    return grid.permute(unmasked + masked).reshape(-1, group_size).tolist()


class RankGenerator:
    """Rank groups of one layout. ``order`` lists the kinds (``tp``, ``cp``, ``ep``, ``dp``, ``pp``) joined by '-',
    fastest-varying first; kinds of size 1 may be left out (they are appended). ``get_ranks('tp-dp')``: the groups
    spanning tensor and data parallelism together."""

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0,
                 gtp_remat: int = 1) -> None:
        if ep != 1 and cp != 1:
            raise ValueError(f"RankGenerator: ep ({ep}) and cp ({cp}) cannot both be > 1 in one generator (CP is in "
                             "the dense generator, EP in the expert one)")
        self.tp, self.ep, self.dp, self.pp, self.cp, self.gtp_remat = tp, ep, dp, pp, cp, gtp_remat
        self.rank_offset = rank_offset
        self.world_size = tp * ep * dp * pp * cp * gtp_remat
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp, "gtp_remat": gtp_remat}
        tokens = order.lower().split("-")
        for token in tokens:
            if token not in self.name_to_size:
                raise ValueError(f"order {order!r}: unknown parallelism {token!r} (expected {'-'.join(_KINDS[:5])})")
        if len(set(tokens)) != len(tokens):
            raise ValueError(f"order {order!r} names a parallelism twice")
        for name, size in self.name_to_size.items():
            if name not in tokens:
                if size != 1:
                    raise RuntimeError(f"The size of ({name}) is ({size}), but you haven't specified the order "
                                       f"({order}).")
                tokens.append(name)
        self.order = "-".join(tokens)
        self.ordered_size = [self.name_to_size[t] for t in tokens]

    def get_mask(self, order: str, token: str) -> List[bool]:
        """True for each kind of ``order`` that ``token`` (kinds joined by '-') names."""
        ordered = order.split("-")
        wanted = token.lower().split("-")
        for t in wanted:
            if t not in ordered:
                raise ValueError(f"get_ranks: unknown parallelism {t!r} in {token!r} (order {order})")
        return [t in wanted for t in ordered]

    def get_ranks(self, token: str) -> List[List[int]]:
        """The rank groups spanning the kinds in ``token`` (e.g. ``'tp'``, ``'tp-dp'``), shifted by rank_offset."""
        groups = generate_masked_orthogonal_rank_groups(self.world_size, self.ordered_size,
                                                        self.get_mask(self.order, token))
        return [[r + self.rank_offset for r in group] for group in groups]

    def get_gtp_ranks(self, gtp_remat_size: int) -> List[List[int]]:
        """The generalized-tensor-parallel weight-rematerialization groups (singletons when the size is 1)."""
        assert self.gtp_remat == gtp_remat_size, \
            f"gtp_remat axis size ({self.gtp_remat}) != requested gtp_remat_size ({gtp_remat_size})"
        return self.get_ranks("gtp_remat")


def default_embedding_ranks(pp_ranks: List[int]) -> List[int]:
    """The stages holding word embeddings: the first and the last pipeline stage."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: List[int]) -> List[int]:
    """The stage holding position embeddings: the first pipeline stage."""
    return [pp_ranks[0]]


# ---------------------------------------------------------------------------------------------- initialisation
def _refuse_unsupported(tp, pp, vpp, cp, hcp, hybrid_cp, ep, etp, gtp, egtp, instances, use_sharp, sharp_group,
                        pp_backend) -> None:
    sizes = (("tensor_model_parallel_size", "--tensor-model-parallel-size", tp),
             ("pipeline_model_parallel_size", "--pipeline-model-parallel-size", pp),
             ("context_parallel_size", "--context-parallel-size", cp),
             ("expert_model_parallel_size", "--expert-model-parallel-size", ep),
             ("expert_tensor_parallel_size", "--expert-tensor-parallel-size", etp),
             ("num_distributed_optimizer_instances", "--num-distributed-optimizer-instances", instances),
             ("gtp_remat_size", "gtp_remat_size", gtp), ("expert_gtp_remat_size", "expert_gtp_remat_size", egtp))
    for name, flag, value in sizes:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} ({flag}) must be a positive integer")
    vpp_flags = "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank"
    if vpp is not None and (isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 1):
        raise ValueError(f"virtual_pipeline_model_parallel_size={vpp!r} ({vpp_flags}) must be a positive integer")
    if vpp is not None and pp <= 1:
        raise RuntimeError(f"pipeline-model-parallel size should be greater than 1 with interleaved schedule "
                           f"(virtual_pipeline_model_parallel_size={vpp}, {vpp_flags}, needs "
                           f"--pipeline-model-parallel-size > 1)")
    refused = (
        (bool(hcp) and math.prod(hcp) != 1,
         f"hierarchical_context_parallel_sizes={hcp} (--hierarchical-context-parallel-sizes)"),
        (bool(hybrid_cp), "hybrid_context_parallel=True: hybrid data x context parallelism"),
        (gtp > 1, f"gtp_remat_size={gtp}: generalized tensor parallel weight rematerialization"),
        (egtp > 1, f"expert_gtp_remat_size={egtp}: generalized tensor parallel weight rematerialization"),
        (bool(use_sharp), "use_sharp=True (--use-sharp): SHARP"),
    )
    for bad, what in refused:
        if bad:
            raise ValueError(f"{what} is not supported by this fork yet (use the default)")
    if sharp_group is not None:
        raise ValueError(f"sharp_enabled_group={sharp_group!r}: sharp_enabled_group is only valid when use_sharp is "
                         "True (--sharp-enabled-group needs --use-sharp)")
    if pp_backend not in (None, "nccl", "ucc"):
        raise ValueError(f'"{pp_backend}" backend for PP communication is currently not supported '
                         "(--pipeline-model-parallel-comm-backend: nccl or ucc)")


def _contiguous_pieces(ranks: List[int], n: int, what: str) -> List[List[int]]:
    """``ranks`` cut into ``n`` contiguous pieces (one per distributed-optimizer instance)."""
    if len(ranks) % n:
        raise RuntimeError(f"num_distributed_optimizer_instances ({n}, --num-distributed-optimizer-instances) must "
                           f"divide the size of {what} ({len(ranks)})")
    size = len(ranks) // n
    return [list(ranks[i * size:(i + 1) * size]) for i in range(n)]


def _strided_pieces(ranks: List[int], n: int) -> List[List[int]]:
    """The ranks at the same position of each of the ``n`` contiguous pieces of ``ranks``."""
    size = len(ranks) // n
    return [list(ranks[j::size]) for j in range(size)]


def _load_nccl_configs(path: Optional[str], high_priority_stream_groups: Optional[List[str]]) -> dict:
    """Per-group NCCL communicator settings: the YAML file of --nccl-communicator-config-path (plain data only,
    ``yaml.safe_load``) plus ``is_high_priority_stream`` for ``high_priority_stream_groups``."""
    configs = {}
    if path is not None:
        try:
            import yaml
        except ImportError as e:
            raise RuntimeError("Cannot import `yaml`. Setting custom nccl communicator configs requires the yaml "
                               "package (--nccl-communicator-config-path)") from e
        with open(path, "r") as f:
            configs = yaml.safe_load(f) or {}
        if not isinstance(configs, dict) or not all(isinstance(v, dict) for v in configs.values()):
            raise ValueError(f"{path} (--nccl-communicator-config-path): expected a mapping of group name -> "
                             "{option: value}")
    for name in high_priority_stream_groups or []:
        configs.setdefault(name, {})["is_high_priority_stream"] = True
    return configs


def get_nccl_options(pg_name, nccl_comm_cfgs):
    """``ProcessGroupNCCL.Options`` for the group ``pg_name`` from ``nccl_comm_cfgs`` (name -> {option: value}: the
    communicator settings of --nccl-communicator-config-path), or None when it has no entry (NCCL's defaults)."""
    if pg_name not in nccl_comm_cfgs:
        return None
    config = nccl_comm_cfgs[pg_name]
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=config.get("is_high_priority_stream", False))
    for key in ("cga_cluster_size", "max_ctas", "min_ctas", "net_name"):
        if key in config:
            if key == "net_name" and str(config[key]).lower() not in ("ib", "socket"):
                raise RuntimeError(f"net_name ({config[key]}) is not supported. Accepted values: 'IB' or 'socket'.")
            setattr(options.config, key, config[key])
    return options


def overwrite_nccl_comm_cfgs(nccl_comm_cfgs, pg_name, key_value_pair):
    """Set ``nccl_comm_cfgs[pg_name][key] = value`` for ``key_value_pair = (key, value)`` (the entry made if absent)."""
    key, value = key_value_pair
    nccl_comm_cfgs.setdefault(pg_name, {})[key] = value


_USER_GROUPS: List[dist.ProcessGroup] = []  # groups made by create_group that this rank is in


def create_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False,
                 group_desc=None):
    """``torch.distributed.new_group`` with upstream's arguments (collective over the world unless
    ``use_local_synchronization``); the group is remembered for ``update_pg_timeout``."""
    group = dist.new_group(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                           use_local_synchronization=use_local_synchronization, group_desc=group_desc)
    if isinstance(group, dist.ProcessGroup):
        _USER_GROUPS.append(group)
    return group


def _my_groups() -> List[dist.ProcessGroup]:
    """Every group this rank is in: the default group, initialize_model_parallel's and create_group's."""
    out: List[dist.ProcessGroup] = [dist.group.WORLD]
    for g in list(_CREATED.values()) + _USER_GROUPS:
        if isinstance(g, dist.ProcessGroup) and all(g is not o for o in out):
            out.append(g)
    return out


def update_pg_timeout(timeout: timedelta, pg: Optional[dist.ProcessGroup] = None) -> None:
    """Set ``timeout`` on ``pg``, or on every group of this rank (``pg`` None), after a barrier over ``pg`` (the
    world when None); nothing where torch lacks ``_set_pg_timeout``."""
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        return
    dist.barrier(pg)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for group in ([pg] if pg is not None else _my_groups()):
        set_timeout(timeout, group)


class _NotInitializedError(AssertionError, RuntimeError):
    """torch.distributed is not initialised: an AssertionError as upstream's ``assert
    torch.distributed.is_initialized()`` (its unit tests expect one), and the RuntimeError this fork raised before."""


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_comm_backend: Optional[str] = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Optional[List[int]] = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    gtp_remat_size: int = 1,
    expert_gtp_remat_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    nccl_communicator_config_path: Optional[str] = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Optional[Callable[[List[int]], List[int]]] = None,
    get_position_embedding_ranks: Optional[Callable[[List[int]], List[int]]] = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: Optional[List[str]] = None,
    sharp_enabled_group: Optional[str] = None,
    rank_offset: int = 0,
    local_world_size: Optional[int] = None,
) -> None:
    """Create the process groups (upstream 0.19's parameters, order and defaults).

    data parallel size = world / (tp x pp x cp); expert data parallel size = world / (expert tp x ep x pp), expert tp
    defaulting to tp. ``rank_offset``/``local_world_size``: lay the groups out over ranks
    [rank_offset, rank_offset + local_world_size) only. NCCL communicator options apply to NCCL groups only.
    """
    global _INITIALIZED, _GLOBAL_MEMORY_BUFFER
    if not dist.is_initialized():
        raise _NotInitializedError("initialize_model_parallel needs torch.distributed to be initialised first")
    if _INITIALIZED:
        raise RuntimeError("model parallel groups are already initialized: call destroy_model_parallel() first")
    tp, pp, cp, ep = (tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size,
                      expert_model_parallel_size)
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    _refuse_unsupported(tp, pp, virtual_pipeline_model_parallel_size, cp, hierarchical_context_parallel_sizes,
                        hybrid_context_parallel, ep, etp, gtp_remat_size, expert_gtp_remat_size,
                        num_distributed_optimizer_instances, use_sharp, sharp_enabled_group,
                        pipeline_model_parallel_comm_backend)
    full_world = dist.get_world_size()
    world_size = full_world if local_world_size is None else local_world_size
    if rank_offset < 0 or world_size < 1 or rank_offset + world_size > full_world:
        raise ValueError(f"rank_offset={rank_offset}, local_world_size={local_world_size}: ranks "
                         f"[{rank_offset}, {rank_offset + world_size}) are not within the world of {full_world}")
    model_size = tp * pp * cp
    if world_size % model_size != 0:
        raise RuntimeError(f"world_size ({world_size}) is not divisible by {model_size} (--tensor-model-parallel-size "
                           f"{tp} x --pipeline-model-parallel-size {pp} x --context-parallel-size {cp})")
    expert_model_size = etp * ep * pp
    if world_size % expert_model_size != 0:
        raise RuntimeError(f"world_size ({world_size}) is not divisible by expert_tensor_model_pipeline_parallel size "
                           f"({expert_model_size}) (--expert-tensor-parallel-size {etp} x "
                           f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp})")
    dense = RankGenerator(tp=tp, ep=1, dp=world_size // model_size, pp=pp, cp=cp, order=order,
                          rank_offset=rank_offset)
    expert = RankGenerator(tp=etp, ep=ep, dp=world_size // expert_model_size, pp=pp, cp=1, order=order,
                           rank_offset=rank_offset)
    _LAYOUT.update(dense=dense, expert=expert)
    nccl_configs = _load_nccl_configs(nccl_communicator_config_path, high_priority_stream_groups)
    timeout = timedelta(minutes=distributed_timeout_minutes)
    default_backend = str(dist.get_backend())
    me = dist.get_rank()

    def build(name: str, rank_lists: List[List[int]], config_name: str, gloo: bool = False) -> None:
        backend = "gloo" if gloo else default_backend
        config = None if gloo or "nccl" not in backend else nccl_configs.get(config_name)
        for ranks in rank_lists:
            key = (tuple(ranks), backend, repr(sorted(config.items())) if config else None)
            if key not in _CREATED:  # every rank takes the same branches: new_group is collective
                _CREATED[key] = dist.new_group(ranks, timeout=timeout, backend="gloo" if gloo else None,
                                               pg_options=get_nccl_options(config_name, nccl_configs)
                                               if config else None, group_desc=name.upper())
            if me in ranks:
                _GROUPS[name], _RANKS[name] = _CREATED[key], list(ranks)

    try:
        build("dp_cp", dense.get_ranks("dp-cp"), "dp_cp")
        build("dp", dense.get_ranks("dp"), "dp")
        if create_gloo_process_groups:
            build("dp_cp_gloo", dense.get_ranks("dp-cp"), "", gloo=True)
            build("dp_gloo", dense.get_ranks("dp"), "", gloo=True)
        build("cp", dense.get_ranks("cp"), "cp")
        build("mp", dense.get_ranks("tp-pp"), "mp")
        build("tp", dense.get_ranks("tp"), "tp")
        pp_groups = dense.get_ranks("pp")
        build("pp", pp_groups, "pp")
        build("embd", [(get_embedding_ranks or default_embedding_ranks)(r) for r in pp_groups], "embd")
        build("pos_embd", [(get_position_embedding_ranks or default_position_embedding_ranks)(r) for r in pp_groups],
              "pos_embd")
        build("tp_dp_cp", dense.get_ranks("tp-dp-cp"), "tp_dp_cp")
        build("tp_dp", dense.get_ranks("tp-dp"), "tp_dp")
        build("tp_cp", dense.get_ranks("tp-cp"), "tp_cp")
        build("ep", expert.get_ranks("ep"), "ep")
        build("etp", expert.get_ranks("tp"), "ep_tp")
        build("etp_ep", expert.get_ranks("tp-ep"), "tp_ep_mp")
        build("etp_ep_pp", expert.get_ranks("tp-ep-pp"), "tp_ep_pp")
        build("edp", expert.get_ranks("dp"), "ep_dp")
        if create_gloo_process_groups:
            build("edp_gloo", expert.get_ranks("dp"), "", gloo=True)
        # GTP weight rematerialization is not supported (size 1): its groups are singletons, as upstream's then
        build("gtp_remat", dense.get_gtp_ranks(gtp_remat_size), "gtp_remat")
        build("egtp_remat", expert.get_gtp_ranks(expert_gtp_remat_size), "expt_gtp_remat")
        # A distributed-optimizer instance: the model-parallel groups of its expert-data-parallel replicas; with N
        # instances the ranks (and each data-parallel group) are cut into N contiguous pieces, as upstream: the
        # intra-partial data-parallel group shards (Megatron-FSDP's hybrid sharding), the inter-partial one replicates
        instance_ranks = [r for g in expert.get_ranks("tp-ep-pp") for r in g]
        n = num_distributed_optimizer_instances
        build("intra_dist_opt", _contiguous_pieces(instance_ranks, n, "the world"), "intra_dist_opt_instance")
        if n > 1:
            build("inter_dist_opt", _strided_pieces(instance_ranks, n), "inter_dist_opt_instance")
            dp_cp_pieces = [p for ranks in dense.get_ranks("dp-cp")
                            for p in _contiguous_pieces(ranks, n, "the data-parallel x context-parallel group")]
            build("intra_dp_cp", dp_cp_pieces, "intra_dp_cp")
            if create_gloo_process_groups:
                build("intra_dp_cp_gloo", dp_cp_pieces, "", gloo=True)
            build("inter_dp_cp", [p for ranks in dense.get_ranks("dp-cp") for p in _strided_pieces(ranks, n)],
                  "inter_dp_cp")
            edp_pieces = [p for ranks in expert.get_ranks("dp")
                          for p in _contiguous_pieces(ranks, n, "the expert-data-parallel group")]
            build("intra_edp", edp_pieces, "intra_ep_dp")
            build("inter_edp", [p for ranks in expert.get_ranks("dp") for p in _strided_pieces(ranks, n)],
                  "inter_ep_dp")
        _NUM_INSTANCES["n"] = n
        if virtual_pipeline_model_parallel_size is not None:  # as upstream: this rank starts at virtual stage 0
            _VIRTUAL_PIPELINE.update(size=virtual_pipeline_model_parallel_size, rank=0)
    except BaseException:
        destroy_model_parallel()
        raise
    _INITIALIZED = True
    _GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()


def is_initialized() -> bool:
    """Whether ``initialize_model_parallel`` created this rank's data-parallel group."""
    return _INITIALIZED and "dp" in _GROUPS


def model_parallel_is_initialized() -> bool:
    """Whether the tensor, pipeline and data parallel groups exist."""
    return _INITIALIZED and all(name in _GROUPS for name in ("tp", "pp", "dp"))


def destroy_model_parallel() -> None:
    """Forget every group and set_* value. The groups are not destroyed (torch.distributed's own teardown does):
    objects built on them may outlive this call (a DeviceMesh of an FSDP model), and a peer may still be inside the
    collective creation of a group this rank has finished with."""
    global _INITIALIZED, _GLOBAL_MEMORY_BUFFER
    _INITIALIZED = False
    _GROUPS.clear()
    _RANKS.clear()
    _CREATED.clear()
    _USER_GROUPS.clear()
    _OVERRIDES.clear()
    _NUM_INSTANCES["n"] = 1
    _VIRTUAL_PIPELINE.update(size=None, rank=None)
    _LAYOUT.clear()
    _GLOBAL_MEMORY_BUFFER = None


# ---------------------------------------------------------------------------------------------- extra groups
def _my_new_group(rank_lists: List[List[int]], **kwargs):
    """``create_group`` for every list (collective: every rank makes them all); this rank's group, or None."""
    mine = None
    for ranks in rank_lists:
        group = create_group(ranks, **kwargs)
        if _me() in ranks:
            mine = group
    return mine


def create_all_gather_groups(for_expert_parallelism=False, timeout=None, nccl_comm_cfgs=None):
    """``(dp_cp_ag_group, expt_dp_ag_group)``: second communicators with the ranks of the data x context parallel
    groups (and, with ``for_expert_parallelism`` and expert parallelism, of the expert-data-parallel groups; else
    None), so all-gathers can overlap reduce-scatters (upstream's AG/RS overlap)."""
    if not is_initialized():
        raise RuntimeError("create_all_gather_groups() requires parallel state to be initialized. "
                           "Call initialize_model_parallel() first.")
    cfgs = nccl_comm_cfgs or {}
    dp_cp_ag = _my_new_group(_LAYOUT["dense"].get_ranks("dp-cp"), timeout=timeout,
                             pg_options=get_nccl_options("dp_cp", cfgs), group_desc="DATA_PARALLEL_GROUP_WITH_CP_AG")
    expt_dp_ag = None
    if for_expert_parallelism and get_expert_model_parallel_world_size() > 1:
        expt_dp_ag = _my_new_group(_LAYOUT["expert"].get_ranks("dp"), timeout=timeout,
                                   pg_options=get_nccl_options("ep_dp", cfgs),
                                   group_desc="EXPERT_DATA_PARALLEL_GROUP_AG")
    return dp_cp_ag, expt_dp_ag


def create_hierarchical_groups(rank, ranks, hierarchical_group_sizes, create_gloo_process_groups=False,
                               pg_options=None, timeout=None, group_desc=None):
    """``(groups, gloo_groups)``: ``rank``'s group at each level of ``ranks`` split hierarchically. Level ``k`` groups
    ``hierarchical_group_sizes[k]`` ranks at stride ``prod(sizes[:k])``: 16 ranks with sizes [2, 2, 4] give level 0
    [0, 1], [2, 3], ...; level 1 [0, 2], [1, 3], [4, 6], ...; level 2 [0, 4, 8, 12], [1, 5, 9, 13], ...
    ``pg_options``: one for all levels or a list; gloo groups are None unless ``create_gloo_process_groups``."""
    sizes = list(hierarchical_group_sizes)
    options = pg_options if isinstance(pg_options, list) else [pg_options] * len(sizes)
    groups, gloo_groups = [], []
    for level, size in enumerate(sizes):
        stride, outer = math.prod(sizes[:level]), math.prod(sizes[level + 1:])
        lists = [[ranks[(o * size + i) * stride + u] for i in range(size)] for o in range(outer) for u in range(stride)]
        for sub_ranks in lists:
            group = create_group(sub_ranks, timeout=timeout, pg_options=options[level],
                                 group_desc=f"HIERARCHICAL_{group_desc}_L{level}")
            gloo = create_group(sub_ranks, timeout=timeout, backend="gloo", pg_options=options[level],
                                group_desc=f"HIERARCHICAL_{group_desc}_GLOO_L{level}") \
                if create_gloo_process_groups else None
            if rank in sub_ranks:
                groups.append(group)
                gloo_groups.append(gloo)
    assert rank not in ranks or len(groups) == len(sizes)
    return groups, gloo_groups


def create_hybrid_dp_cp_groups(rank, ranks, pg_options):
    """``{size: group}``: ``rank``'s group among ``ranks`` cut into consecutive pieces of each power of two from 2
    up to (not including) ``len(ranks)``."""
    out = {}
    size = 2
    while size < 2 ** int(math.log2(len(ranks))):
        for start in range(0, len(ranks), size):
            piece = ranks[start:start + size]
            group = create_group(piece, pg_options=pg_options, group_desc=f"HYBRID_DP_CP_GROUP_{size}")
            if rank in piece:
                out[size] = group
        size *= 2
    return out


# ---------------------------------------------------------------------------------------------- lookups
def _me() -> int:
    return dist_utils.get_rank()


def _ranks(name: str) -> List[int]:
    """Global ranks of this rank's ``name`` group; before initialisation, those of the pure data-parallel layout."""
    if _INITIALIZED:
        if name not in _RANKS:
            raise AssertionError(f"{_DESCRIPTIONS[name]} is not initialized")
        return _RANKS[name]
    if name in _WORLD_BEFORE_INIT:
        return list(range(dist_utils.get_world_size()))
    return [_me()]


def _group(name: str, check_initialized: bool = True):
    if _INITIALIZED or name not in _WORLD_BEFORE_INIT:
        group = _GROUPS.get(name)
        if group is None and check_initialized:
            raise AssertionError(f"{_DESCRIPTIONS[name]} is not initialized")
        return group
    return dist.group.WORLD if dist.is_initialized() else None


def _size(name: str, override: Optional[str] = None) -> int:
    value = _OVERRIDES.get(override) if override else None
    return value if value is not None else len(_ranks(name))


def _rank(name: str, override: Optional[str] = None) -> int:
    value = _OVERRIDES.get(override) if override else None
    return value if value is not None else _ranks(name).index(_me())


def _dp_name(with_context_parallel: bool, partial_data_parallel: bool) -> str:
    if partial_data_parallel and not with_context_parallel:
        raise AssertionError("Partial DP for Optimizer needs to include CP")
    if partial_data_parallel and _NUM_INSTANCES["n"] > 1:
        return "intra_dp_cp"
    return "dp_cp" if with_context_parallel else "dp"  # one optimizer instance: partial DP == DP


# ---------------------------------------------------------------------------------------------- groups
def get_model_parallel_group(check_initialized=True):
    """The model-parallel (tensor x pipeline) group of this rank."""
    return _group("mp", check_initialized)


def get_tensor_model_parallel_group(check_initialized=True):
    return _group("tp", check_initialized)


def get_pipeline_model_parallel_group(check_initialized=True):
    return _group("pp", check_initialized)


def get_data_parallel_group(with_context_parallel=False, with_gtp_remat=True, partial_data_parallel=False):
    """The data-parallel group; the WORLD group before initialisation; None without torch.distributed.
    (``with_gtp_remat``: the same group, GTP rematerialization is not supported.)"""
    return _group(_dp_name(with_context_parallel, partial_data_parallel))


def get_data_parallel_group_gloo(with_context_parallel=False, partial_data_parallel=False):
    return _group(_dp_name(with_context_parallel, partial_data_parallel) + "_gloo")


def get_context_parallel_group(check_initialized=True):
    return _group("cp", check_initialized)


def get_context_parallel_global_ranks(check_initialized=True):
    if not _INITIALIZED and not check_initialized:
        return None
    return list(_ranks("cp"))


def get_hierarchical_context_parallel_groups(check_initialized=True):
    """The inner rings of hierarchical context parallelism: never built here
    (``hierarchical_context_parallel_sizes`` is refused), so None, or with ``check_initialized`` an
    AssertionError as upstream's when they were not built."""
    assert not check_initialized, (
        "hierarchical context parallel groups are not initialized (hierarchical_context_parallel_sizes is not "
        "supported by this fork)"
    )
    return None


def get_embedding_group(check_initialized=True):
    return _group("embd", check_initialized)


def get_position_embedding_group(check_initialized=True):
    return _group("pos_embd", check_initialized)


def get_amax_reduction_group(with_context_parallel=False, tp_only_amax_red=False):
    """The FP8 amax reduction group: tensor+data (+context) parallel, or tensor (+context) only."""
    if tp_only_amax_red:
        return _group("tp_cp" if with_context_parallel else "tp")
    return _group("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_tensor_and_data_parallel_group(check_initialized=True, with_context_parallel=False):
    return _group("tp_dp_cp" if with_context_parallel else "tp_dp", check_initialized)


def get_tensor_and_context_parallel_group(check_initialized=True):
    return _group("tp_cp", check_initialized)


def get_expert_model_parallel_group(check_initialized=True):
    return _group("ep", check_initialized)


def get_expert_tensor_parallel_group(check_initialized=True):
    return _group("etp", check_initialized)


def get_expert_tensor_and_model_parallel_group(check_initialized=True):
    return _group("etp_ep", check_initialized)


def get_expert_tensor_model_pipeline_parallel_group(check_initialized=True, with_egtp_remat=False):
    return _group("etp_ep_pp", check_initialized)


def get_expert_data_parallel_group(check_initialized=True, with_gtp_remat=True, partial_expert_data_parallel=False):
    """The expert-data-parallel group (the WORLD group before initialisation, as the data-parallel group);
    ``partial_expert_data_parallel``: its piece within this rank's distributed-optimizer instance."""
    if partial_expert_data_parallel and _INITIALIZED and _NUM_INSTANCES["n"] > 1:
        return _group("intra_edp", check_initialized)
    return _group("edp", check_initialized)


def get_inter_partial_expert_data_parallel_group(check_initialized=True):
    """The expert-data-parallel ranks at this rank's position in every instance (only with several
    distributed-optimizer instances): Megatron-FSDP's hybrid sharding replicates experts over this group."""
    return _group("inter_edp", check_initialized)


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel=False):
    return _group("edp_gloo")


def get_hybrid_data_context_parallel_groups(check_initialized=True, group_size=None):
    """The data x context parallel group when ``group_size`` is its size (as upstream); the smaller groups of
    hybrid data x context parallelism are never built here (``hybrid_context_parallel`` is refused)."""
    if get_data_parallel_world_size(with_context_parallel=True) == group_size:
        return get_data_parallel_group(with_context_parallel=True)
    assert not check_initialized, (f"hybrid data x context parallel groups of size {group_size} are not initialized "
                                   "(hybrid_context_parallel is not supported by this fork)")
    return None


def _singleton_size(name: str) -> int:
    """Upstream's size of a GTP group: the group's size once built, else 0 (also without torch.distributed)."""
    group = _group(name, check_initialized=False) if dist.is_initialized() else None
    return group.size() if group is not None else 0


def _singleton_rank(name: str) -> int:
    group = _group(name, check_initialized=False) if dist.is_initialized() else None
    return group.rank() if group is not None else 0


def _global_ranks(name: str, check_initialized: bool) -> Optional[List[int]]:
    if name not in _RANKS:
        assert not check_initialized, f"{_DESCRIPTIONS[name]} is not initialized"
        return None
    return list(_RANKS[name])


def get_gtp_weight_remat_group(check_initialized=True):
    """The generalized-tensor-parallel weight-rematerialization group: this rank alone (GTP is not supported)."""
    return _group("gtp_remat", check_initialized)


def get_gtp_weight_remat_world_size() -> int:
    return _singleton_size("gtp_remat")


def get_gtp_weight_remat_rank() -> int:
    return _singleton_rank("gtp_remat")


def get_gtp_weight_remat_global_ranks(check_initialized=True):
    return _global_ranks("gtp_remat", check_initialized)


def get_expert_gtp_weight_remat_group(check_initialized=True):
    """The expert generalized-tensor-parallel weight-rematerialization group: this rank alone."""
    return _group("egtp_remat", check_initialized)


def get_expert_gtp_weight_remat_world_size() -> int:
    return _singleton_size("egtp_remat")


def get_expert_gtp_weight_remat_rank() -> int:
    return _singleton_rank("egtp_remat")


def get_expert_gtp_weight_remat_global_ranks(check_initialized=True):
    return _global_ranks("egtp_remat", check_initialized)


def get_intra_distributed_optimizer_instance_group(check_initialized=True):
    return _group("intra_dist_opt", check_initialized)


def get_inter_distributed_optimizer_instance_group(check_initialized=True):
    """The ranks at this rank's position in every distributed-optimizer instance (only with several instances)."""
    return _group("inter_dist_opt", check_initialized)


def get_inter_partial_data_parallel_group(check_initialized=True):
    """The data-parallel(-with-context) ranks at this rank's position in every instance: Megatron-FSDP's hybrid
    sharding replicates over this group (only with several distributed-optimizer instances)."""
    return _group("inter_dp_cp", check_initialized)


def get_num_distributed_optimizer_instances() -> int:
    """``num_distributed_optimizer_instances`` of ``initialize_model_parallel`` (1 before it)."""
    return _NUM_INSTANCES["n"] if _INITIALIZED else 1


# ---------------------------------------------------------------------------------------------- sizes and ranks
def get_tensor_model_parallel_world_size() -> int:
    return _size("tp", "tp_size")


def get_tensor_model_parallel_rank() -> int:
    return _rank("tp", "tp_rank")


def get_pipeline_model_parallel_world_size() -> int:
    return _size("pp", "pp_size")


def get_pipeline_model_parallel_rank() -> int:
    return _rank("pp", "pp_rank")


def get_data_parallel_world_size(with_context_parallel=False, with_gtp_remat=True, partial_data_parallel=False) -> int:
    """Size of the data-parallel group; before initialisation the world size (1 without torch.distributed)."""
    return _size(_dp_name(with_context_parallel, partial_data_parallel))


def get_data_parallel_rank(with_context_parallel=False, with_gtp_remat=True, partial_data_parallel=False) -> int:
    return _rank(_dp_name(with_context_parallel, partial_data_parallel), "dp_rank")


def get_context_parallel_world_size() -> int:
    return _size("cp")


def get_context_parallel_rank() -> int:
    return _rank("cp")


def get_tensor_and_context_parallel_world_size() -> int:
    return _size("tp_cp")


def get_tensor_and_context_parallel_rank() -> int:
    return _rank("tp_cp")


def get_expert_model_parallel_world_size() -> int:
    return _size("ep", "ep_size")


def get_expert_model_parallel_rank() -> int:
    return _rank("ep", "ep_rank")


def get_expert_tensor_parallel_world_size() -> int:
    """Expert tensor parallel size (the tensor size unless --expert-tensor-parallel-size says otherwise)."""
    if _OVERRIDES.get("etp_size") is None and not _INITIALIZED:
        return get_tensor_model_parallel_world_size()
    return _size("etp", "etp_size")


def get_expert_tensor_parallel_rank() -> int:
    if _OVERRIDES.get("etp_rank") is None and not _INITIALIZED:
        return get_tensor_model_parallel_rank()
    return _rank("etp", "etp_rank")


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return _size("etp_ep")


def get_expert_tensor_and_model_parallel_rank() -> int:
    return _rank("etp_ep")


def get_expert_data_parallel_world_size(with_gtp_remat=True, partial_expert_data_parallel=False) -> int:
    return _size("edp")


def get_expert_data_parallel_rank(with_gtp_remat=True, partial_expert_data_parallel=False) -> int:
    return _rank("edp")


def get_all_ranks() -> str:
    """This rank's tensor, data, context, pipeline and expert ranks, joined by '_'."""
    return "_".join(str(r) for r in (get_tensor_model_parallel_rank(), get_data_parallel_rank(),
                                     get_context_parallel_rank(), get_pipeline_model_parallel_rank(),
                                     get_expert_model_parallel_rank()))


# ---------------------------------------------------------------------------------------------- overrides (set_*)
def set_tensor_model_parallel_world_size(world_size):
    _OVERRIDES["tp_size"] = world_size


def set_tensor_model_parallel_rank(rank):
    _OVERRIDES["tp_rank"] = rank


def set_pipeline_model_parallel_world_size(world_size):
    _OVERRIDES["pp_size"] = world_size


def set_pipeline_model_parallel_rank(rank):
    _OVERRIDES["pp_rank"] = rank


def set_data_parallel_rank(rank):
    _OVERRIDES["dp_rank"] = rank


def set_expert_model_parallel_world_size(world_size):
    _OVERRIDES["ep_size"] = world_size


def set_expert_model_parallel_rank(rank):
    _OVERRIDES["ep_rank"] = rank


def set_expert_tensor_parallel_world_size(world_size):
    _OVERRIDES["etp_size"] = world_size


def set_expert_tensor_parallel_rank(rank):
    _OVERRIDES["etp_rank"] = rank


def set_virtual_pipeline_model_parallel_world_size(world_size):
    _VIRTUAL_PIPELINE["size"] = world_size


def set_virtual_pipeline_model_parallel_rank(rank):
    warnings.warn("set_virtual_pipeline_model_parallel_rank in global scope is deprecated. Pass vp_stage explicitly "
                  "to is_pipeline_first_stage, is_pipeline_last_stage, etc.", DeprecationWarning)
    _VIRTUAL_PIPELINE["rank"] = rank


def get_virtual_pipeline_model_parallel_world_size():
    return _VIRTUAL_PIPELINE["size"]


def get_virtual_pipeline_model_parallel_rank():
    return _VIRTUAL_PIPELINE["rank"]


# ---------------------------------------------------------------------------------------------- pipeline stages
def is_pipeline_first_stage(ignore_virtual=True, vp_stage=None) -> bool:
    if not ignore_virtual and get_virtual_pipeline_model_parallel_world_size() is not None:
        if vp_stage is None:
            raise AssertionError("vp_stage must be passed if virtual pipeline is enabled")
        if vp_stage != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None) -> bool:
    vpp = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vpp is not None:
        if vp_stage is None:
            raise AssertionError("vp_stage must be passed if virtual pipeline is enabled")
        if vp_stage != vpp - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual=True, vp_stage=None) -> bool:
    ranks = _RANKS.get("embd")
    if ranks is None or _me() not in ranks:
        return False
    if ignore_virtual or _me() not in (ranks[0], ranks[-1]):
        return True
    if _me() == ranks[0] and is_pipeline_first_stage(False, vp_stage):
        return True
    return _me() == ranks[-1] and is_pipeline_last_stage(False, vp_stage)


def is_rank_in_position_embedding_group() -> bool:
    return _me() in _RANKS.get("pos_embd", ())


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of the first rank of this rank's tensor-parallel group."""
    return _ranks("tp")[0]


def get_model_parallel_src_rank() -> int:
    return _ranks("mp")[0]


def get_data_parallel_src_rank(with_context_parallel=False) -> int:
    return _ranks("dp_cp" if with_context_parallel else "dp")[0]


def get_expert_model_parallel_src_rank() -> int:
    return _ranks("ep")[0]


def get_pipeline_model_parallel_first_rank() -> int:
    return _ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _ranks("pp")[get_pipeline_model_parallel_world_size() - 1]


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() + 1) % get_pipeline_model_parallel_world_size()]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() - 1) % get_pipeline_model_parallel_world_size()]


# ---------------------------------------------------------------------------------------------- buffers, devices
class GlobalMemoryBuffer:
    """Reusable scratch tensors keyed by (name, dtype), grown on demand; callers must not use two tensors of the
    same name at once. Lives on the current GPU, or the CPU without CUDA."""

    def __init__(self):
        self.buffer = {}

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context: Optional[Callable] = None) -> torch.Tensor:
        numel = math.prod(tensor_shape)
        current = self.buffer.get((name, dtype))
        if current is None or current.numel() < numel:
            device = dist_utils.default_device()
            with (mem_alloc_context or contextlib.nullcontext)():
                current = self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype, device=device)
        return current[:numel].view(*tensor_shape)


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    if _GLOBAL_MEMORY_BUFFER is None:
        raise AssertionError("global memory buffer is not initialized")
    return _GLOBAL_MEMORY_BUFFER


def destroy_global_memory_buffer() -> None:
    global _GLOBAL_MEMORY_BUFFER
    _GLOBAL_MEMORY_BUFFER = None


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where tensors for collectives on ``group`` live: the current GPU under NCCL (it takes no CPU tensors), else
    the CPU (gloo)."""
    if "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# upstream's module globals of the main groups (read by upstream's unit tests and some callers): None until
# initialize_model_parallel, and again after destroy_model_parallel
_UPSTREAM_GROUP_GLOBALS = {
    "_MODEL_PARALLEL_GROUP": "mp", "_TENSOR_MODEL_PARALLEL_GROUP": "tp", "_PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "_EMBEDDING_GROUP": "embd", "_POSITION_EMBEDDING_GROUP": "pos_embd", "_DATA_PARALLEL_GROUP": "dp",
    "_CONTEXT_PARALLEL_GROUP": "cp", "_EXPERT_MODEL_PARALLEL_GROUP": "ep", "_EXPERT_TENSOR_PARALLEL_GROUP": "etp",
    "_EXPERT_DATA_PARALLEL_GROUP": "edp",
}


def __getattr__(name: str):
    if name in _UPSTREAM_GROUP_GLOBALS:
        return _GROUPS.get(_UPSTREAM_GROUP_GLOBALS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
