"""Context parallelism (``--context-parallel-size``): the sequence split over the ranks of the CP group.

Layout (upstream's load balancing for causal masks): a sequence of length ``s`` is cut into ``2 * cp`` chunks of
``s / (2 cp)`` tokens; CP rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (in that order), so every rank has the
same amount of causal attention work. ``cp_rank_positions`` gives a rank's global token positions;
``split_for_cp_rank`` takes a rank's chunks of any tensor along its sequence axis (tokens, labels, loss masks,
position ids, rotary frequencies).

Attention with CP (``context_parallel_attention``, hooked into ``CoreAttention`` and ``MLASelfAttention``):
- the local path (CPU or ``--transformer-impl local``): ring attention in torch. Each rank keeps its queries and
  visits every rank's key/value block, ``--cp-comm-type p2p`` passing the blocks around the ring (send to rank
  ``r + 1``, receive from ``r - 1``) and ``allgather`` gathering them at once. Per block, scores masked from the
  global positions (causal, or the layer's sliding window ``(left, right)``; a block outside every window of this
  rank's queries is skipped), a softmax with its log-sum-exp, merged online into the running output; attention
  sinks add their term ``exp(sink_h)`` to the log-sum-exp at the end (a key with no value). The value head size may
  differ from the query/key one and the softmax scale is the caller's (multi-latent attention). Backward recomputes
  each block's probabilities from the saved log-sum-exp; the key/value gradients travel the ring back to their owners
  (``allgather``: summed over the group); the sink's gradient is this rank's queries' share. Saved for backward:
  this rank's q, k, v, output and log-sum-exp, so the activations per rank fall as ``1 / cp``. Equal to unsplit
  attention within fp32 rounding.
- Transformer Engine on CUDA (``--transformer-impl transformer_engine``): TE's ``DotProductAttention`` with its CP
  communication (``set_context_parallel_group``; ``p2p``, ``a2a``, ``all_gather``), which expects the same layout;
  ``kv_channels`` ``(d, dv)`` and the softmax scale for MLA (over ``p2p``: TE's CP takes other value head sizes there
  only). Layers with a sliding window or sinks, and MLA over ``allgather``, take the torch ring on CUDA too (TE's CP
  supports windows over all_gather / a2a and sinks over a2a only; passing them to TE is not built). The ring
  materialises each block's fp32 scores ``[b, n, s / cp, s / cp]``: for long sequences on GPUs that is the cost of
  these layers.

Composition (the other modules' parts): MoE and expert parallelism (``moe/router.py``: load-balancing counts over
the CP group, each rank's aux loss its share), MLA's rotary angles of each chunk's global positions
(``multi_latent_attention.py``), multi-token prediction's rolls across chunks (``multi_token_prediction.roll_tensor``).

Not handled (refused by name in ``check_context_parallel_config``): attention dropout, explicit attention masks
(``--reset-attention-mask``), ``a2a+p2p`` (needs the hierarchical groups of ``--hierarchical-context-parallel-sizes``,
not built), ``a2a`` with sliding windows, sinks or multi-latent attention (they run in the torch ring).
"""
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

CP_COMM_TYPES = ("p2p", "allgather", "all_gather", "a2a", "a2a+p2p")
_LOCAL_COMM_TYPES = ("p2p", "allgather", "all_gather")


# ---- layout -----------------------------------------------------------------------------------------------------
def cp_rank_positions(seq_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global positions (int64) of CP rank ``cp_rank``'s tokens: chunks ``cp_rank`` and ``2 cp - 1 - cp_rank``
    of ``2 cp`` equal chunks of ``seq_length`` tokens (the whole sequence with ``cp_size`` 1)."""
    if cp_size == 1:
        return torch.arange(seq_length, device=device)
    if seq_length % (2 * cp_size):
        raise ValueError(f"sequence length {seq_length} must be a multiple of 2 x --context-parallel-size "
                         f"({2 * cp_size})")
    c = seq_length // (2 * cp_size)
    first, second = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(second, second + c, device=device)])


def split_for_cp_rank(t: torch.Tensor, seq_dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This CP rank's two chunks of ``t`` along ``seq_dim`` (the full length), concatenated."""
    if cp_size == 1:
        return t
    s = t.shape[seq_dim]
    if s % (2 * cp_size):
        raise ValueError(f"sequence length {s} must be a multiple of 2 x --context-parallel-size ({2 * cp_size})")
    chunks = t.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=seq_dim)


def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """Upstream's name: this CP rank's rows of rotary frequencies computed for the full sequence."""
    from megatron.core import parallel_state

    return split_for_cp_rank(pos_emb, seq_dim, parallel_state.get_context_parallel_world_size(),
                             parallel_state.get_context_parallel_rank())


