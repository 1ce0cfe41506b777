"""Upstream's general helpers that callers of megatron-core use: version checks and process-group rank/size.

Upstream's sharded-tensor builders are importable from here too; they live in
``megatron/core/tensor_parallel/sharded_tensors.py``, below the layers that use them.
"""
from typing import Optional

import torch
from packaging.version import Version as PkgVersion

from megatron.core.tensor_parallel.sharded_tensors import (  # noqa: F401 (re-exported, as upstream)
    make_sharded_tensor_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)
from megatron.core.tensor_parallel.utils import get_tensor_model_parallel_group_if_none  # noqa: F401 (upstream's path)

_te_version: Optional[PkgVersion] = None
_torch_version: Optional[PkgVersion] = None


def get_te_version() -> PkgVersion:
    """Transformer Engine's version (``0.0.0`` when it is not installed); cached."""
    global _te_version
    if _te_version is None:
        from megatron.core.extensions.transformer_engine import te_version_string

        _te_version = PkgVersion(te_version_string())
    return _te_version


def is_te_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether TE is at least ``version`` (strictly newer with ``check_equality=False``)."""
    return get_te_version() >= PkgVersion(version) if check_equality else get_te_version() > PkgVersion(version)


def get_torch_version() -> PkgVersion:
    """torch's version (a local part such as ``+cpu`` is kept, as upstream; cached)."""
    global _torch_version
    if _torch_version is None:
        _torch_version = PkgVersion(torch.__version__)
    return _torch_version


def is_torch_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether torch is at least ``version`` (strictly newer with ``check_equality=False``)."""
    return get_torch_version() >= PkgVersion(version) if check_equality else get_torch_version() > PkgVersion(version)


def get_pg_size(group=None) -> int:
    """``group.size()``; 1 when torch.distributed is not initialized or ``group`` is None (upstream's rule)."""
    if not torch.distributed.is_initialized() or group is None:
        return 1
    return group.size()


def get_pg_rank(group=None) -> int:
    """``group.rank()``; 0 when torch.distributed is not initialized or ``group`` is None (upstream's rule)."""
    if not torch.distributed.is_initialized() or group is None:
        return 0
    return group.rank()


def get_pg_src_rank(group=None) -> int:
    """The global rank of ``group``'s first rank (0 without distributed or group)."""
    if not torch.distributed.is_initialized() or group is None:
        return 0
    return torch.distributed.get_global_rank(group, 0)


def unwrap_model(model, module_instances=None):
    """The model below its wrappers: while a module is an instance of ``module_instances`` (default: megatron's
    ``DistributedDataParallel`` and ``FullyShardedDataParallel``, ``Float16Module``, torch's DDP / FSDP), take its
    ``.module``. A list gives a list."""
    if module_instances is None:
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.nn.parallel import DistributedDataParallel as TorchDDP

        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel
        from megatron.core.transformer.module import Float16Module

        module_instances = (DistributedDataParallel, FullyShardedDataParallel, Float16Module, TorchDDP, TorchFSDP)
    models = model if isinstance(model, list) else [model]
    unwrapped = []
    for module in models:
        while isinstance(module, module_instances):
            module = module.module
        unwrapped.append(module)
    return unwrapped if isinstance(model, list) else unwrapped[0]


def get_attr_wrapped_model(model, attr: str, allow_none: bool = True, return_model_obj: bool = False):
    """``attr`` of ``model`` or of the first module down its ``.module`` chain (DDP / FSDP / Float16Module) that has
    it; ``return_model_obj``: that module instead."""
    from megatron.core.pipeline_parallel.schedules import get_attr_wrapped_model as _get

    return _get(model, attr, allow_none=allow_none, return_model_obj=return_model_obj)


def get_model_config(model):
    """The ``TransformerConfig`` of a (wrapped) model chunk: the first ``config`` down its ``.module`` chain."""
    return get_attr_wrapped_model(model, "config", allow_none=False)
