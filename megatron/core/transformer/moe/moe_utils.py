"""MoE helpers: the expert-bias arithmetic (aux-loss-free load balancing), the switch aux loss and the router
z-loss, and the tracker of their values for the training log (upstream's ``load_balancing_loss`` / ``z_loss``). The
training loop's expert-bias step over a model's routers is ``moe/expert_bias.py``."""
import math
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_utils import default_device, get_world_size


def get_updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, update_rate: float):
    """``expert_bias + rate * sign(mean(tokens) - tokens)`` (per row): overloaded experts go down, underloaded up."""
    counts = tokens_per_expert.float()
    mean = counts.mean(dim=-1, keepdim=True)
    return expert_bias + update_rate * torch.sign(mean - counts)


# --moe-router-load-balancing-type -> the name its loss is logged under (upstream's)
LOAD_BALANCING_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


def switch_load_balancing_loss_func(
    scores: torch.Tensor, tokens_per_expert: torch.Tensor, num_tokens: int, topk: int, num_experts: int, coeff: float
) -> torch.Tensor:
    """Switch-transformer aux loss: ``coeff * E * sum_e f_e * P_e`` with ``f_e`` the fraction of routed
    assignments that went to expert ``e`` and ``P_e`` its mean score over tokens. ``num_tokens``: the tokens that
    ``tokens_per_expert`` counts; ``scores`` may hold only some of them (a context-parallel rank's share, with the
    counts summed over the CP group): ``P_e`` is then this share's part of the mean (scores summed over
    ``num_tokens``), and the ranks' losses add up to the loss of the whole sequence, as upstream's."""
    f = tokens_per_expert.float() / (num_tokens * topk)
    p = scores.float().sum(dim=0) / num_tokens
    return coeff * num_experts * torch.sum(f * p)


def sequence_load_balancing_loss_func(
    scores: torch.Tensor, routing_map: torch.Tensor, seq_length: int, topk: int, num_experts: int, coeff: float,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """``seq_aux_loss`` (DeepSeek-V2): the switch loss of each sequence's own tokens, averaged over the sequences.
    ``scores`` / ``routing_map`` ``[s * b, E]`` in ``[s, b]`` token order. ``group`` (context parallelism: the ranks
    holding the other ``s``-token pieces of the same sequences): the per-sequence counts are summed over it and
    this rank's loss is its share (the ranks' losses add up to the whole sequences' loss)."""
    s_scores = scores.float().reshape(seq_length, -1, num_experts)  # [s, b, E]
    counts = routing_map.reshape(seq_length, -1, num_experts).sum(dim=0).float()  # [b, E]
    size = group_size(group)
    if size > 1:
        dist.all_reduce(counts, group=group)
    total = seq_length * size
    f = counts / (total * topk)
    p = s_scores.sum(dim=0) / total  # [b, E]
    return coeff * num_experts * (f * p).sum(dim=-1).mean()


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """The size of ``group``; 1 for None (no group: this rank alone)."""
    return 1 if group is None else get_world_size(group)


def sequence_group() -> Optional[dist.ProcessGroup]:
    """The ranks holding the other tokens of this rank's sequences, over which the routers' load-balancing
    statistics are reduced: the context-parallel group (None without context parallelism). Upstream reduces over
    tensor x context parallel ranks (its routers see sequence-parallel pieces); here every TP rank routes the whole
    CP-local sequence (``MoELayer`` gathers it), so the CP group alone."""
    group = parallel_state.get_context_parallel_group(check_initialized=False)
    return group if group_size(group) > 1 else None


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float) -> torch.Tensor:
    """Router z-loss (ST-MoE): ``coeff * mean over tokens of logsumexp(logits)^2``; keeps the logits small."""
    return torch.mean(torch.square(torch.logsumexp(logits.float(), dim=-1))) * z_loss_coeff


