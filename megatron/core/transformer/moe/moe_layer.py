"""MoE layer: router -> token dispatcher (to the EP rank of each expert) -> local experts -> combine."""
import torch

from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP, expert_parallel_layout
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import build_token_dispatcher


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
        if etp != 1 and ep != 1:  # TP alone: every TP rank routes the same tokens, the experts' linears split them
            raise ValueError(f"expert tensor parallel size {etp} with expert model parallel size {ep} is not "
                             "supported yet: use --tensor-model-parallel-size 1 with --expert-model-parallel-size")
        self.layer_number = layer_number
        self.expert_parallel_size = ep
        self.num_local_experts = local
        self.local_expert_indices = [ep_rank * local + i for i in range(local)]
        self.router = TopKRouter(config, layer_number)
        self.experts = SequentialMLP(self.num_local_experts, config)
        self.token_dispatcher = build_token_dispatcher(local, self.local_expert_indices, config)

    def forward(self, hidden_states: torch.Tensor):
        """``hidden_states`` ``[s, b, h]`` -> ``(output [s, b, h], None)``."""
        probs, routing_map = self.router(hidden_states)  # [T, E] over ALL experts, this rank's tokens
        tokens, tokens_per_expert, permuted_probs = self.token_dispatcher.token_permutation(
            hidden_states, probs, routing_map)
        expert_out, _ = self.experts(tokens, tokens_per_expert, permuted_probs)
        return self.token_dispatcher.token_unpermutation(expert_out), None
