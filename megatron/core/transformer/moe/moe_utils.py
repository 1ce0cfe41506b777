"""MoE helpers: the expert-bias arithmetic (aux-loss-free load balancing) and the switch aux loss. The training
loop's expert-bias step over a model's routers is ``moe/expert_bias.py``."""
from typing import Optional

import torch


def get_updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, update_rate: float):
    """``expert_bias + rate * sign(mean(tokens) - tokens)`` (per row): overloaded experts go down, underloaded up."""
    counts = tokens_per_expert.float()
    mean = counts.mean(dim=-1, keepdim=True)
    return expert_bias + update_rate * torch.sign(mean - counts)


def switch_load_balancing_loss_func(
    scores: torch.Tensor, tokens_per_expert: torch.Tensor, num_tokens: int, topk: int, num_experts: int, coeff: float
) -> torch.Tensor:
    """Switch-transformer aux loss: ``coeff * E * sum_e f_e * P_e`` with ``f_e`` the fraction of routed
    assignments that went to expert ``e`` and ``P_e`` its mean score over tokens."""
    f = tokens_per_expert.float() / (num_tokens * topk)
    p = scores.float().mean(dim=0)
    return coeff * num_experts * torch.sum(f * p)


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``output`` in forward; in backward also sends gradient ``main_loss_backward_scale`` into the
    aux loss, so the aux loss trains the router without being added to the language-model loss."""

    main_loss_backward_scale: torch.Tensor = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        grad_aux = torch.ones_like(aux_loss) if scale is None else torch.ones_like(aux_loss) * scale
        return grad_output, grad_aux

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """Scale of the aux-loss gradient (e.g. 1 / num_microbatches, or the fp16 loss scale)."""
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale


# ---- token permutation ------------------------------------------------------------------------------------
def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: Optional[torch.Tensor] = None):
    """Sort ``tokens`` ``[T, h]`` by expert: row-major order of ``routing_map.T`` (``[E, T]``), i.e. by expert,
    then by token index. Returns ``(permuted [N, h], permuted_probs [N] or None, sorted_indices [N])``,
    ``N = routing_map.sum()``; ``sorted_indices[i]`` is the token of row ``i``."""
    mask = routing_map.t()
    sorted_indices = torch.arange(tokens.shape[0], device=tokens.device).unsqueeze(0).expand_as(mask)[mask]
    permuted_probs = None if probs is None else probs.t()[mask]
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def unpermute(permuted: torch.Tensor, sorted_indices: torch.Tensor, restore_shape, probs=None) -> torch.Tensor:
    """Inverse of :func:`permute`: each row, weighted by its prob (in float32) when ``probs`` is given, is summed
    into its token's row of a zero ``restore_shape`` tensor."""
    if probs is not None:
        permuted = (permuted.float() * probs.unsqueeze(-1)).to(permuted.dtype)
    out = permuted.new_zeros(restore_shape)
    return out.index_add_(0, sorted_indices, permuted)


def sort_chunks_by_idxs(x: torch.Tensor, split_sizes, sorted_idxs) -> torch.Tensor:
    """Split ``x`` on dim 0 into chunks of ``split_sizes`` and concatenate them in the order ``sorted_idxs``."""
    chunks = torch.split(x, [int(s) for s in split_sizes], dim=0)
    return torch.cat([chunks[int(i)] for i in sorted_idxs], dim=0)