class RandomSTE(torch.autograd.Function):
    """``--moe-router-force-load-balancing`` (benchmark only): random normal logits in forward, from the default
    generator (the same on the TP peers, which route the same tokens here; restored for a recompute), the gradient
    passed through unchanged in backward, as upstream's straight-through estimator."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(logits).normal_()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output


# ---- loss values for the log: {name: {layer_number: value summed over this iteration's micro-batches}} ----------
_MOE_LOSSES = {}


def record_moe_loss(name: str, value: torch.Tensor, layer_number: Optional[int]) -> None:
    """Add ``value`` (a loss WITHOUT its coefficient, as upstream logs it) of one layer's forward to ``name``."""
    layers = _MOE_LOSSES.setdefault(name, {})
    key = layer_number or 0
    layers[key] = layers.get(key, 0.0) + value.detach().float().reshape(())


def clear_moe_losses() -> None:
    """Forget the recorded values (e.g. of forwards before training starts)."""
    _MOE_LOSSES.clear()


def reduce_moe_losses(names, num_layers: int, num_moe_layers: int, num_microbatches: int):
    """``({name: value}, {name: [value per layer]})`` for ``names`` (the same on every rank; what this rank did not
    record counts 0) of this iteration, as upstream's MoE metrics tracker reports them: each layer's value summed
    over micro-batches and divided by their number, added over pipeline stages and context-parallel ranks (each
    records its share of the sequence's loss) and averaged over data-parallel ranks; the scalar is the sum over
    layers divided by ``num_moe_layers``. ``num_layers``: the model's layers (``layer_number`` 1 .. num_layers; per
    layer: 0 for dense ones). Clears the recorded values."""
    names = list(names)
    recorded = [v for n in names for v in _MOE_LOSSES.get(n, {}).values()]
    device = recorded[0].device if recorded else default_device()
    table = torch.zeros(len(names), max(num_layers, 1), dtype=torch.float32, device=device)
    for row, name in enumerate(names):
        for layer, value in _MOE_LOSSES.get(name, {}).items():
            table[row, max(layer - 1, 0)] += value
    _MOE_LOSSES.clear()
    if names and dist.is_available() and dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        pp = parallel_state.get_pipeline_model_parallel_group()
        if pp is not None and get_world_size(pp) > 1:
            dist.all_reduce(table, group=pp)
        dp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        if dp is not None and get_world_size(dp) > 1:  # a CP rank's value is its share: summed over CP
            dist.all_reduce(table, group=dp)
            table = table / parallel_state.get_data_parallel_world_size()
    table = table.cpu() / max(num_microbatches, 1)
    scalars = {n: float(row.sum()) / max(num_moe_layers, 1) for n, row in zip(names, table)}
    return scalars, {n: row.tolist() for n, row in zip(names, table)}


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: Optional[int] = None) -> int:
    """An expert's capacity: ``ceil(num_tokens / num_experts * capacity_factor)``, at least ``min_capacity``."""
    capacity = math.ceil(num_tokens / num_experts * capacity_factor)
    return capacity if min_capacity is None else max(capacity, min_capacity)


def is_drop_and_pad(config) -> bool:
    """Drop-and-pad MoE (``--moe-expert-capacity-factor`` with ``--moe-pad-expert-input-to-capacity``): every expert
    gets exactly :func:`padded_expert_rows` rows, so the dispatch's shapes follow from the input's shape alone (no
    device-to-host read; what ``--cuda-graph-modules moe`` and whole-layer graphs of MoE layers need)."""
    return (getattr(config, "moe_expert_capacity_factor", None) is not None
            and bool(getattr(config, "moe_pad_expert_input_to_capacity", False)))


