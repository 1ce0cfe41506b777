"""MoE layer: router -> token dispatcher (to the EP rank of each expert) -> local experts -> combine.

With tensor parallelism the experts' linears are split over the expert tensor-parallel group (= the TP group; other
sizes are refused under EP) and do their own TP communication (column: backward all-reduce, row: forward
all-reduce), so every TP rank must route the SAME tokens. Without sequence parallelism they do: the hidden states
are replicated over TP, and with the default order ``tp-cp-ep-dp-pp`` an EP group holds ranks of one TP rank, so
TP peers dispatch the same tokens to the same experts and their expert-TP all-reduces pair up. With
``--sequence-parallel`` the ``[s / tp, b, h]`` pieces are all-gathered over TP before the router (backward: this
rank's slice of the gradient, which is replicated over TP) and the output split back to ``[s / tp, b, h]`` after
(backward: all-gather), so the layer equals the TP=1 layer. Unlike upstream's dispatcher, which exchanges tokens
over expert-TP x EP; the router then runs on the whole sequence on every TP rank (its grads need no TP reduction).

Shared experts (``--moe-shared-expert-intermediate-size``, ``shared_experts.py``) take the layer's input as it is (a
dense TP MLP: ``[s / tp, b, h]`` pieces with sequence parallelism) and their output is added to the routed output.
"""
from dataclasses import dataclass

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP, TEGroupedMLP, expert_parallel_layout
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import build_token_dispatcher


def build_experts(num_local_experts: int, config):
    """``SequentialMLP``, or with ``moe_grouped_gemm`` (``--moe-grouped-gemm``) ``TEGroupedMLP`` under
    ``--transformer-impl transformer_engine`` and ``GroupedMLP`` (torch) otherwise, as upstream's specs choose."""
    if not config.moe_grouped_gemm:
        return SequentialMLP(num_local_experts, config)
    cls = TEGroupedMLP if config.transformer_impl == "transformer_engine" else GroupedMLP
    return cls(num_local_experts, config)


@dataclass
class MoESubmodules:
    """Upstream's MoE submodule spec; here it records the experts class ``build_experts`` picks (the shared experts
    are a ``SharedExpertMLP`` when ``moe_shared_expert_intermediate_size`` is set)."""

    experts: object = None
    shared_experts: object = None
    router: object = TopKRouter


class MoELayer(MegatronModule):
    def __init__(self, config, layer_number: int = None):
        super().__init__(config)
        if config.num_moe_experts is None:
            raise ValueError("MoELayer needs num_moe_experts (--num-experts)")
        ep, ep_rank, local = expert_parallel_layout(config.num_moe_experts)
        configured = getattr(config, "expert_model_parallel_size", 1)
        if configured != ep:
            raise ValueError(f"expert_model_parallel_size={configured} (--expert-model-parallel-size) differs from "
                             f"the expert model parallel group's size {ep} (parallel_state.initialize_model_parallel)")
        etp = parallel_state.get_expert_tensor_parallel_world_size()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if ep != 1 and etp != tp:  # the EP exchange pairs TP peers only when expert TP = TP (see the docstring)
            raise ValueError(f"expert tensor parallel size {etp} (--expert-tensor-parallel-size) must equal the tensor "
                             f"parallel size {tp} (--tensor-model-parallel-size) with expert model parallel size {ep}")
        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False)) and tp > 1
        self.layer_number = layer_number
        self.expert_parallel_size = ep
        self.num_local_experts = local
        self.local_expert_indices = [ep_rank * local + i for i in range(local)]
        self.router = TopKRouter(config, layer_number)
        self.experts = build_experts(self.num_local_experts, config)
        self.token_dispatcher = build_token_dispatcher(local, self.local_expert_indices, config)
        self.use_shared_expert = config.moe_shared_expert_intermediate_size is not None
        self.shared_experts = SharedExpertMLP(config) if self.use_shared_expert else None

    def forward(self, hidden_states: torch.Tensor):
        """``hidden_states`` ``[s, b, h]`` (``[s / tp, b, h]`` with sequence parallelism) -> ``(output shaped like
        hidden_states, None)``."""
        return self.dispatch_and_combine(*self.route(hidden_states))

    def route(self, hidden_states: torch.Tensor):
        """The shared experts and the router (what ``--cuda-graph-modules moe_router`` graphs): -> ``(hidden_states``
        (gathered over TP with sequence parallelism), ``probs [T, E], routing_map [T, E], shared_output`` or None)."""
        shared_output = self.shared_experts(hidden_states) if self.shared_experts is not None else None
        if self.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        probs, routing_map = self.router(hidden_states)  # [T, E] over ALL experts, this rank's tokens
        return hidden_states, probs, routing_map, shared_output

    def dispatch_and_combine(self, hidden_states, probs, routing_map, shared_output=None):
        """Token dispatch, the experts, the combine (and the shared experts' output added): ``(output, None)``."""
        tokens, tokens_per_expert, permuted_probs = self.token_dispatcher.token_permutation(
            hidden_states, probs, routing_map)
        expert_out, _ = self.experts(tokens, tokens_per_expert, permuted_probs)
        output = self.token_dispatcher.token_unpermutation(expert_out)
        if self.sequence_parallel:
            output = scatter_to_sequence_parallel_region(output)
        if shared_output is not None:
            output = output + shared_output
        return output, None
