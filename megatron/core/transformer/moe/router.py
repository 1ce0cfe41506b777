"""Top-k router with optional aux-loss-free load balancing through ``expert_bias``.

``expert_bias`` (float32 zeros, persistent) and ``local_tokens_per_expert`` (float32 zeros, not persistent) are
created with an EXPLICIT device (``default_device()``), so they are real tensors with real values even when the
model is built under ``with torch.device('meta')``. The bias is added to the scores for expert SELECTION only; the
combine weights (probs) come from the unbiased scores, as upstream. ``update_expert_bias`` (moe_utils) updates it.

Auxiliary losses (training with grad only) reach the router through ``MoEAuxLossAutoScaler``, as upstream: the
load-balancing loss (``--moe-aux-loss-coeff``) attached to the probs, the z-loss (``--moe-z-loss-coeff``) to the
logits. Their values without the coefficient go to the log (``load_balancing_loss``, ``z_loss``; moe_utils). The
load-balancing loss counts the plain top-k of the unbiased scores, as upstream, whatever the expert bias, group
limit or token dropping did to the routing.

Context parallelism (upstream's semantics): a CP rank routes its share of each sequence; the expert counts of the
load-balancing losses are summed over the CP group (``moe_utils.sequence_group``) and each rank's loss (and z-loss)
is its share of the whole sequence's, so the ranks' losses add up to the CP=1 loss. The training loop multiplies the
aux-loss gradient by the CP size (``MoEAuxLossAutoScaler``'s scale, as upstream's schedule), since gradients are
averaged over data x context parallel ranks. The expert-bias counts are summed over data x context ranks.

``--moe-router-fusion`` (``moe_router_fusion``): the score function, top-k, expert bias, normalisation and scaling
run in Transformer Engine's ``fused_topk_with_score_function`` where TE is installed and the logits are on CUDA
(:func:`can_fuse_routing`); the torch ops otherwise. The same probs and routing map either way.
"""
from typing import Tuple

import torch

from megatron.core.dist_utils import default_device
from megatron.core.tensor_parallel.random import is_recomputing
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import (
    LOAD_BALANCING_LOSS_NAMES,
    MoEAuxLossAutoScaler,
    RandomSTE,
    apply_router_token_dropping,
    group_size,
    record_moe_loss,
    sequence_group,
    sequence_load_balancing_loss_func,
    switch_load_balancing_loss_func,
    z_loss_func,
)
from megatron.core.transformer.utils import config_init_method, set_param_attrs


