"""Experts as a list of MLPs (``SequentialMLP``), applied to tokens already sorted by expert."""
import torch

from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import replace_prefix_for_sharding

# FP8/FP4 GEMMs (Transformer Engine) need the token dimension to be a multiple of 8 to 32, depending on the recipe;
# under --fp8-format / --fp4-format each expert's tokens are zero-padded to this and the padded rows dropped.
QUANTIZED_ROW_ALIGN = 32


def pad_rows(x: torch.Tensor, align: int) -> torch.Tensor:
    """``x`` with zero rows appended up to a (non-zero) multiple of ``align`` rows."""
    target = max(align, -(-x.shape[0] // align) * align)
    if target == x.shape[0]:
        return x
    return torch.cat([x, x.new_zeros(target - x.shape[0], *x.shape[1:])], dim=0)


class SequentialMLP(MegatronModule):
    def __init__(self, num_local_experts: int, config):
        super().__init__(config)
        self.num_local_experts = num_local_experts
        self.local_experts = torch.nn.ModuleList(
            [MLP(config, ffn_hidden_size=config.moe_ffn_hidden_size, is_expert=True) for _ in range(num_local_experts)]
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Upstream's layout: expert ``i`` (state-dict prefix ``local_experts.<i>.``) is stored under ``experts.``
        with one more prepended axis, the expert index of ``num_local_experts`` (expert parallel size 1)."""
        out = {}
        axis = len(tuple(sharded_offsets))
        for i, expert in enumerate(self.local_experts):
            sd_prefix = f"{prefix}local_experts.{i}."
            sd = expert.sharded_state_dict(sd_prefix, (*sharded_offsets, (axis, i, self.num_local_experts)), metadata)
            replace_prefix_for_sharding(sd, sd_prefix, f"{prefix}experts.")
            out.update(sd)
        return out

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert):
        """``permuted_local_hidden_states`` ``[N, h]`` sorted by expert, ``tokens_per_expert`` counts (sum N).
        Returns ``(output [N, h], None)``; each expert's fc2 bias is added here."""
        counts = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) else list(tokens_per_expert)
        chunks = torch.split(permuted_local_hidden_states, counts, dim=0)
        quantized = bool(getattr(self.config, "fp8", None) or getattr(self.config, "fp4", None))
        outs = []
        for expert, chunk in zip(self.local_experts, chunks):
            out, bias = expert(pad_rows(chunk, QUANTIZED_ROW_ALIGN) if quantized else chunk)
            out = out[: chunk.shape[0]]  # zero-padded rows (FP8/FP4 GEMM shapes) are dropped
            outs.append(out if bias is None else out + bias)
        if not outs:
            return permuted_local_hidden_states.new_zeros(permuted_local_hidden_states.shape), None
        return torch.cat(outs, dim=0), None
