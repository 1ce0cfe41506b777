"""Experts as a list of MLPs (``SequentialMLP``), applied to tokens already sorted by expert.

Expert parallelism: EP rank ``r`` of ``ep`` holds the global experts ``[r * L, (r + 1) * L)`` (``L`` = num_experts /
ep local experts; ``local_experts.<i>`` is global expert ``r * L + i``).

Initialisation does not depend on the expert parallel size: the global torch RNG is advanced past the draws of the
experts held by lower EP ranks before the local experts are initialised (``SequentialMLP.reset_parameters``, which
the init contract calls before its children's) and past those of higher EP ranks afterwards (a parameterless
``_rng_tail`` child visited after ``local_experts``), so every rank's local experts equal the same experts of an
EP=1 model built with the same seed, and the modules after the experts draw the same numbers too.
"""
import dataclasses
from typing import List

import torch

from megatron.core import parallel_state
from megatron.core.dist_utils import default_device
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import _sharded_leaves, replace_prefix_for_sharding

# FP8/FP4 GEMMs (Transformer Engine) need the token dimension to be a multiple of 8 to 32, depending on the recipe;
# under --fp8-format / --fp4-format each expert's tokens are zero-padded to this and the padded rows dropped.
QUANTIZED_ROW_ALIGN = 32


def pad_rows(x: torch.Tensor, align: int) -> torch.Tensor:
    """``x`` with zero rows appended up to a (non-zero) multiple of ``align`` rows."""
    target = max(align, -(-x.shape[0] // align) * align)
    if target == x.shape[0]:
        return x
    return torch.cat([x, x.new_zeros(target - x.shape[0], *x.shape[1:])], dim=0)


def expert_parallel_layout(num_experts: int):
    """``(ep_size, ep_rank, num_local_experts)`` from ``parallel_state``; ``num_experts`` must divide by ep."""
    ep = parallel_state.get_expert_model_parallel_world_size()
    if num_experts % ep:
        raise ValueError(f"num_moe_experts ({num_experts}, --num-experts) must be divisible by the expert model "
                         f"parallel size ({ep}, --expert-model-parallel-size)")
    return ep, parallel_state.get_expert_model_parallel_rank(), num_experts // ep


@torch.no_grad()
def _skip_init_draws(expert: torch.nn.Module, count: int) -> None:
    """Advance the global RNG by what ``count`` experts shaped like ``expert`` draw in ``reset_parameters`` (each
    local linear draws ``init_method(weight)`` when ``perform_initialization``), into scratch tensors of the same
    shape, dtype and device (a meta weight: the device meta init materialises on)."""
    if count <= 0:
        return
    linears = [m for m in expert.modules() if getattr(m, "init_method", None) is not None
               and isinstance(getattr(m, "weight", None), torch.Tensor)]
    for m in linears:
        if not getattr(m.config, "perform_initialization", True):
            continue
        w = m.weight
        device = default_device() if w.is_meta else w.device
        scratch = torch.empty(w.shape, dtype=w.dtype, device=device)
        for _ in range(count):
            m.init_method(scratch)


class _RngTail(torch.nn.Module):
    """No state; its ``reset_parameters`` (visited after every local expert) skips the higher EP ranks' draws."""

    def __init__(self, template: torch.nn.Module, count: int):
        super().__init__()
        self._template = [template]  # in a list: not a submodule (no second path to it in state_dict / modules)
        self.count = count

    def reset_parameters(self) -> None:
        _skip_init_draws(self._template[0], self.count)


class SequentialMLP(MegatronModule):
    def __init__(self, num_local_experts: int, config):
        super().__init__(config)
        self.num_local_experts = num_local_experts
        self.ep_size = parallel_state.get_expert_model_parallel_world_size()
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        self.local_expert_offset = self.ep_rank * num_local_experts
        if getattr(config, "sequence_parallel", False):  # MoELayer gathers the sequence: the experts see all tokens
            config = dataclasses.replace(config, sequence_parallel=False)
        self.local_experts = torch.nn.ModuleList(
            [MLP(config, ffn_hidden_size=config.moe_ffn_hidden_size, is_expert=True) for _ in range(num_local_experts)]
        )
        if self.ep_size > 1:
            self._rng_tail = _RngTail(self.local_experts[0], (self.ep_size - 1 - self.ep_rank) * num_local_experts)

    @property
    def local_expert_indices(self) -> List[int]:
        return [self.local_expert_offset + i for i in range(self.num_local_experts)]

    def reset_parameters(self) -> None:
        """Skips the lower EP ranks' init draws (see the module docstring); the experts initialise themselves."""
        if self.ep_size > 1:
            _skip_init_draws(self.local_experts[0], self.local_expert_offset)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Upstream's layout: local expert ``i`` (state-dict prefix ``local_experts.<i>.``) is stored under
        ``experts.`` with one more prepended axis, the GLOBAL expert index ``ep_rank * L + i`` of ``num_experts``;
        replicas are the expert-data-parallel ranks (``replica_id=(0, 0, expert_dp_rank)``; a Megatron-FSDP shard
        keeps its own replica id 0)."""
        out = {}
        axis = len(tuple(sharded_offsets))
        total = self.num_local_experts * self.ep_size
        dense_replica = (0, 0, parallel_state.get_data_parallel_rank())
        expert_replica = (0, 0, parallel_state.get_expert_data_parallel_rank())
        for i, expert in enumerate(self.local_experts):
            sd_prefix = f"{prefix}local_experts.{i}."
            offsets = (*sharded_offsets, (axis, self.local_expert_offset + i, total))
            sd = expert.sharded_state_dict(sd_prefix, offsets, metadata)
            replace_prefix_for_sharding(sd, sd_prefix, f"{prefix}experts.")
            for sh in _sharded_leaves(sd):
                if sh.replica_id == dense_replica:
                    sh.replica_id = expert_replica
            out.update(sd)
        return out

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert, permuted_probs=None):
        """``permuted_local_hidden_states`` ``[N, h]`` sorted by local expert, ``tokens_per_expert`` counts (sum N).
        Returns ``(output [N, h], None)``; each expert's fc2 bias is added here (the dispatcher applies the probs,
        ``permuted_probs`` is accepted for upstream's signature and not used)."""
        counts = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) else list(tokens_per_expert)
        if len(counts) != self.num_local_experts or sum(counts) != permuted_local_hidden_states.shape[0]:
            raise ValueError(f"tokens_per_expert {counts} does not match {self.num_local_experts} local experts and "
                             f"{permuted_local_hidden_states.shape[0]} tokens")
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
