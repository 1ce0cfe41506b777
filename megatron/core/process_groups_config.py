"""Upstream's ``ProcessGroupCollection``: the process groups a model or wrapper uses, passed as ``pg_collection=``.

``ProcessGroupCollection(tp=..., dp=..., ...)`` takes any of the fields below by keyword (an unknown name raises);
a field not given reads as None. ``ProcessGroupCollection.use_mpu_process_groups(required_pgs=None)`` fills the
fields (all, or those named) from ``parallel_state``, as upstream.

This fork's layers take their groups from ``parallel_state``: a model or wrapper given ``pg_collection=`` accepts it
when its groups are ``parallel_state``'s (what ``use_mpu_process_groups`` returns; see :func:`check_mpu_groups`) and
refuses other groups by name. Upstream's generalized-TP rematerialization and all-gather groups (``gtp_remat``,
``expt_gtp_remat``, ``dp_cp_ag``, ``expt_dp_ag``) are None here (not supported; ``*_gtp_remat`` data-parallel groups
are the plain ones).
"""
import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from megatron.core import parallel_state as ps

_PG = Optional[torch.distributed.ProcessGroup]

# field -> (parallel_state getter, keyword arguments); None: always None in this fork
_MPU_GETTERS = {
    "tp": ("get_tensor_model_parallel_group", {"check_initialized": False}),
    "pp": ("get_pipeline_model_parallel_group", {"check_initialized": False}),
    "mp": ("get_model_parallel_group", {"check_initialized": False}),
    "embd": ("get_embedding_group", {"check_initialized": False}),
    "pos_embd": ("get_position_embedding_group", {"check_initialized": False}),
    "cp": ("get_context_parallel_group", {"check_initialized": False}),
    "tp_cp": ("get_tensor_and_context_parallel_group", {"check_initialized": False}),
    "hcp": ("get_hierarchical_context_parallel_groups", {"check_initialized": False}),
    "ep": ("get_expert_model_parallel_group", {"check_initialized": False}),
    "expt_tp": ("get_expert_tensor_parallel_group", {"check_initialized": False}),
    "tp_ep": ("get_expert_tensor_and_model_parallel_group", {"check_initialized": False}),
    "tp_ep_pp": ("get_expert_tensor_model_pipeline_parallel_group", {"check_initialized": False}),
    "tp_ep_pp_with_egtp_remat": ("get_expert_tensor_model_pipeline_parallel_group", {"check_initialized": False}),
    "tp_dp_cp": ("get_tensor_and_data_parallel_group", {"check_initialized": False, "with_context_parallel": True}),
    "dp": ("get_data_parallel_group", {}),
    "dp_cp": ("get_data_parallel_group", {"with_context_parallel": True}),
    "dp_cp_gtp_remat": ("get_data_parallel_group", {"with_context_parallel": True}),
    "dp_cp_ag": None,
    "gtp_remat": None,
    "expt_gtp_remat": None,
    "expt_dp": ("get_expert_data_parallel_group", {"check_initialized": False}),
    "expt_dp_gtp_remat": ("get_expert_data_parallel_group", {"check_initialized": False}),
    "expt_dp_ag": None,
    "intra_dp_cp": ("get_data_parallel_group", {"with_context_parallel": True, "partial_data_parallel": True}),
    "intra_expt_dp": ("get_expert_data_parallel_group",
                      {"check_initialized": False, "partial_expert_data_parallel": True}),
    "inter_dist_opt": ("get_inter_distributed_optimizer_instance_group", {"check_initialized": False}),
    "intra_dist_opt": ("get_intra_distributed_optimizer_instance_group", {"check_initialized": False}),
}