def layer_cp_comm_type(config, layer_number: int) -> str:
    """The CP communication of layer ``layer_number`` (1-based): ``config.cp_comm_type`` (one string, or one per
    layer as upstream's list); default p2p."""
    kind = getattr(config, "cp_comm_type", None) or "p2p"
    if isinstance(kind, (list, tuple)):
        kind = kind[layer_number - 1]
    return kind


def check_context_parallel_config(config) -> None:
    """Refuse, naming the flag, what context parallelism does not handle here (``TransformerConfig`` calls this
    when ``context_parallel_size > 1``)."""
    cp = config.context_parallel_size
    kinds = getattr(config, "cp_comm_type", None) or "p2p"
    kinds = list(kinds) if isinstance(kinds, (list, tuple)) else [kinds]
    if len(kinds) > 1 and len(kinds) != config.num_layers:
        raise ValueError(f"cp_comm_type (--cp-comm-type) lists {len(kinds)} types: give one, or one per layer "
                         f"({config.num_layers}, --num-layers)")
    for kind in kinds:
        if kind not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type={kind!r} (--cp-comm-type): expected one of {', '.join(CP_COMM_TYPES)}")
        if kind == "a2a+p2p":
            raise ValueError("--cp-comm-type a2a+p2p needs the hierarchical context-parallel groups of "
                             "--hierarchical-context-parallel-sizes, which this fork does not build (use p2p, a2a "
                             "or allgather)")
        if kind == "a2a" and config.transformer_impl != "transformer_engine":
            raise ValueError("--cp-comm-type a2a needs --transformer-impl transformer_engine (TE's "
                             "DotProductAttention); the local ring attention does p2p and allgather")
    refused = (
        (config.attention_dropout > 0, f"--attention-dropout {config.attention_dropout}",
         " (the ring attention has no dropout: use --attention-dropout 0)"),
        ((getattr(config, "window_size", None) is not None or getattr(config, "softmax_type", "vanilla") != "vanilla")
         and "a2a" in kinds, "--cp-comm-type a2a with sliding windows (--window-size) or attention sinks "
         "(--softmax-type)", " (they run in the torch ring attention: use p2p or allgather)"),
        (getattr(config, "multi_latent_attention", False) and "a2a" in kinds,
         "--cp-comm-type a2a with multi-latent attention", " (TE's CP takes MLA's head sizes over p2p; allgather "
         "runs in the torch ring)"),
    )
    for bad, what, hint in refused:
        if bad:
            raise ValueError(f"{what} is not supported with --context-parallel-size {cp} yet{hint}")


# ---- ring attention (local path) --------------------------------------------------------------------------------
def _block_masked(q_pos, k_pos, window=None):
    """Bool ``[sq, sk]``, True where the query at ``q_pos`` may NOT attend the key at ``k_pos``: causal, or the sliding
    window ``(left, right)`` (-1: unbounded side; ``core_attention.sliding_window_mask``'s rule) from the global
    positions."""
    rel = k_pos[None, :] - q_pos[:, None]
    left, right = window if window is not None else (-1, 0)
    masked = torch.zeros(rel.shape, dtype=torch.bool, device=rel.device)
    if left >= 0:
        masked |= rel < -left
    if right >= 0:
        masked |= rel > right
    return masked


def _block_scores(q, k, masked, scale):
    """fp32 scores ``[b, n, sq, sk]`` of ``q`` against ``k``, -inf where ``masked``."""
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    return scores.masked_fill(masked, float("-inf"))


def _finite(x):
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


