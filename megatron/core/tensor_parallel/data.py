"""``broadcast_data`` (upstream's name and signature; upstream's ``pretrain_gpt.get_batch`` style code calls it): the
first rank of the tensor-parallel group holds a batch, every rank of the group gets it.

Shapes go first (one int64 tensor: per key its rank and dims), then the values of every key as one flat tensor of
``datatype``; the result is ``{key: tensor}`` on the default device (CUDA when available, else the CPU) on every
rank. A key whose tensor is not ``datatype`` on the source rank is refused by name."""
from typing import Dict, Hashable, List

import torch
import torch.distributed as dist

from megatron.core.dist_utils import default_device, get_rank, get_world_size
from megatron.core.tensor_parallel.utils import get_tensor_model_parallel_group_if_none


def broadcast_data(keys: List[Hashable], data: Dict, datatype: torch.dtype, tp_group=None) -> Dict:
    """``{key: data[key]}`` from the tensor-parallel group's first rank on every rank of ``tp_group`` (default:
    parallel_state's tensor-parallel group). Only the source rank's ``data`` is read."""
    group = get_tensor_model_parallel_group_if_none(tp_group)
    device = default_device()
    source = get_rank(group) == 0
    if source:
        for key in keys:
            if data[key].dtype != datatype:
                raise TypeError(f"broadcast_data: key {key!r} has data type {data[key].dtype}, not {datatype}")
    if get_world_size(group) == 1:
        return {key: data[key].to(device) for key in keys}
    src = dist.get_global_rank(group, 0)
    if source:
        header = [v for key in keys for v in (data[key].dim(), *data[key].shape)]
        meta = torch.tensor([len(header), *header], dtype=torch.int64, device=device)
        length = torch.tensor([meta.numel()], dtype=torch.int64, device=device)
    else:
        length = torch.empty(1, dtype=torch.int64, device=device)
    dist.broadcast(length, src, group=group)
    if not source:
        meta = torch.empty(int(length.item()), dtype=torch.int64, device=device)
    dist.broadcast(meta, src, group=group)
    shapes, pos = [], 1
    for _ in keys:
        ndim = int(meta[pos])
        shapes.append(tuple(int(v) for v in meta[pos + 1:pos + 1 + ndim]))
        pos += 1 + ndim
    numels = [int(torch.Size(s).numel()) for s in shapes]
    if source:
        flat = torch.cat([data[key].to(device).contiguous().view(-1) for key in keys])
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    dist.broadcast(flat, src, group=group)
    return {key: piece.view(shape) for key, piece, shape in zip(keys, flat.split(numels), shapes)}
