"""Token dispatchers: send each routed token to the rank holding its expert and bring the outputs back.

Experts are split over the expert-model-parallel (EP) group: EP rank ``r`` holds the global experts
``[r * L, (r + 1) * L)`` (``L`` local experts). Both dispatchers return, on every rank, the tokens routed to its local
experts sorted by local expert (``tokens_per_expert`` of length ``L``), and combine the expert outputs weighted by the
router probs (in float32) back into the local tokens' order. Upstream's method names (``dispatch_preprocess``,
``token_dispatch``, ``dispatch_postprocess``, ``combine_preprocess``, ``token_combine``, ``combine_postprocess``) and
the two-call API (``token_permutation`` / ``token_unpermutation``) are provided.

- ``MoEAllGatherTokenDispatcher`` (``--moe-token-dispatcher-type allgather``): all-gather the tokens, probs and
  routing map over the EP group (ranks may hold different token counts), keep the columns of the local
  experts, permute; combine: unpermute into the gathered token rows and reduce-scatter (sum) back to each rank's
  tokens.
- ``MoEAlltoAllTokenDispatcher`` (``alltoall``): permute the local tokens by expert, all-gather the per-expert counts
  over EP, all-to-all the tokens (``input_splits``: tokens for each EP rank, ``output_splits``: tokens from each),
  regroup the received chunks from (source rank, local expert) to (local expert, source rank) order; combine
  reverses every step and unpermutes with the local probs.

Drop-and-pad (``--moe-expert-capacity-factor`` with ``--moe-pad-expert-input-to-capacity``, expert parallel size 1):
every expert gets exactly ``padded_expert_rows(T, E, topk, factor)`` rows, so both dispatchers take the counts from
the routing map's shape (:meth:`MoETokenDispatcher.static_counts`) instead of reading them from the device: the
dispatch makes no device-to-host read and can be captured in a CUDA graph (``--cuda-graph-modules moe``). The rows
and their order are those of the counted path (the same ``permute``); a device-side assert checks that every expert
got its rows.
"""
from typing import List

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import all_to_all, gather_along_first_dim, reduce_scatter_along_first_dim
from megatron.core.transformer.moe.moe_utils import (
    is_drop_and_pad,
    padded_expert_rows,
    permute,
    sort_chunks_by_idxs,
    unpermute,
    use_fused_permutation,
)

DISPATCHER_TYPES = ("allgather", "alltoall")


