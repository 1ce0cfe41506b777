"""A stack of TransformerLayers (``layers``, an nn.ModuleList: the FSDP units) and the final norm."""
import contextlib
from typing import Optional

import torch

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.torch_norm import build_norm
from megatron.core.transformer.transformer_layer import TransformerLayer


class TransformerBlock(MegatronModule):
    def __init__(self, config, post_layer_norm: bool = True, pre_process: bool = True, post_process: bool = True):
        super().__init__(config)
        self.pre_process = pre_process
        self.post_process = post_process
        self.layers = torch.nn.ModuleList([TransformerLayer(config, i + 1) for i in range(config.num_layers)])
        self.has_final_layernorm = post_process and post_layer_norm
        if self.has_final_layernorm:
            self.final_layernorm = build_norm(config, config.hidden_size)

    def _quantization_context(self):
        c = self.config
        if c.transformer_impl == "transformer_engine" and (c.fp8 is not None or c.fp4 is not None):
            from megatron.core.extensions.te_layers import te_quantization_autocast

            return te_quantization_autocast(c)
        return contextlib.nullcontext()

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> torch.Tensor:
        with self._quantization_context():
            for layer in self.layers:
                hidden_states, _ = layer(hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        if self.has_final_layernorm:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