class _Ring:
    """The CP group's ring: this rank's index, the global ranks, and block exchange (p2p or all-gather)."""

    def __init__(self, group, comm_type: str):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.ranks = dist.get_process_group_ranks(group)
        self.gather = comm_type in ("allgather", "all_gather")

    def shift(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """Send ``tensors`` to the next rank of the ring, return the previous rank's (p2p; a ring of one rank
        keeps its own: no send to itself, which NCCL would answer with a second communicator)."""
        if self.size == 1:
            return list(tensors)
        flat = torch.cat([t.reshape(-1) for t in tensors]).contiguous()
        recv = torch.empty_like(flat)
        nxt, prv = self.ranks[(self.rank + 1) % self.size], self.ranks[(self.rank - 1) % self.size]
        reqs = [dist.isend(flat, nxt, group=self.group), dist.irecv(recv, prv, group=self.group)]
        for req in reqs:
            req.wait()
        out, i = [], 0
        for t in tensors:
            out.append(recv[i:i + t.numel()].view_as(t))
            i += t.numel()
        return out

    def all_gather(self, t: torch.Tensor) -> List[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return parts


class RingAttention(torch.autograd.Function):
    """Causal (or sliding-window) attention of this rank's queries over the keys/values of the whole CP group (see
    the module docstring). ``q, k``: ``[b, n, s_local, d]``, ``v``: ``[b, n, s_local, dv]`` (``dv`` may differ from
    ``d``: multi-latent attention) in the load-balanced layout; ``sink``: None or per-head sink logits ``[n]`` (one
    more term ``exp(sink_h)`` in each query's softmax denominator, with no value). Key and value blocks travel
    together (concatenated on the last axis); a block no query of this rank may see (outside every window) is
    passed on without being computed."""

    @staticmethod
    def forward(ctx, q, k, v, sink, group, comm_type, seq_length, scale, window):
        ring = _Ring(group, comm_type)
        dk = k.shape[-1]
        q_pos = cp_rank_positions(seq_length, ring.size, ring.rank, q.device)
        out = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], dim=-1)
        blocks = ring.all_gather(kv) if ring.gather else None
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            if ring.gather:
                kv = blocks[src]
            elif step > 0:
                kv, = ring.shift([kv])
            masked = _block_masked(q_pos, cp_rank_positions(seq_length, ring.size, src, q.device), window)
            if bool(masked.all()):
                continue
            scores = _block_scores(q, kv[..., :dk], masked, scale)
            block_lse = torch.logsumexp(scores, dim=-1)
            block_out = torch.matmul(torch.exp(scores - _finite(block_lse)[..., None]), kv[..., dk:].float())
            new_lse = torch.logaddexp(lse, block_lse)
            safe = _finite(new_lse)[..., None]
            out = out * torch.exp(lse[..., None] - safe) + block_out * torch.exp(block_lse[..., None] - safe)
            lse = new_lse
        if sink is not None:  # the sink's term in the denominator: every weight shrinks by exp(lse - lse')
            new_lse = torch.logaddexp(lse, sink.float().view(1, -1, 1).expand_as(lse))
            out = out * torch.exp(lse - new_lse)[..., None]
            lse = new_lse
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.group, ctx.comm_type, ctx.seq_length, ctx.scale, ctx.window = group, comm_type, seq_length, scale, window
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sink = ctx.saved_tensors
        ring, scale, seq_length = _Ring(ctx.group, ctx.comm_type), ctx.scale, ctx.seq_length
        dk = k.shape[-1]
        q_pos = cp_rank_positions(seq_length, ring.size, ring.rank, q.device)
        do = grad_out.float()
        delta = (do * out.float()).sum(-1, keepdim=True)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], dim=-1)
        blocks = ring.all_gather(kv) if ring.gather else None
        dkv_all = torch.zeros((ring.size,) + kv.shape, dtype=torch.float32, device=q.device) if ring.gather else None
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with its block (p2p)
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            if ring.gather:
                kv = blocks[src]
            elif step > 0:
                kv, dkv = ring.shift([kv, dkv])
            masked = _block_masked(q_pos, cp_rank_positions(seq_length, ring.size, src, q.device), ctx.window)
            if bool(masked.all()):
                continue
            kb, vb = kv[..., :dk].float(), kv[..., dk:].float()
            p = torch.exp(_block_scores(q, kb, masked, scale) - _finite(lse)[..., None])
            dv = torch.matmul(p.transpose(-2, -1), do)
            ds = p * (torch.matmul(do, vb.transpose(-2, -1)) - delta)
            dq += torch.matmul(ds, kb) * scale
            dk_block = torch.matmul(ds.transpose(-2, -1), q.float()) * scale
            if ring.gather:
                dkv_all[src] += torch.cat([dk_block, dv], dim=-1)
            else:
                dkv = dkv + torch.cat([dk_block, dv], dim=-1)
        if ring.gather:  # each rank's key/value gradients summed over the ranks whose queries used them
            dist.all_reduce(dkv_all, group=ring.group)
            dkv = dkv_all[ring.rank]
        else:  # the block (and its gradients) of rank r - 1 (size - 1 steps ago: ours) returns home
            dkv, = ring.shift([dkv])
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:  # a key of value 0: d sink_h = -sum p_sink * delta
            p_sink = torch.exp(sink.float().view(1, -1, 1) - lse)
            dsink = -(p_sink * delta.squeeze(-1)).sum(dim=(0, 2)).to(sink.dtype)
        return (dq.to(q.dtype), dkv[..., :dk].to(k.dtype), dkv[..., dk:].to(v.dtype), dsink, None, None, None, None,
                None)


