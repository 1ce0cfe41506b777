"""Rotary position embedding (RoPE), non-interleaved (rotate-half) layout as upstream's default.

With ``config.apply_rope_fusion`` (on in training unless ``--no-rope-fusion``, as upstream) the rotation runs as
Transformer Engine's fused kernel (one kernel forward, one backward, fp32 math) where TE and CUDA are there; else,
and without the flag, torch ops (cos/sin in the input's dtype): the same rotation up to rounding.

No buffers: frequencies are computed in forward on the input's device, so nothing here is ever left on the meta
device or needs materialising.
"""
import torch


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_base: int = 10000):
        super().__init__()
        dim = int(kv_channels * rotary_percent)
        if dim % 2 != 0 or dim <= 0:
            raise ValueError(f"rotary dimension kv_channels*rotary_percent = {dim} must be a positive even number")
        self.dim = dim
        self.rotary_base = rotary_base

    def forward(self, max_seq_len: int, device=None, offset: int = 0) -> torch.Tensor:
        """Angles ``[max_seq_len, 1, 1, dim]`` (float32)."""
        inv_freq = 1.0 / (
            self.rotary_base ** (torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim)
        )
        seq = torch.arange(max_seq_len, dtype=torch.float32, device=device) + offset
        freqs = torch.outer(seq, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def use_fused_rope(config, t: torch.Tensor) -> bool:
    """``config.apply_rope_fusion`` where TE's fused kernel can run on ``t`` (TE installed, CUDA, non-empty)."""
    from megatron.core.extensions.transformer_engine import te_apply_rotary_pos_emb

    return (bool(getattr(config, "apply_rope_fusion", False)) and te_apply_rotary_pos_emb is not None and t.is_cuda
            and t.numel() > 0)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config=None) -> torch.Tensor:
    """Rotate the first ``freqs.shape[-1]`` channels of ``t`` ``[s, b, heads, hn]`` by ``freqs`` ``[s, 1, 1, d]``
    (float32); fused with ``config.apply_rope_fusion`` (see :func:`use_fused_rope`)."""
    if config is not None and use_fused_rope(config, t):
        from megatron.core.extensions.transformer_engine import te_apply_rotary_pos_emb

        return te_apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", fused=True)
    d = freqs.shape[-1]
    t_rot, t_pass = t[..., :d], t[..., d:]
    cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
    t_rot = t_rot * cos + _rotate_half(t_rot) * sin
    return torch.cat((t_rot, t_pass), dim=-1) if t_pass.shape[-1] else t_rot
