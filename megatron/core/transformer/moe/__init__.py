"""Mixture of experts: top-k router with expert bias, sequential experts split over expert-parallel ranks,
all-gather and all-to-all token dispatchers."""
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.expert_bias import update_expert_bias
from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias
from megatron.core.transformer.moe.router import TopKRouter, topk_routing_with_score_function
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher

__all__ = [
    "MoEAllGatherTokenDispatcher",
    "MoEAlltoAllTokenDispatcher",
    "MoELayer",
    "SequentialMLP",
    "TopKRouter",
    "get_updated_expert_bias",
    "topk_routing_with_score_function",
    "update_expert_bias",
]
