"""Core attention ``softmax(q k^T / sqrt(d) + mask) v`` on torch's ``scaled_dot_product_attention``, with the
gpt-oss options: sliding windows (``--window-size``, ``--window-attn-skip-freq``) and attention sinks
(``--softmax-type off-by-one | learnable``).

Sliding window ``(left, right)`` (upstream's convention, -1 unbounded): query ``i`` attends the keys ``j`` with
``i - left <= j <= i + right`` (for ``sq < sk`` the queries are the last ``sq`` positions). Together with causality
(``right = 0``) it is one boolean mask, built once per shape and device and kept (``sliding_window_mask``).

Sinks: one more logit per head in the softmax's denominator, ``p_ij = exp(s_ij) / (exp(sink_h) + sum_j
exp(s_ij))`` (upstream's ``SoftmaxOne``): 0 for off-by-one, the learnable per-head parameter
``core_attention.softmax_offset`` (upstream's name and checkpoint key; ``[heads / tp]`` on each tensor-parallel
rank, split over heads like the QKV projection) for learnable. SDPA computes it with one extra key: the head
dimension gets ``SINK_PAD`` more channels, ones in the queries' first one, zeros in the real keys' (their scores are
unchanged) and ``sink_h * sqrt(d)`` in the sink key's, so the sink key scores ``sink_h`` against every query; its
value is zero, so the output is the sink softmax's, and the sink gets its gradient through the key (any SDPA kernel
that takes a boolean mask shared by the heads: the math one, memory-efficient attention on CUDA; no per-head mask
is materialised).

The Transformer Engine layer spec computes core attention here too (this fork's TE layers are its linears), so
both specs have the window and the sinks, and the same checkpoint keys as upstream's (``softmax_offset`` of its
``DotProductAttention`` / ``TEDotProductAttention``).
"""
import contextlib
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.random import model_parallel_rng_context
from megatron.core.transformer.context_parallel import context_parallel_attention
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import config_init_method, is_layer_window_attention

_MASKS = {}  # (sq, sk, window, device) -> bool mask [sq, sk], True where attention is NOT allowed
_MAX_MASKS = 16


def sliding_window_mask(sq: int, sk: int, window: Optional[Tuple[int, int]], device) -> torch.Tensor:
    """Bool ``[sq, sk]``, True where query ``i`` may NOT attend key ``j``: outside ``[i' - left, i' + right]`` with
    ``i' = i + sk - sq`` (-1: unbounded side); ``window`` None: causal (``(-1, 0)``). Built once per shape, window
    and device, then reused (every layer and step of a run asks for the same few)."""
    left, right = window if window is not None else (-1, 0)
    key = (sq, sk, left, right, str(device))
    mask = _MASKS.get(key)
    if mask is None:
        rel = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None] - (sk - sq)
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=device)
        if left >= 0:
            allowed &= rel >= -left
        if right >= 0:
            allowed &= rel <= right
        mask = ~allowed
        if len(_MASKS) >= _MAX_MASKS:
            _MASKS.clear()
        _MASKS[key] = mask
    return mask


SINK_PAD = 8  # channels added to the head dimension for the sink key (a multiple of 8 keeps the kernels' alignment)


_SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "fused": "EFFICIENT_ATTENTION", "unfused": "MATH", "local": "MATH"}


def sdpa_backend(attention_backend):
    """The context that restricts ``F.scaled_dot_product_attention`` to the kernel of ``--attention-backend`` (an
    ``AttnBackend`` or its name; ``auto``: torch's own choice, no restriction)."""
    name = _SDPA_BACKENDS.get(getattr(attention_backend, "name", attention_backend))
    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, name))


def attention(q, k, v, mask: Optional[torch.Tensor] = None, sink: Optional[torch.Tensor] = None,
              dropout_p: float = 0.0, scale: Optional[float] = None) -> torch.Tensor:
    """``[b, n, s, d]`` core attention by ``F.scaled_dot_product_attention``. ``mask``: None (causal) or bool
    ``[b|1, 1|n, sq, sk]`` / ``[sq, sk]``, True where NOT allowed. ``sink``: None, or ``[n]`` sink logits (see the
    module docstring). ``scale``: of ``q k^T`` (None: ``1 / sqrt(d)``; ``TransformerConfig.softmax_scale``)."""
    if sink is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, dropout_p=dropout_p, scale=scale)
    b, n, sq, d = q.shape
    sk, scale = k.shape[2], d ** -0.5 if scale is None else scale
    if mask is None:
        mask = sliding_window_mask(sq, sk, None, q.device)
    # one more key whose score is sink_h for every query: the queries get a channel of ones, the real keys a channel
    # of zeros (their scores unchanged) and the sink key sink_h / scale there; its value is zero
    ones, zeros = q.new_ones(b, n, sq, 1), q.new_zeros(b, n, sq, SINK_PAD - 1)
    qx = torch.cat([q, ones, zeros], dim=-1)
    kx = F.pad(k, (0, SINK_PAD))
    sink_channel = (sink.float() / scale).to(q.dtype).view(n, 1)
    sink_key = torch.cat([q.new_zeros(n, d), sink_channel, q.new_zeros(n, SINK_PAD - 1)], dim=-1)
    kx = torch.cat([kx, sink_key.view(1, n, 1, d + SINK_PAD).expand(b, n, 1, d + SINK_PAD)], dim=2)
    vx = F.pad(v, (0, SINK_PAD, 0, 1))  # the sink's value row (zero), and the head dimension of q and k
    allowed = torch.cat([~mask, mask.new_ones(*mask.shape[:-1], 1)], dim=-1)  # the sink key: always
    out = F.scaled_dot_product_attention(qx, kx, vx, attn_mask=allowed, dropout_p=dropout_p, scale=scale)
    return out[..., :d]


