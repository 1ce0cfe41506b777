"""The experts of a MoE layer, applied to tokens already sorted by expert: a list of MLPs (``SequentialMLP``), or
with ``--moe-grouped-gemm`` one grouped linear per projection for all local experts (``GroupedMLP``: torch's grouped
matmul or a loop, ``--transformer-impl local``; ``TEGroupedMLP``: Transformer Engine's ``GroupedLinear``, one kernel
for all local experts, FP8/FP4 and quantized primary weights included). Both write upstream's checkpoint layout, so
a checkpoint saved with one loads into the other, at any expert and tensor parallel size.

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
from megatron.core.tensor_parallel.random import should_recompute
from megatron.core.transformer.mlp import MLP, activation_then_fc2
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (
    _sharded_leaves,
    config_init_method,
    replace_prefix_for_sharding,
)

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


class _ExpertsBase(MegatronModule):
    """The expert-parallel layout shared by the expert implementations, and their checkpoint replicas."""

    def __init__(self, num_local_experts: int, config):
        super().__init__(config)
        self.num_local_experts = num_local_experts
        self.ep_size = parallel_state.get_expert_model_parallel_world_size()
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        self.local_expert_offset = self.ep_rank * num_local_experts

    @staticmethod
    def _expert_config(config):
        """MoELayer gathers the sequence: the experts see all tokens (no sequence parallelism inside them)."""
        if getattr(config, "sequence_parallel", False):
            return dataclasses.replace(config, sequence_parallel=False)
        return config

    @property
    def local_expert_indices(self) -> List[int]:
        return [self.local_expert_offset + i for i in range(self.num_local_experts)]

    def _token_counts(self, hidden_states: torch.Tensor, tokens_per_expert) -> List[int]:
        counts = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) else list(tokens_per_expert)
        if len(counts) != self.num_local_experts or sum(counts) != hidden_states.shape[0]:
            raise ValueError(f"tokens_per_expert {counts} does not match {self.num_local_experts} local experts and "
                             f"{hidden_states.shape[0]} tokens")
        return counts

    @staticmethod
    def _expert_shards(sd: dict) -> dict:
        """``sd`` with replicas over the expert-data-parallel ranks (``replica_id=(0, 0, expert_dp_rank)``; a
        Megatron-FSDP shard keeps its own replica id 0)."""
        dense_replica = (0, 0, parallel_state.get_data_parallel_rank(with_context_parallel=True))
        expert_replica = (0, 0, parallel_state.get_expert_data_parallel_rank())
        for sh in _sharded_leaves(sd):
            if sh.replica_id == dense_replica:
                sh.replica_id = expert_replica
        return sd

    def _expert_offsets(self, expert: int, sharded_offsets) -> tuple:
        """``sharded_offsets`` plus local expert ``expert``'s axis: the GLOBAL index ``ep_rank * L + expert`` of
        ``num_experts`` (upstream's layout: one more prepended axis)."""
        axis = len(tuple(sharded_offsets))
        return (*sharded_offsets, (axis, self.local_expert_offset + expert, self.num_local_experts * self.ep_size))


class SequentialMLP(_ExpertsBase):
    def __init__(self, num_local_experts: int, config):
        super().__init__(num_local_experts, config)
        config = self._expert_config(config)
        self.local_experts = torch.nn.ModuleList(
            [MLP(config, ffn_hidden_size=config.moe_ffn_hidden_size, is_expert=True) for _ in range(num_local_experts)]
        )
        if self.ep_size > 1:
            self._rng_tail = _RngTail(self.local_experts[0], (self.ep_size - 1 - self.ep_rank) * num_local_experts)

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
        for i, expert in enumerate(self.local_experts):
            sd_prefix = f"{prefix}local_experts.{i}."
            sd = expert.sharded_state_dict(sd_prefix, self._expert_offsets(i, sharded_offsets), metadata)
            replace_prefix_for_sharding(sd, sd_prefix, f"{prefix}experts.")
            out.update(self._expert_shards(sd))
        return out

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert, permuted_probs=None):
        """``permuted_local_hidden_states`` ``[N, h]`` sorted by local expert, ``tokens_per_expert`` counts (sum N).
        Returns ``(output [N, h], None)``; each expert's fc2 bias is added here (the dispatcher applies the probs,
        ``permuted_probs`` is accepted for upstream's signature and not used)."""
        counts = self._token_counts(permuted_local_hidden_states, tokens_per_expert)
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


