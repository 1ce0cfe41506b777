"""Mixture of experts: top-k router with expert bias, sequential experts, single-rank token dispatch."""
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias, update_expert_bias
from megatron.core.transformer.moe.router import TopKRouter, topk_routing_with_score_function

__all__ = [
    "MoELayer",
    "SequentialMLP",
    "TopKRouter",
    "get_updated_expert_bias",
    "topk_routing_with_score_function",
    "update_expert_bias",
]
