"""MLP: ``fc2(act(fc1(x)))``, or gated (``act(x W1) * (x V)``, e.g. SwiGLU) with ``gated_linear_unit``."""
from typing import Optional

import torch

from megatron.core.transformer.attention import build_linear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import init_method_normal, scaled_init_method_normal


class MLP(MegatronModule):
    def __init__(
        self,
        config,
        ffn_hidden_size: Optional[int] = None,
        is_expert: bool = False,
        input_size: Optional[int] = None,
        fuse_input_layernorm: bool = False,
    ):
        super().__init__(config)
        self.input_size = input_size or config.hidden_size
        self.ffn_hidden_size = ffn_hidden_size or config.ffn_hidden_size
        self.is_expert = is_expert
        fc1_out = 2 * self.ffn_hidden_size if config.gated_linear_unit else self.ffn_hidden_size
        init = init_method_normal(config.init_method_std)
        out_init = scaled_init_method_normal(config.init_method_std, config.num_layers)
        self.linear_fc1 = build_linear(
            config, "layernorm_column" if fuse_input_layernorm else "column", self.input_size, fc1_out,
            init_method=init, bias=config.add_bias_linear, is_expert=is_expert,
        )
        self.linear_fc2 = build_linear(
            config, "row", self.ffn_hidden_size, config.hidden_size, init_method=out_init,
            bias=config.add_bias_linear, is_expert=is_expert, skip_bias_add=True,
        )

    def forward(self, hidden_states: torch.Tensor):
        """Returns ``(output, bias or None)``: the fc2 bias is returned unadded, as upstream."""
        x, _ = self.linear_fc1(hidden_states)
        act = self.config.activation_func
        if self.config.gated_linear_unit:
            x1, x2 = torch.chunk(x, 2, dim=-1)
            x = act(x1) * x2
        else:
            x = act(x)
        return self.linear_fc2(x)