class CoreAttention(MegatronModule):
    """The ``core_attention`` submodule of ``SelfAttention`` (``[b, n, s, d]`` in and out): this layer's sliding
    window (``is_layer_window_attention`` of its global ``layer_number``) and sink; ``softmax_offset`` is a
    parameter only with ``softmax_type='learnable'``."""

    def __init__(self, config, layer_number: int, num_heads: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(config)
        self.window_size = (tuple(config.window_size) if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None)
        self.layer_number, self.num_heads, self.tp_rank, self.tp_size = layer_number, num_heads, tp_rank, tp_size
        if config.softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.empty(num_heads, dtype=config.params_dtype))
            # split over heads like the QKV projection: the distributed optimizer and the grad norm see a TP shard
            self.softmax_offset.tensor_model_parallel = tp_size > 1
            self.softmax_offset.partition_dim = 0
            self.softmax_offset.sequence_parallel = False
        else:
            self.softmax_offset = None

    def reset_parameters(self) -> None:
        """``softmax_offset`` ~ normal(0, init_method_std) (upstream's ``config.init_method``), each TP rank its
        heads' slice as for a TP-split linear weight (the init contract, ``transformer.utils.init_weights``)."""
        p = self.softmax_offset
        if p is None or p.is_meta or not self.config.perform_initialization:
            return
        from megatron.core.tensor_parallel.layers import _init_split

        with torch.no_grad():
            _init_split(p, config_init_method(self.config), 0, self.config, self.tp_size,
                        self.tp_rank, False)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """``softmax_offset`` split over TP ranks on axis 0 (upstream's layout); nothing else."""
        if self.softmax_offset is None:
            return {}
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        tp_group = parallel_state.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        return make_sharded_tensors_for_checkpoint({"softmax_offset": self.softmax_offset}, prefix,
                                                   {"softmax_offset": 0}, sharded_offsets, tp_group=tp_group)

    def sink(self, like: torch.Tensor) -> Optional[torch.Tensor]:
        """The per-head sink logits ``[n]`` (None: vanilla softmax)."""
        if self.config.softmax_type == "off-by-one":
            return like.new_zeros(self.num_heads)
        return self.softmax_offset

    def mask(self, attention_mask: Optional[torch.Tensor], sq: int, sk: int, device) -> Optional[torch.Tensor]:
        """The bool mask to apply (True = not allowed): ``attention_mask`` and this layer's window; None for plain
        causal attention."""
        if self.window_size is None:
            return attention_mask.bool() if attention_mask is not None else None
        window = sliding_window_mask(sq, sk, self.window_size, device)
        return window if attention_mask is None else attention_mask.bool() | window

    def forward(self, q, k, v, attention_mask=None, sink=None):
        """``softmax(q k^T * softmax_scale) v`` (``config.softmax_scale``, default ``1 / sqrt(d)``) with dropout;
        ``attention_mask`` as ``SelfAttention.forward``'s. ``sink`` (default ``self.sink(q)``) is an argument so that
        a recompute of this call (``--recompute-modules core_attn``) sees the parameter as an input."""
        sink = self.sink(q) if sink is None and self.config.softmax_type != "vanilla" else sink
        if self.config.context_parallel_size > 1:  # the sequence split over the CP group, window and sink included
            return context_parallel_attention(q, k, v, attention_mask, self.config, self.layer_number,
                                              scale=getattr(self.config, "softmax_scale", None),
                                              window=self.window_size, sink=sink)
        dropout_p = self.config.attention_dropout if self.training else 0.0
        # each TP rank drops out its own heads: the model-parallel RNG stream (not with sequence parallelism: as
        # upstream's core attention)
        rng = model_parallel_rng_context(self.config) if dropout_p > 0 and not self.config.sequence_parallel else None

        mask = self.mask(attention_mask, q.shape[2], k.shape[2], q.device)
        with rng if rng is not None else contextlib.nullcontext(), sdpa_backend(self.config.attention_backend):
            return attention(q, k, v, mask, sink, dropout_p, getattr(self.config, "softmax_scale", None))
