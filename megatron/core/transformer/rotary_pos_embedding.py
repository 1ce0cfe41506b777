"""Rotary position embedding (RoPE), non-interleaved (rotate-half) layout as upstream's default.

With ``config.apply_rope_fusion`` (on in training unless ``--no-rope-fusion``, as upstream) the rotation runs as
Transformer Engine's fused kernel (one kernel forward, one backward, fp32 math) where TE and CUDA are there; else,
and without the flag, torch ops (cos/sin in the input's dtype): the same rotation up to rounding.

No buffers: frequencies are computed in forward on the input's device, so nothing here is ever left on the meta
device or needs materialising.

``rope_scaling`` (``--use-rope-scaling`` / ``--rope-scaling-factor``, GPTModel's upstream parameters): Llama 3.1's
frequency scaling (long wavelengths divided by the factor, short ones kept, a smooth blend between, as upstream's
``RotaryEmbedding._apply_scaling`` with its fixed low/high frequency factors 1 / 4 and original context 8192). YaRN
(multi-latent attention's ``rope_type='yarn'``) lives in ``yarn_rotary_pos_embedding``.
"""
import math

import torch


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float = 8.0, low_freq_factor: float = 1.0,
                           high_freq_factor: float = 4.0, original_max_position_embeddings: int = 8192):
    """Llama 3.1's rescaled inverse frequencies: wavelengths above ``original / low_freq_factor`` divided by
    ``factor``, below ``original / high_freq_factor`` unchanged, linearly blended (in ``original / wavelength``)
    between."""
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    low = wavelen > original_max_position_embeddings / low_freq_factor
    high = wavelen < original_max_position_embeddings / high_freq_factor
    return torch.where(low, inv_freq / factor, torch.where(high, inv_freq, blended))


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_base: int = 10000,
                 rope_scaling: bool = False, rope_scaling_factor: float = 8.0):
        super().__init__()
        dim = int(kv_channels * rotary_percent)
        if dim % 2 != 0 or dim <= 0:
            raise ValueError(f"rotary dimension kv_channels*rotary_percent = {dim} must be a positive even number")
        if rope_scaling and not rope_scaling_factor > 0:
            raise ValueError(f"rope_scaling_factor (--rope-scaling-factor) must be positive, got {rope_scaling_factor}")
        self.dim = dim
        self.rotary_base = rotary_base
        self.rope_scaling = bool(rope_scaling)
        self.rope_scaling_factor = rope_scaling_factor

    def inv_freq(self, device=None) -> torch.Tensor:
        """``1 / base^(2i / dim)`` (float32), Llama-3.1-scaled with ``rope_scaling``."""
        inv_freq = 1.0 / (
            self.rotary_base ** (torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim)
        )
        return llama3_scaled_inv_freq(inv_freq, self.rope_scaling_factor) if self.rope_scaling else inv_freq

    def forward(self, max_seq_len: int, device=None, offset: int = 0) -> torch.Tensor:
        """Angles ``[max_seq_len, 1, 1, dim]`` (float32)."""
        inv_freq = self.inv_freq(device)
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


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config=None, mscale: float = 1.0,
                         mla_rotary_interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``freqs.shape[-1]`` channels of ``t`` ``[s, b, heads, hn]`` by ``freqs`` ``[s, 1, 1, d]``
    (float32); fused with ``config.apply_rope_fusion`` (see :func:`use_fused_rope`). Upstream's two MLA options
    (torch ops only, as upstream's unfused path): ``mscale`` multiplies cos and sin (YaRN's attention factor);
    ``mla_rotary_interleaved`` first reorders the rotated channels as (even ones, odd ones), DeepSeek's
    interleaved pairs, and leaves them in that order. ``freqs`` may be ``(angles, mscale)`` as YaRN's embedding returns
    it (GPTModel's ``position_embedding_type='yarn'``): that mscale multiplies too."""
    if isinstance(freqs, tuple):
        freqs, factor = freqs
        mscale = mscale * factor
    plain = mscale == 1.0 and not mla_rotary_interleaved
    if plain and config is not None and use_fused_rope(config, t):
        from megatron.core.extensions.transformer_engine import te_apply_rotary_pos_emb

        return te_apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", fused=True)
    d = freqs.shape[-1]
    t_rot, t_pass = t[..., :d], t[..., d:]
    if mla_rotary_interleaved:
        t_rot = torch.cat((t_rot[..., 0::2], t_rot[..., 1::2]), dim=-1)
    cos, sin = (freqs.cos() * mscale).to(t.dtype), (freqs.sin() * mscale).to(t.dtype)
    t_rot = t_rot * cos + _rotate_half(t_rot) * sin
    return torch.cat((t_rot, t_pass), dim=-1) if t_pass.shape[-1] else t_rot
