"""Aux-loss-free load balancing: the expert-bias step that the training loop runs after each optimizer step, over
every ``TopKRouter`` of the model (the arithmetic is ``moe_utils.get_updated_expert_bias``)."""
from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_utils import get_world_size
from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias
from megatron.core.transformer.moe.router import TopKRouter


def _routers(model_chunks) -> list:
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    return [
        m
        for chunk in model_chunks
        for m in chunk.modules()
        if isinstance(m, TopKRouter) and m.enable_expert_bias and m.expert_bias is not None
    ]


@torch.no_grad()
def update_expert_bias(
    model_chunks: Union[torch.nn.Module, Iterable[torch.nn.Module]], group: Optional[dist.ProcessGroup] = None
) -> None:
    """Aux-loss-free load balancing step, called by the training loop after each optimizer step.

    For every ``TopKRouter`` with ``expert_bias``: all-reduce ``local_tokens_per_expert`` (summed) over ``group``
    (default: the data x context parallel group: every rank that routes distinct tokens, so the counts are the
    GLOBAL ones whatever the expert parallel size; TP peers route the same tokens here, all of them with sequence
    parallelism (MoELayer gathers the sequence), unlike upstream's tensor x data x context group; nothing without
    torch.distributed), then
    ``expert_bias += moe_router_bias_update_rate * sign(mean - counts)``, then zero the counts.
    """
    routers = _routers(model_chunks)
    if not routers:
        return
    counts = torch.stack([r.local_tokens_per_expert for r in routers])  # one collective for all layers
    if group is None:
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if group is not None and get_world_size(group) > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    for r, c in zip(routers, counts):
        bias = get_updated_expert_bias(c, r.expert_bias, r.config.moe_router_bias_update_rate)
        r.expert_bias.copy_(bias)
        r.local_tokens_per_expert.zero_()