def padded_expert_rows(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """The rows each expert gets under drop-and-pad (:func:`apply_router_token_dropping` with ``pad_to_capacity``):
    its capacity ``C = get_capacity(T * topk, E, factor)``, or all ``T`` tokens when ``C >= T``."""
    return min(get_capacity(num_tokens * topk, num_experts, capacity_factor), num_tokens)


def apply_router_token_dropping(probs: torch.Tensor, routing_map: torch.Tensor, router_topk: int,
                                capacity_factor: float, drop_policy: str = "probs", pad_to_capacity: bool = False):
    """Upstream's expert capacity on ``probs`` / ``routing_map`` ``[T, E]``: each expert keeps at most
    ``C = get_capacity(T * topk, E, factor)`` of its tokens, those of the highest probs (``probs``) or the first in
    token order (``position``); the others are dropped (map False, prob 0). ``pad_to_capacity``: each expert gets
    exactly ``C`` rows, its kept tokens and then other tokens with prob 0 (highest probs / first positions first).
    With ``C >= T`` nothing is dropped (and padding sends every token to every expert), as upstream."""
    num_tokens, num_experts = probs.shape
    capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    if capacity >= num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        if drop_policy == "probs":
            key = probs
        elif drop_policy == "position":  # routed tokens before the others, each by position
            position = torch.arange(num_tokens, 0, -1, device=probs.device, dtype=torch.float64)[:, None]
            key = routing_map.to(torch.float64) * (num_tokens + 1) + position
        else:
            raise ValueError(f"moe_token_drop_policy={drop_policy!r} (--moe-token-drop-policy) must be 'probs' or "
                             "'position'")
        chosen = torch.topk(key, k=capacity, dim=0, sorted=False).indices
        keep = torch.zeros_like(routing_map).scatter(0, chosen, True)
    final_map = keep if pad_to_capacity else routing_map & keep
    return probs * final_map, final_map


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``output`` in forward; in backward also sends gradient ``main_loss_backward_scale`` into the
    aux loss, so the aux loss trains the router without being added to the language-model loss."""

    main_loss_backward_scale: torch.Tensor = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        grad_aux = torch.ones_like(aux_loss) if scale is None else torch.ones_like(aux_loss) * scale
        return grad_output, grad_aux

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """Scale of the aux-loss gradient (e.g. 1 / num_microbatches, or the fp16 loss scale). A scale on a CUDA
        device (fp16: the training loop keeps it there, no host read) is copied into the one set before where it
        can be: a backward captured in a CUDA graph (``--cuda-graph-modules moe_router``) reads that memory."""
        cur = MoEAuxLossAutoScaler.main_loss_backward_scale
        if (isinstance(cur, torch.Tensor) and scale.is_cuda and cur.device == scale.device and cur.shape == scale.shape
                and cur.dtype == scale.dtype):
            cur.copy_(scale)
            return
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale


# ---- token permutation ------------------------------------------------------------------------------------
def use_fused_permutation(config, tokens: torch.Tensor) -> bool:
    """``--moe-permute-fusion`` where its kernels can run: Transformer Engine's permutation present and ``tokens``
    (non-empty) on CUDA. Decide once per dispatch and pass the answer to both :func:`permute` and
    :func:`unpermute` (their row maps differ between the two paths)."""
    from megatron.core.extensions.transformer_engine import te_moe_permute, te_moe_permute_with_probs, te_moe_unpermute

    return (bool(getattr(config, "moe_permute_fusion", False)) and tokens.is_cuda and tokens.shape[0] > 0
            and None not in (te_moe_permute, te_moe_permute_with_probs, te_moe_unpermute))


def _token_rows(sorted_indices: torch.Tensor, num_tokens: int, routes_per_token: int) -> torch.Tensor:
    """``[T, k]``: the permuted rows of each token, in expert order (the stable argsort of the rows' tokens)."""
    return torch.argsort(sorted_indices, stable=True).view(num_tokens, routes_per_token)


def _sum_token_rows(rows: torch.Tensor, token_rows: torch.Tensor) -> torch.Tensor:
    """``[N, h]`` permuted rows -> ``[T, h]``: each token's ``k`` rows summed (accumulated in fp32 for half
    precision, rounded once): a gather and a reduction, deterministic, no atomics."""
    t, k = token_rows.shape
    return rows.index_select(0, token_rows.reshape(-1)).view(t, k, rows.shape[-1]).sum(dim=1)


class _GatherTokenRows(torch.autograd.Function):
    """``tokens[sorted_indices]`` whose backward sums each token's row gradients by :func:`_sum_token_rows`."""

    @staticmethod
    def forward(ctx, tokens, sorted_indices, token_rows):
        ctx.save_for_backward(token_rows)
        return tokens.index_select(0, sorted_indices)

    @staticmethod
    def backward(ctx, grad):
        (token_rows,) = ctx.saved_tensors
        return _sum_token_rows(grad, token_rows), None, None


class _SumTokenRows(torch.autograd.Function):
    """:func:`_sum_token_rows` whose backward gathers each row's token gradient."""

    @staticmethod
    def forward(ctx, rows, sorted_indices, token_rows):
        ctx.save_for_backward(sorted_indices)
        return _sum_token_rows(rows, token_rows)

    @staticmethod
    def backward(ctx, grad):
        (sorted_indices,) = ctx.saved_tensors
        return grad.index_select(0, sorted_indices), None, None


def _routes_by_expert(routing_map: torch.Tensor, num_routes: Optional[int] = None):
    """``(token, position)`` ``[N]`` of the routing map's True entries, by expert, then by token (the row-major order
    of ``routing_map.T``): the token of each, and its index in ``routing_map.T`` flattened. With ``num_routes``
    (``N``, known on the host) through ``torch.nonzero_static``: no device-to-host sync, where a boolean-mask index
    syncs for its size (three times per MoE layer and step with the probs' backward). ``num_routes`` is checked against the map on the device: a
    RuntimeError naming ``num_out_tokens`` on CPU, a device-side assert on CUDA."""
    mask = routing_map.t().reshape(-1)
    if num_routes is None:
        pos = mask.nonzero().squeeze(1)
    else:
        torch._assert_async(mask.sum() == int(num_routes),
                            f"permute: num_out_tokens={int(num_routes)} is not the routing map's number of routes")
        pos = torch.nonzero_static(mask, size=int(num_routes)).squeeze(1)
    return pos % routing_map.shape[0], pos


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: Optional[torch.Tensor] = None,
            num_out_tokens: Optional[int] = None, fused: bool = False, routes_per_token: Optional[int] = None):
    """Sort ``tokens`` ``[T, h]`` by expert: row-major order of ``routing_map.T`` (``[E, T]``), i.e. by expert,
    then by token index. Returns ``(permuted [N, h], permuted_probs [N] or None, row_map)``,
    ``N = routing_map.sum()`` (``num_out_tokens`` when the caller knows it: no device sync for it). ``row_map`` is
    for :func:`unpermute`: ``sorted_indices [N]`` (the token of each row) with torch ops, Transformer Engine's
    row-id map with ``fused`` (see :func:`use_fused_permutation`; the same rows in the same order).
    ``routes_per_token`` ``k``: every token has exactly ``k`` routes (top-k routing over all experts; checked on the
    device without a sync): with torch ops the backward then sums each token's row gradients by a gather and a
    reduction instead of atomic adds (give the same ``k`` to :func:`unpermute`)."""
    if fused:
        from megatron.core.extensions.transformer_engine import te_moe_permute, te_moe_permute_with_probs

        n = -1 if num_out_tokens is None else int(num_out_tokens)
        int_map = routing_map.to(torch.int32)  # TE's dtype for a mask map (also makes a column slice contiguous)
        if probs is None:
            out, row_map = te_moe_permute(tokens, int_map, num_out_tokens=n, map_type="mask")
            return out, None, row_map
        out, permuted_probs, row_map = te_moe_permute_with_probs(tokens, probs.contiguous(), int_map, n)
        return out, permuted_probs, row_map
    sorted_indices, pos = _routes_by_expert(routing_map, num_out_tokens)
    # a gather of the transposed probs (backward: an index_add into distinct rows) rather than advanced indexing
    # (backward: index_put with accumulate, which sorts the indices): the same values and gradients, and the plain
    # gather / scatter pair of upstream's drop-and-pad permute inside ``moe`` graphs
    permuted_probs = None if probs is None else probs.t().reshape(-1).index_select(0, pos)
    if routes_per_token is None:
        return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices
    torch._assert_async(routing_map.sum(dim=1).eq(routes_per_token).all(),
                        f"permute: routes_per_token={routes_per_token}, but a token of the routing map has another "
                        "number of routes")
    token_rows = _token_rows(sorted_indices, tokens.shape[0], routes_per_token)
    return _GatherTokenRows.apply(tokens, sorted_indices, token_rows), permuted_probs, sorted_indices


class _WeightRows(torch.autograd.Function):
    """See :func:`weight_rows`."""

    @staticmethod
    def forward(ctx, rows, probs):
        ctx.save_for_backward(rows if ctx.needs_input_grad[1] else None, probs)  # rows only for the probs' grad
        return torch.mul(rows, probs.unsqueeze(-1), out=torch.empty_like(rows))

    @staticmethod
    def backward(ctx, grad):
        rows, probs = ctx.saved_tensors
        grad_rows = grad_probs = None
        if ctx.needs_input_grad[0]:
            grad_rows = torch.mul(grad, probs.unsqueeze(-1),
                                  out=torch.empty_like(grad, memory_format=torch.contiguous_format))
        if ctx.needs_input_grad[1]:
            compute = torch.promote_types(torch.promote_types(grad.dtype, probs.dtype), torch.float32)
            grad_probs = (grad.to(compute) * rows).sum(dim=-1).to(probs.dtype)
        return grad_rows, grad_probs


def weight_rows(rows: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[N, h]`` times ``probs`` ``[N]``, computed in the dtype ``c`` the two promote to (float32 for bf16
    rows and float32 probs) and rounded once to ``rows.dtype``: the values of ``(rows.to(c) * probs[:, None].to(c))
    .to(rows.dtype)`` and its autograd, in one kernel each way for the rows, without a copy of the rows in ``c``
    kept for backward (the rows themselves are kept only when ``probs`` needs a gradient)."""
    return _WeightRows.apply(rows, probs)


def _zero_rows_connected(permuted: torch.Tensor, restore_shape, probs=None) -> torch.Tensor:
    """Zeros of ``restore_shape`` for no permuted rows, still on the autograd graph of ``permuted`` and ``probs``
    (their gradients come back as zeros: every parameter before them gets one, as on the ranks with rows)."""
    out = permuted.new_zeros(restore_shape)
    for t in (permuted, probs):
        if t is not None and t.requires_grad:
            out = out + t.sum().to(out.dtype) * 0
    return out


def _te_unpermute(permuted: torch.Tensor, row_map: torch.Tensor, restore_shape, probs=None) -> torch.Tensor:
    """:func:`unpermute` with Transformer Engine's kernel: merging probs ``[T, E]`` weighted inside it, permuted
    probs ``[N]`` by :func:`weight_rows` first; no rows give connected zeros (TE hands an empty input back as is)."""
    from megatron.core.extensions.transformer_engine import te_moe_unpermute

    if permuted.shape[0] == 0:
        return _zero_rows_connected(permuted, restore_shape, probs)
    merging = probs if probs is not None and probs.dim() == 2 else None
    if probs is not None and merging is None:
        permuted = weight_rows(permuted, probs)
    return te_moe_unpermute(permuted, row_map, merging_probs=merging, restore_shape=torch.Size(restore_shape),
                            map_type="mask")


def unpermute(permuted: torch.Tensor, row_map: torch.Tensor, restore_shape, probs=None,
              fused: bool = False, routes_per_token: Optional[int] = None) -> torch.Tensor:
    """Inverse of :func:`permute` (``row_map`` and ``fused`` as it took/returned): each row, weighted by its prob
    when ``probs`` is given, is summed into its token's row of a zero ``restore_shape`` tensor. ``probs``: the permuted
    probs ``[N]`` (weighted by :func:`weight_rows`), or with ``fused`` the router's probs ``[T, E]`` for the columns of
    the routing map :func:`permute` took (Transformer Engine's kernel weights and sums in float32 and rounds once:
    one pass each way). ``routes_per_token`` as :func:`permute` took it: with torch ops each token's rows are then
    summed by a gather and a reduction (no atomic adds; deterministic)."""
    if probs is not None and probs.dim() == 2 and not fused:
        raise ValueError("unpermute: probs [T, E] (merging probs) need fused=True; give the permuted probs [N]")
    if fused:
        return _te_unpermute(permuted, row_map, restore_shape, probs)
    if probs is not None:
        permuted = weight_rows(permuted, probs)
    if routes_per_token is not None:
        token_rows = _token_rows(row_map, restore_shape[0], routes_per_token)
        return _SumTokenRows.apply(permuted, row_map, token_rows)
    out = permuted.new_zeros(restore_shape)
    return out.index_add_(0, row_map, permuted)


def sort_chunks_by_idxs(x: torch.Tensor, split_sizes, sorted_idxs) -> torch.Tensor:
    """Split ``x`` on dim 0 into chunks of ``split_sizes`` and concatenate them in the order ``sorted_idxs``."""
    chunks = torch.split(x, [int(s) for s in split_sizes], dim=0)
    return torch.cat([chunks[int(i)] for i in sorted_idxs], dim=0)
