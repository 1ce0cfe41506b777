"""finalize_model_grads: what the training loop calls after the backward passes of a step."""
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state


def finalize_model_grads(model: List[torch.nn.Module], num_tokens: Optional[torch.Tensor] = None, **unused):
    """Finish the data-parallel gradient reduction of every model chunk (``finish_grad_sync``).

    ``num_tokens`` (per-token loss mode, upstream's ``--calculate-per-token-loss``): this rank's token count for a
    SUMMED loss. It is summed over the data-parallel group and the (rank-averaged) gradients are multiplied by
    ``dp_size / num_tokens``, so they equal d(sum of all ranks' losses)/d(param) / total tokens.
    """
    if isinstance(model, torch.nn.Module):
        model = [model]
    for chunk in model:
        chunk.finish_grad_sync()
    if num_tokens is not None:
        total = num_tokens.detach().clone().float().reshape(1)
        group = parallel_state.get_data_parallel_group()
        ws = 1
        if group is not None and dist.is_initialized():
            ws = dist.get_world_size(group)
            if ws > 1:
                dist.all_reduce(total, group=group)
        scale = ws / max(float(total.item()), 1.0)
        for chunk in model:
            chunk.scale_gradients(scale)