def topk_routing_with_score_function(
    logits: torch.Tensor,
    topk: int,
    score_function: str = "softmax",
    expert_bias: torch.Tensor = None,
    use_pre_softmax: bool = False,
    scaling_factor: float = None,
    num_groups: int = None,
    group_topk: int = None,
    fused: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route ``logits`` ``[T, E]`` to ``topk`` experts.

    Returns ``(probs [T, E], routing_map [T, E] bool, scores [T, E])``: ``probs`` holds the combine weight of each
    selected expert (0 elsewhere), ``scores`` the full unbiased score matrix (for the aux loss).
    softmax: scores = softmax(logits); the top-k probs are renormalised over the selected experts (equal to a
    softmax over the top-k logits) unless ``use_pre_softmax``. sigmoid: scores = sigmoid(logits); with topk > 1 the
    top-k probs are normalised to sum 1. ``expert_bias`` is added to the scores for the top-k selection only.

    ``fused`` (``--moe-router-fusion``): where :func:`can_fuse_routing` allows, the routing comes from Transformer
    Engine's ``fused_topk_with_score_function`` (one kernel, its own backward; the same probs and routing map up to
    float rounding) and ``scores`` is None (:func:`compute_scores` gives them where the aux loss needs them).
    """
    logits = logits.float()
    if fused and can_fuse_routing(logits, score_function, expert_bias, use_pre_softmax, num_groups):
        from megatron.core.extensions.transformer_engine import te_fused_topk_with_score_function

        grouped = bool(num_groups)
        probs, routing_map = te_fused_topk_with_score_function(
            logits, topk, use_pre_softmax, num_groups if grouped else None, group_topk if grouped else None,
            scaling_factor, score_function,
            None if expert_bias is None else expert_bias.to(logits.device, torch.float32),
        )
        return probs, routing_map.bool(), None
    scores = compute_scores(logits, score_function)
    for_selection = scores if expert_bias is None else scores + expert_bias.to(scores.device, torch.float32)
    if num_groups:  # group-limited routing: only experts of the token's best group_topk groups are eligible
        for_selection = limit_to_best_groups(for_selection, topk, num_groups, group_topk)
    _, top_indices = torch.topk(for_selection, k=topk, dim=-1)
    top_probs = torch.gather(scores, 1, top_indices)
    if score_function == "softmax" and not use_pre_softmax:
        top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
    elif score_function == "sigmoid" and topk > 1:
        top_probs = top_probs / (top_probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor is not None:
        top_probs = top_probs * scaling_factor
    probs = torch.zeros_like(scores).scatter(1, top_indices, top_probs)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top_indices, True)
    return probs, routing_map, scores


def compute_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """The full score matrix ``[T, E]`` (float32): softmax or sigmoid of the logits."""
    logits = logits.float()
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    if score_function == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"unknown moe_router_score_function {score_function!r} (--moe-router-score-function)")


def te_routing_matches(score_function: str, expert_bias=None, use_pre_softmax: bool = False,
                       num_groups: int = None) -> bool:
    """Whether Transformer Engine's ``fused_topk_with_score_function`` computes this routing as the torch ops here
    do. It does except in two cases, which keep the torch ops: with softmax TE ignores ``expert_bias`` (this router
    adds it to the scores for the selection), and with softmax without ``use_pre_softmax`` it ranks the groups of
    group-limited routing by the logits (this router by the softmax scores)."""
    if score_function == "sigmoid":
        return True
    return score_function == "softmax" and expert_bias is None and (use_pre_softmax or not num_groups)


def can_fuse_routing(logits: torch.Tensor, score_function: str, expert_bias=None, use_pre_softmax: bool = False,
                     num_groups: int = None) -> bool:
    """``--moe-router-fusion`` can run: TE's ``fused_topk_with_score_function`` present, ``logits`` non-empty on
    CUDA, and :func:`te_routing_matches`."""
    from megatron.core.extensions.transformer_engine import te_fused_topk_with_score_function

    if te_fused_topk_with_score_function is None or not logits.is_cuda or logits.numel() == 0:
        return False
    return te_routing_matches(score_function, expert_bias, use_pre_softmax, num_groups)


def limit_to_best_groups(for_selection: torch.Tensor, topk: int, num_groups: int, group_topk: int) -> torch.Tensor:
    """``--moe-router-num-groups G --moe-router-group-topk K`` (DeepSeek's device/node-limited routing): the experts
    ``[T, E]`` form G equal consecutive groups; a group's score is the sum of its best ``topk // K`` selection
    scores; experts outside each token's K best groups get ``-inf`` (never selected)."""
    t, e = for_selection.shape
    grouped = for_selection.view(t, num_groups, e // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    best = group_scores.topk(group_topk, dim=-1).indices
    keep = torch.zeros(t, num_groups, dtype=torch.bool, device=for_selection.device).scatter(1, best, True)
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, e)


class TopKRouter(MegatronModule):
    def __init__(self, config, layer_number: int = None):
        super().__init__(config)
        self.layer_number = layer_number
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.score_function = config.moe_router_score_function
        self.init_method = config_init_method(config)
        self.weight = torch.nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=config.params_dtype))
        set_param_attrs((self.weight,), allreduce=True, sequence_parallel=False)
        self.enable_expert_bias = config.moe_router_enable_expert_bias
        device = default_device()  # explicit: stays real under a meta-device context
        if self.enable_expert_bias:
            self.register_buffer(
                "local_tokens_per_expert",
                torch.zeros(self.num_experts, dtype=torch.float32, device=device),
                persistent=False,
            )
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32, device=device))
        else:
            self.local_tokens_per_expert = None
            self.expert_bias = None
        self.last_aux_loss = None

    def reset_parameters(self) -> None:
        """Initialises ``weight`` only; the buffers keep their values (they are never meta)."""
        if self.config.perform_initialization:
            with torch.no_grad():
                self.init_method(self.weight)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """Router logits ``[T, E]`` in float32."""
        return torch.nn.functional.linear(input.float(), self.weight.float())

    def _adds_aux_losses(self) -> bool:
        return self.training and torch.is_grad_enabled()

    def _attach_aux_loss(self, tensor: torch.Tensor, loss: torch.Tensor, coeff: float, name: str) -> torch.Tensor:
        """``tensor`` unchanged, with ``loss``'s gradient sent in backward; ``loss / coeff`` recorded for the log
        (once per forward: not again when the layer is recomputed). With ``calculate_per_token_loss`` the
        gradients are divided by the global batch's token count, so the loss is multiplied by this rank's tokens
        first (upstream's rule: the aux gradient is then scaled by 1 / (micro-batches x DP), as without it), and
        with context parallelism by the CP size (the global token count holds every CP rank's tokens)."""
        if not is_recomputing():
            record_moe_loss(name, loss / coeff, self.layer_number)
        if self.config.calculate_per_token_loss:
            loss = loss * tensor.shape[0] * group_size(sequence_group())
        return MoEAuxLossAutoScaler.apply(tensor, loss)

    def forward(self, input: torch.Tensor):
        """``input`` ``[..., h]`` -> ``(probs [T, E] float32, routing_map [T, E] bool)``, ``T`` = tokens."""
        x = input.reshape(-1, input.shape[-1])
        logits = self.gating(x)
        if self.config.moe_router_force_load_balancing:
            logits = RandomSTE.apply(logits)
        z_coeff = self.config.moe_z_loss_coeff
        group = sequence_group()  # context parallelism: the ranks holding the rest of these sequences
        cp = group_size(group)
        if z_coeff and self._adds_aux_losses():
            z_loss = z_loss_func(logits, z_coeff) / cp  # this CP rank's share of the mean over the sequence
            logits = self._attach_aux_loss(logits, z_loss, z_coeff, "z_loss")
        probs, routing_map, scores = topk_routing_with_score_function(
            logits,
            self.topk,
            self.score_function,
            expert_bias=self.expert_bias,
            use_pre_softmax=self.config.moe_router_pre_softmax,
            scaling_factor=self.config.moe_router_topk_scaling_factor,
            num_groups=self.config.moe_router_num_groups,
            group_topk=self.config.moe_router_group_topk,
            fused=bool(getattr(self.config, "moe_router_fusion", False)),
        )
        if self.config.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs, routing_map, self.topk, self.config.moe_expert_capacity_factor,
                self.config.moe_token_drop_policy, self.config.moe_pad_expert_input_to_capacity)
        if self.enable_expert_bias and self.training and not is_recomputing():  # counted once per forward
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0).to(self.local_tokens_per_expert)
        coeff, kind = self.config.moe_aux_loss_coeff, self.config.moe_router_load_balancing_type
        if coeff > 0 and kind in LOAD_BALANCING_LOSS_NAMES and self._adds_aux_losses():
            if scores is None:  # the fused routing returns no score matrix
                scores = compute_scores(logits, self.score_function)
            if self.score_function == "sigmoid":
                scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
            # as upstream (compute_routing_scores_for_aux_loss): the loss counts the plain top-k of the unbiased
            # scores, not the routing's choice (expert bias, group-limited selection, token dropping)
            topk_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(
                1, torch.topk(scores, k=self.topk, dim=1).indices, True)
            if kind == "seq_aux_loss":  # input [s, b, h]: per sequence
                if input.dim() != 3:
                    raise ValueError("seq_aux_loss (--moe-router-load-balancing-type) needs the router input [s, b, h]")
                aux_loss = sequence_load_balancing_loss_func(
                    scores, topk_map, input.shape[0], self.topk, self.num_experts, coeff, group
                )
            else:
                counts = topk_map.sum(dim=0).float()
                if cp > 1:  # the expert counts of the whole sequences
                    torch.distributed.all_reduce(counts, group=group)
                aux_loss = switch_load_balancing_loss_func(
                    scores, counts, x.shape[0] * cp, self.topk, self.num_experts, coeff
                )
            self.last_aux_loss = aux_loss.detach()
            probs = self._attach_aux_loss(probs, aux_loss, coeff, LOAD_BALANCING_LOSS_NAMES[kind])
        return probs, routing_map
