"""MoE layer: router -> gather tokens per expert -> experts -> weighted scatter-add back (single rank, no EP)."""
import torch

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter


class MoELayer(MegatronModule):
    def __init__(self, config, layer_number: int = None):
        super().__init__(config)
        if config.num_moe_experts is None:
            raise ValueError("MoELayer needs num_moe_experts (--num-experts)")
        self.layer_number = layer_number
        self.num_local_experts = config.num_moe_experts
        self.router = TopKRouter(config, layer_number)
        self.experts = SequentialMLP(self.num_local_experts, config)

    def forward(self, hidden_states: torch.Tensor):
        """``hidden_states`` ``[s, b, h]`` -> ``(output [s, b, h], None)``."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        probs, routing_map = self.router(x)  # [T, E]
        num_tokens = x.shape[0]
        mask = routing_map.t()  # [E, T]: row-major order = tokens sorted by expert, then token index
        token_indices = torch.arange(num_tokens, device=x.device).unsqueeze(0).expand_as(mask)[mask]
        tokens_per_expert = mask.sum(dim=1)
        permuted = x.index_select(0, token_indices)
        permuted_probs = probs.t()[mask]
        expert_out, _ = self.experts(permuted, tokens_per_expert)
        weighted = (expert_out.float() * permuted_probs.unsqueeze(-1)).to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, token_indices, weighted)
        return out.view(shape), None