def ring_attention(q, k, v, group, comm_type: str = "p2p", scale: Optional[float] = None,
                   window: Optional[Tuple[int, int]] = None, sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention ``[b, n, s_local, dv]`` of this CP rank's queries over the whole sequence (the torch
    path); ``scale`` defaults to ``1 / sqrt(d)``; ``window``: a sliding window ``(left, right)`` instead of plain
    causal; ``sink``: per-head sink logits ``[n]`` (attention sinks)."""
    size = dist.get_world_size(group)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    window = None if window is None else tuple(int(w) for w in window)
    return RingAttention.apply(q, k, v, sink, group, comm_type, q.shape[-2] * size, scale, window)


# ---- Transformer Engine path ------------------------------------------------------------------------------------
_TE_ATTENTION = {}


def _te_attention(config, num_heads: int, head_dim: int, v_head_dim: int, comm_type: str, scale: Optional[float]):
    """One TE ``DotProductAttention`` (no parameters, outside the module tree: no state-dict keys) per shape, softmax
    scale and communication type, with this rank's CP group set (``kv_channels`` ``(d, dv)`` where the value head
    size differs: multi-latent attention)."""
    from megatron.core import parallel_state
    from megatron.core.extensions.transformer_engine import TEDotProductAttention, require_te

    require_te("context parallelism with --transformer-impl transformer_engine")
    kind = "all_gather" if comm_type == "allgather" else comm_type
    key = (num_heads, head_dim, v_head_dim, scale, kind, id(parallel_state.get_context_parallel_group()))
    if key not in _TE_ATTENTION:
        channels = head_dim if v_head_dim == head_dim else (head_dim, v_head_dim)
        attn = TEDotProductAttention(num_heads, channels, attention_dropout=0.0, qkv_format="sbhd",
                                     attn_mask_type="causal", softmax_scale=scale)
        attn.set_context_parallel_group(parallel_state.get_context_parallel_group(),
                                        parallel_state.get_context_parallel_global_ranks(),
                                        torch.cuda.Stream(), cp_comm_type=kind)
        _TE_ATTENTION[key] = attn
    return _TE_ATTENTION[key]


def use_te_attention(config, q: torch.Tensor, window=None, sink=None, v_head_dim: Optional[int] = None,
                     comm_type: str = "p2p") -> bool:
    """TE's CP attention: with ``--transformer-impl transformer_engine`` on CUDA, for causal attention without a
    sliding window or sinks, and with a value head size other than the query/key one (MLA) only over ``p2p``, as
    TE's CP supports them (windows: all_gather and a2a only; sinks: a2a only; MLA: p2p only). The other cases take
    the torch ring, which runs on CUDA too (``a2a``, which the ring does not do, is refused for them by
    ``check_context_parallel_config``)."""
    if config.transformer_impl != "transformer_engine" or not q.is_cuda or window is not None or sink is not None:
        return False
    return v_head_dim in (None, q.shape[-1]) or comm_type == "p2p"


def context_parallel_attention(q, k, v, attention_mask, config, layer_number: int = 1, scale: Optional[float] = None,
                               window: Optional[Tuple[int, int]] = None,
                               sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal core attention ``[b, n, s_local, dv]`` under context parallelism (the ``CoreAttention`` and
    ``MLASelfAttention`` hook); ``scale``: the softmax scale (default ``1 / sqrt(d)``); ``window``: this layer's
    sliding window ``(left, right)``; ``sink``: per-head sink logits ``[n]``."""
    from megatron.core import parallel_state

    if attention_mask is not None:
        raise ValueError("an explicit attention mask (--reset-attention-mask) is not supported with "
                         f"--context-parallel-size {config.context_parallel_size}: context parallelism is causal only")
    comm_type = layer_cp_comm_type(config, layer_number)
    if use_te_attention(config, q, window, sink, v.shape[-1], comm_type):
        b, n, s, d = q.shape
        dv = v.shape[-1]
        attn = _te_attention(config, n, d, dv, comm_type, scale)
        q, k, v = (t.permute(2, 0, 1, 3).contiguous() for t in (q, k, v))  # [s, b, n, d]
        return attn(q, k, v).view(s, b, n, dv).permute(1, 2, 0, 3)
    if comm_type == "a2a":
        raise ValueError("--cp-comm-type a2a runs in Transformer Engine's attention, which is not used here for "
                         "sliding windows, attention sinks or multi-latent attention: use p2p or allgather")
    return ring_attention(q, k, v, parallel_state.get_context_parallel_group(), comm_type, scale, window, sink)