class GroupedMLP(_ExpertsBase):
    """``--moe-grouped-gemm`` experts: ``linear_fc1`` / ``linear_fc2`` each hold all local experts' weights
    (``weight<i>``: local expert ``i``) and run them in one grouped GEMM. Without Transformer Engine the grouped linears
    of ``grouped_gemm_util`` (torch's grouped matmul, else a loop); ``TEGroupedMLP`` uses TE's ``GroupedLinear``.
    Same math as ``SequentialMLP`` (each expert's fc2 bias added to its rows; the dispatcher applies the probs) and
    the same checkpoint keys (see ``sharded_state_dict``)."""

    def __init__(self, num_local_experts: int, config):
        super().__init__(num_local_experts, config)
        config = self._expert_config(config)
        column, row = self._linear_classes()
        ffn = config.moe_ffn_hidden_size
        common = dict(config=config, bias=config.add_bias_linear, skip_bias_add=False, is_expert=True)
        self.linear_fc1 = column(num_local_experts, config.hidden_size, 2 * ffn if config.gated_linear_unit else ffn,
                                 init_method=config_init_method(config), **common)
        self.linear_fc2 = row(num_local_experts, ffn, config.hidden_size,
                              init_method=config_init_method(config, "output_layer_init_method"),
                              **common)

    @staticmethod
    def _linear_classes():
        from megatron.core.transformer.moe.grouped_gemm_util import (
            ColumnParallelGroupedLinear,
            RowParallelGroupedLinear,
        )

        return ColumnParallelGroupedLinear, RowParallelGroupedLinear

    def _expert_state(self, linear, i: int) -> dict:
        """Local expert ``i``'s entries of a grouped linear, under a plain linear's names."""
        sd = {"weight": getattr(linear, f"weight{i}")}
        if linear.use_bias:
            sd["bias"] = getattr(linear, f"bias{i}")
        sd[torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX] = self._expert_extra_state(linear, i)
        return sd

    def _expert_extra_state(self, linear, i: int):
        return None  # a local linear has no extra state (upstream's local linears write None too)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Upstream's layout, the same as ``SequentialMLP``'s: local expert ``i``'s fc1/fc2 weight, bias and
        ``_extra_state`` under ``experts.linear_fc{1,2}.<name>`` with the global expert axis (a gated fc1 in two
        chunks); dict keys are the state-dict names ``linear_fc1.weight<i>`` (``_extra_state``,
        ``_extra_state<i>`` for i > 0, as upstream's TEGroupedLinear)."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = {}
        axis_maps = {"linear_fc1": {"weight": 0, "bias": 0}, "linear_fc2": {"weight": 1}}
        for i in range(self.num_local_experts):
            offsets = self._expert_offsets(i, sharded_offsets)
            for name, axis_map in axis_maps.items():
                linear = getattr(self, name)
                sd = make_sharded_tensors_for_checkpoint(self._expert_state(linear, i), f"{prefix}experts.{name}.",
                                                         axis_map, offsets, tp_group=linear.tp_group)
                if name == "linear_fc1" and self.config.gated_linear_unit:
                    for key in ("weight", "bias"):
                        full = f"{prefix}experts.{name}.{key}"
                        if full in sd:
                            sd[full] = apply_swiglu_sharded_factory(sd[full], offsets, linear.tp_rank, linear.tp_size)
                self._expert_shards(sd)
                for key, sh in sd.items():
                    entry = key.rsplit(".", 1)[1]
                    if entry == torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX:
                        out[f"{prefix}{name}.{entry}{i or ''}"] = sh
                    else:
                        out[f"{prefix}{name}.{entry}{i}"] = sh
        return out

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert, permuted_probs=None):
        """As ``SequentialMLP.forward``: ``[N, h]`` sorted by local expert -> ``(output [N, h], None)``."""
        x = permuted_local_hidden_states
        counts = self._token_counts(x, tokens_per_expert)
        quantized = bool(getattr(self.config, "fp8", None) or getattr(self.config, "fp4", None))
        if quantized:  # FP8/FP4 GEMM shapes: each expert's rows zero-padded, the padded rows dropped after
            chunks = [pad_rows(c, QUANTIZED_ROW_ALIGN) for c in torch.split(x, counts, dim=0)]
            padded = [c.shape[0] for c in chunks]
            x = torch.cat(chunks, dim=0)
        else:
            padded = counts
        h, _ = self.linear_fc1(x, padded)
        out, _ = activation_then_fc2(self.config, h, lambda a: self.linear_fc2(a, padded),
                                     should_recompute(self.config, "moe_act"))
        if quantized:
            out = torch.cat([o[:n] for o, n in zip(torch.split(out, padded, dim=0), counts)], dim=0)
        return out, None


class TEGroupedMLP(GroupedMLP):
    """``GroupedMLP`` on Transformer Engine's ``GroupedLinear`` (``--transformer-impl transformer_engine``): one
    kernel for all local experts; FP8/FP4 autocast and quantized primary weights (``--fp8-param-gather``) as TE's
    other layers. Each expert's FP8 extra state is written as its own ``_extra_state`` (TE keeps one for all
    experts: split on save, merged on load), so it interchanges with ``SequentialMLP``'s."""

    @staticmethod
    def _linear_classes():
        from megatron.core.tensor_parallel.te_layers import (
            TEColumnParallelGroupedLinear,
            TERowParallelGroupedLinear,
            check_te_available,
        )

        check_te_available()
        return TEColumnParallelGroupedLinear, TERowParallelGroupedLinear

    def _expert_extra_state(self, linear, i: int):
        return linear.expert_extra_state(i)