@dataclass(init=False, repr=False, eq=False)
class ProcessGroupCollection:
    """Process groups by upstream's field names (tensor, pipeline, model, embedding, context, expert and data
    parallel groups; see the module docstring)."""

    tp: _PG = field(init=False)
    pp: _PG = field(init=False)
    mp: _PG = field(init=False)
    embd: _PG = field(init=False)
    pos_embd: _PG = field(init=False)
    cp: _PG = field(init=False)
    tp_cp: _PG = field(init=False)
    hcp: Optional[List[torch.distributed.ProcessGroup]] = field(init=False)
    ep: _PG = field(init=False)
    expt_tp: _PG = field(init=False)
    tp_ep: _PG = field(init=False)
    tp_ep_pp: _PG = field(init=False)
    tp_ep_pp_with_egtp_remat: _PG = field(init=False)
    tp_dp_cp: _PG = field(init=False)
    dp: _PG = field(init=False)
    dp_cp: _PG = field(init=False)
    dp_cp_gtp_remat: _PG = field(init=False)
    dp_cp_ag: _PG = field(init=False)
    gtp_remat: _PG = field(init=False)
    expt_gtp_remat: _PG = field(init=False)
    expt_dp: _PG = field(init=False)
    expt_dp_gtp_remat: _PG = field(init=False)
    expt_dp_ag: _PG = field(init=False)
    intra_dp_cp: _PG = field(init=False)
    intra_expt_dp: _PG = field(init=False)
    inter_dist_opt: _PG = field(init=False)
    intra_dist_opt: _PG = field(init=False)

    def __init__(self, **kwargs):
        names = _field_names()
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise ValueError(f"ProcessGroupCollection: unknown process group(s) {unknown}; known: {sorted(names)}")
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __getattr__(self, name: str):  # a declared field that was not given reads as None (upstream's rule)
        if name in _field_names():
            return None
        raise AttributeError(f"'ProcessGroupCollection' object has no attribute '{name}'")

    def __repr__(self) -> str:
        shown = []
        for name in _field_names():
            pg = vars(self).get(name)
            if pg is not None:
                shown.append(f"{name}({[g.size() for g in pg] if isinstance(pg, list) else pg.size()})")
        return f"ProcessGroupCollection({', '.join(shown) or 'empty'})"

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: Optional[List[str]] = None) -> "ProcessGroupCollection":
        """The groups of ``parallel_state`` (all fields, or those in ``required_pgs``; an unknown name raises)."""
        names = _field_names()
        required = list(names) if required_pgs is None else list(required_pgs)
        invalid = [n for n in required if n not in names]
        if invalid:
            raise ValueError(f"Invalid process groups requested: {invalid}")
        return cls(**{n: _mpu_group(n) for n in required})


def _field_names() -> List[str]:
    return [f.name for f in dataclasses.fields(ProcessGroupCollection)]


def _mpu_group(name: str):
    spec = _MPU_GETTERS[name]
    if spec is None:
        return None
    getter, kwargs = spec
    return getattr(ps, getter)(**kwargs)


def _same_group(a, b) -> bool:
    if a is None or b is None:
        return a is b or (a is None and b is not None and b.size() == 1) or (b is None and a.size() == 1)
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(_same_group, a, b))
    if a is b:
        return True
    if not torch.distributed.is_initialized():
        return False
    return torch.distributed.get_process_group_ranks(a) == torch.distributed.get_process_group_ranks(b)


def check_mpu_groups(pg_collection, owner: str, names=None) -> None:
    """Accept ``pg_collection`` (None, or a collection whose groups, those set among ``names`` or all, hold the same
    ranks as ``parallel_state``'s); raise naming ``owner`` and the groups that differ otherwise. This fork's layers
    use ``parallel_state``'s groups, so other groups cannot be honoured."""
    if pg_collection is None:
        return
    if not isinstance(pg_collection, ProcessGroupCollection):
        raise TypeError(f"{owner}: pg_collection must be a megatron.core.process_groups_config.ProcessGroupCollection, "
                        f"got {type(pg_collection).__name__}")
    differ = []
    for name in (names or _field_names()):
        given = vars(pg_collection).get(name)
        if given is None:
            continue
        if not _same_group(given, _mpu_group(name)):
            differ.append(name)
    if differ:
        raise ValueError(f"{owner}: pg_collection groups {differ} differ from parallel_state's; this fork's layers use "
                         "the parallel_state groups (ProcessGroupCollection.use_mpu_process_groups())")
