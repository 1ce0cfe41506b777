"""Process groups. This fork has data parallelism only (tensor/pipeline/expert model parallel sizes are 1).

Before ``initialize_model_parallel`` is called, the data-parallel group is the default (WORLD) group, or a single
process when torch.distributed is not initialised, so single-process code needs no set-up.
"""
from typing import Optional

import torch
import torch.distributed as dist

_DATA_PARALLEL_GROUP = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
) -> None:
    """Create the data-parallel group (all ranks). Model-parallel sizes other than 1 are not supported."""
    global _DATA_PARALLEL_GROUP
    for name, size in (
        ("--tensor-model-parallel-size", tensor_model_parallel_size),
        ("--pipeline-model-parallel-size", pipeline_model_parallel_size),
        ("--expert-model-parallel-size", expert_model_parallel_size),
    ):
        if size != 1:
            raise ValueError(f"{name}={size}: this fork supports data parallelism only (size 1)")
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed to be initialised first")
    _DATA_PARALLEL_GROUP = dist.new_group(list(range(dist.get_world_size())))


def model_parallel_is_initialized() -> bool:
    return _DATA_PARALLEL_GROUP is not None


def destroy_model_parallel() -> None:
    global _DATA_PARALLEL_GROUP
    _DATA_PARALLEL_GROUP = None


def get_data_parallel_group(with_context_parallel: bool = False) -> Optional[dist.ProcessGroup]:
    """The data-parallel group; the WORLD group before initialisation; None without torch.distributed."""
    if _DATA_PARALLEL_GROUP is not None:
        return _DATA_PARALLEL_GROUP
    return dist.group.WORLD if dist.is_initialized() else None


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    group = get_data_parallel_group()
    return dist.get_world_size(group) if group is not None else 1


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    group = get_data_parallel_group()
    return dist.get_rank(group) if group is not None else 0


def get_tensor_model_parallel_world_size() -> int:
    return 1


def get_tensor_model_parallel_rank() -> int:
    return 0


def get_pipeline_model_parallel_world_size() -> int:
    return 1


def get_pipeline_model_parallel_rank() -> int:
    return 0


def get_expert_model_parallel_world_size() -> int:
    return 1


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where tensors for collectives on ``group`` live: the current GPU under NCCL (it takes no CPU tensors), else
    the CPU (gloo)."""
    if "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
