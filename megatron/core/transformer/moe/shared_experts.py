"""Shared experts (``--moe-shared-expert-intermediate-size``): a dense MLP that every token goes through, its output
added to the routed experts' output, at upstream's location and with upstream's checkpoint keys
(``mlp.shared_experts.linear_fc1.weight`` / ``linear_fc2.weight``, split over TP like a dense MLP's; a gated
``linear_fc1`` in upstream's two chunks; ``mlp.shared_experts.gate_weight`` replicated).

``--moe-shared-expert-gate``: the output is scaled per token by ``sigmoid(x . gate_weight)`` (``gate_weight``
``[1, hidden]``). ``--moe-shared-expert-overlap`` is accepted and computes the same values: upstream runs the shared
experts on a side CUDA stream during the token dispatch; here they run before the routed experts, un-overlapped.
"""
from typing import Optional

import torch

from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.utils import config_init_method, set_param_attrs


class SharedExpertMLP(MLP):
    """``MLP`` of hidden size ``config.moe_shared_expert_intermediate_size`` (TP-split column / row linears, which
    handle sequence parallelism themselves: the input and output are ``[s / tp, b, h]`` then). ``forward`` returns
    the output tensor only (no bias: shared experts need ``add_bias_linear=False``, as upstream)."""

    def __init__(self, config, submodules=None, gate: Optional[bool] = None, pg_collection=None, name=None):
        if config.moe_shared_expert_intermediate_size is None:
            raise ValueError("SharedExpertMLP needs moe_shared_expert_intermediate_size "
                             "(--moe-shared-expert-intermediate-size)")
        if config.add_bias_linear:
            raise ValueError("shared experts have no biases: give --disable-bias-linear (add_bias_linear=False)")
        super().__init__(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size)
        self.use_shared_expert_gate = config.moe_shared_expert_gate if gate is None else bool(gate)
        if self.use_shared_expert_gate:
            self.gate_weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype))
            # replicated over TP; with sequence parallelism each TP rank sees s / tp tokens: grads summed over TP
            set_param_attrs((self.gate_weight,), allreduce=True,
                            sequence_parallel=bool(getattr(config, "sequence_parallel", False)))
        else:
            self.gate_weight = None

    def reset_parameters(self) -> None:
        """Initialises ``gate_weight`` (the linears initialise themselves), normal(0, init_method_std) as upstream."""
        if self.gate_weight is not None and self.config.perform_initialization:
            with torch.no_grad():
                config_init_method(self.config)(self.gate_weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output, _ = super().forward(hidden_states)
        if self.gate_weight is not None:
            output = output * torch.sigmoid(torch.nn.functional.linear(hidden_states, self.gate_weight))
        return output