class MoETokenDispatcher:
    """Common state: local expert indices and the EP group (None before ``initialize_model_parallel``)."""

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config) -> None:
        self.config = config
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        if len(self.local_expert_indices) != num_local_experts:
            raise ValueError(f"{len(self.local_expert_indices)} local expert indices for {num_local_experts} experts")
        self.ep_group = parallel_state.get_expert_model_parallel_group(check_initialized=False)
        self.ep_size = parallel_state.get_expert_model_parallel_world_size()
        self.hidden_shape = None
        # drop-and-pad at EP 1: the counts follow from shapes (with EP > 1 the ranks' token counts may differ)
        self.static = is_drop_and_pad(config) and self.ep_size == 1

    def static_counts(self, routing_map: torch.Tensor) -> List[int]:
        """Drop-and-pad: the rows of each of the routing map's ``[T, E]`` experts (every expert gets its padded
        capacity), from its shape only; checked on the device without a sync."""
        num_tokens, num_experts = routing_map.shape
        rows = padded_expert_rows(num_tokens, num_experts, self.config.moe_router_topk,
                                  self.config.moe_expert_capacity_factor)
        torch._assert_async(routing_map.sum(dim=0).eq(rows).all(),
                            f"drop-and-pad dispatch: an expert does not have its {rows} padded rows "
                            "(--moe-pad-expert-input-to-capacity)")
        return [rows] * num_experts

    # ---- the two-call API --------------------------------------------------------------------------------
    def token_permutation(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """``hidden_states`` ``[..., h]``, ``probs``/``routing_map`` ``[T, E]`` -> ``(tokens for the local experts
        sorted by local expert [N, h], tokens_per_expert [L] (CPU int64), their probs [N])``."""
        hidden_states, probs = self.dispatch_preprocess(hidden_states, routing_map, probs)
        hidden_states, probs = self.token_dispatch(hidden_states, probs)
        return self.dispatch_postprocess(hidden_states, probs)

    def token_unpermutation(self, expert_output: torch.Tensor) -> torch.Tensor:
        """Expert outputs (the order ``token_permutation`` returned) -> the weighted sum per token, shaped like the
        ``hidden_states`` given to ``token_permutation``."""
        return self.combine_postprocess(self.token_combine(self.combine_preprocess(expert_output)))

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.view(self.hidden_shape)


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        return hidden_states.reshape(-1, self.hidden_shape[-1]), probs

    def token_dispatch(self, hidden_states, probs):
        # Over the EP group only: the expert linears do their own tensor-parallel communication (expert TP = TP
        # with EP 1; EP > 1 with TP > 1 is refused), unlike upstream's dispatcher-side TP x EP gather.
        group = self.ep_group
        self.sizes = [hidden_states.shape[0]]
        if group is not None and dist.get_world_size(group) > 1:  # ranks may hold different token counts
            n = torch.tensor([hidden_states.shape[0]], dtype=torch.int64, device=hidden_states.device)
            gathered = [torch.empty_like(n) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, n, group=group)
            self.sizes = torch.cat(gathered).tolist()  # one read for all ranks' sizes
            with torch.no_grad():
                self.routing_map = gather_along_first_dim(group, self.routing_map.to(torch.uint8), self.sizes).bool()
        return gather_along_first_dim(group, hidden_states, self.sizes), gather_along_first_dim(group, probs, self.sizes)

    def dispatch_postprocess(self, hidden_states, probs):
        lo, hi = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.gathered_shape = hidden_states.shape
        local_map = self.routing_map[:, lo:hi]
        if self.static:  # drop-and-pad: from shapes, no read
            counts = self.static_counts(self.routing_map)[lo:hi]
        else:
            counts = local_map.sum(dim=0).tolist()  # the dispatch's one device-to-host read: the row groups
        self.fused = use_fused_permutation(self.config, hidden_states)
        permuted, self.local_probs, self.row_map = permute(hidden_states, local_map, probs[:, lo:hi],
                                                           sum(counts), self.fused)
        self.merging_probs = probs[:, lo:hi] if self.fused else self.local_probs  # fused: TE weights as it sums
        return permuted, torch.tensor(counts, dtype=torch.int64), self.local_probs

    def combine_preprocess(self, hidden_states):
        return unpermute(hidden_states, self.row_map, self.gathered_shape, self.merging_probs, self.fused)

    def token_combine(self, hidden_states):
        return reduce_scatter_along_first_dim(self.ep_group, hidden_states, self.sizes)


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, self.hidden_shape[-1])
        ep, local = self.ep_size, self.num_local_experts
        if self.static:  # drop-and-pad (EP 1): from shapes, no read
            table = [self.static_counts(routing_map)]
        else:
            with torch.no_grad():
                counts = routing_map.sum(dim=0).long()  # [E]: this rank's tokens per (global) expert
                if ep > 1:  # every EP rank's counts, read on the host at once: [source rank][global expert]
                    gathered = [torch.empty_like(counts) for _ in range(ep)]
                    dist.all_gather(gathered, counts, group=self.ep_group)
                    table = torch.stack(gathered).tolist()
                else:
                    table = [counts.tolist()]
        # the one device-to-host read of the dispatch (the all-to-all sizes and the experts' row groups need the
        # counts on the host; none under drop-and-pad); the rest is arithmetic on Python ints
        lo = self.local_expert_indices[0]
        per_local = [row[lo : lo + local] for row in table]  # [ep source rank][local expert]
        mine = table[lo // local] if ep > 1 else table[0]  # this rank's row (EP rank r holds experts r*L .. )
        if ep > 1:
            self.input_splits = [sum(mine[r * local : (r + 1) * local]) for r in range(ep)]
            self.output_splits = [sum(row) for row in per_local]
        self.per_rank_per_local = per_local
        self.tokens_per_expert = [sum(col) for col in zip(*per_local)]
        routed = sum(mine)  # this rank's (token, expert) rows
        self.fused = use_fused_permutation(self.config, hidden_states)
        # fused: TE's unpermute weights by the router's probs [T, E] as it sums (the permuted probs are not needed)
        # top-k routing over all experts: exactly k routes per token (the torch ops then sum without atomics); not
        # with an expert capacity (dropped or padded routes)
        self.routes_per_token = (self.config.moe_router_topk
                                 if getattr(self.config, "moe_expert_capacity_factor", None) is None else None)
        permuted, self.local_probs, self.row_map = permute(hidden_states, routing_map, None if self.fused else probs,
                                                           routed, self.fused, self.routes_per_token)
        self.merging_probs = probs if self.fused else self.local_probs
        return permuted, self.local_probs

    def token_dispatch(self, hidden_states, probs):
        if self.ep_size > 1:
            hidden_states = all_to_all(self.ep_group, hidden_states, self.output_splits, self.input_splits)
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states, probs):
        ep, local = self.ep_size, self.num_local_experts
        if ep > 1 and local > 1:  # (source rank, expert) -> (expert, source rank)
            sizes = [n for row in self.per_rank_per_local for n in row]
            hidden_states = sort_chunks_by_idxs(hidden_states, sizes, [r * local + e for e in range(local)
                                                                       for r in range(ep)])
        # the probs stay on this rank: they weight the outputs after they come back
        return hidden_states, torch.tensor(self.tokens_per_expert, dtype=torch.int64), None

    def combine_preprocess(self, hidden_states):
        ep, local = self.ep_size, self.num_local_experts
        if ep > 1 and local > 1:  # (expert, source rank) -> (source rank, expert)
            sizes = [self.per_rank_per_local[r][e] for e in range(local) for r in range(ep)]
            hidden_states = sort_chunks_by_idxs(hidden_states, sizes, [e * ep + r for r in range(ep)
                                                                       for e in range(local)])
        return hidden_states

    def token_combine(self, hidden_states):
        if self.ep_size > 1:
            hidden_states = all_to_all(self.ep_group, hidden_states, self.input_splits, self.output_splits)
        return unpermute(hidden_states, self.row_map, (self.hidden_shape.numel() // self.hidden_shape[-1],
                                                       self.hidden_shape[-1]), self.merging_probs, self.fused,
                         self.routes_per_token)


def build_token_dispatcher(num_local_experts: int, local_expert_indices: List[int], config) -> MoETokenDispatcher:
    """The dispatcher named by ``config.moe_token_dispatcher_type`` (``--moe-token-dispatcher-type``)."""
    kind = config.moe_token_dispatcher_type
    if kind == "allgather":
        return MoEAllGatherTokenDispatcher(num_local_experts, local_expert_indices, config)
    if kind == "alltoall":
        return MoEAlltoAllTokenDispatcher(num_local_experts, local_expert_indices, config)
    raise ValueError(f"moe_token_dispatcher_type={kind!r} (--moe-token-dispatcher-type) must be one of "
                     f"{DISPATCHER_TYPES}")
