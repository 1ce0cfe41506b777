"""YaRN rotary embeddings (multi-latent attention's ``rope_type='yarn'``), upstream's semantics and defaults.

Each rotary frequency is a blend of the original one (``1 / base^(2i/d)``, "extrapolation") and the one divided by
``scaling_factor`` ("interpolation"): dimensions that turn more than ``beta_fast`` times over
``original_max_position_embeddings`` positions keep the original, those turning fewer than ``beta_slow`` times are
interpolated, a linear ramp between (its ends rounded outwards to whole dimensions with
``correction_range_round_to_int``, upstream's default). cos and sin are multiplied by the attention factor
``mscale(scaling_factor, mscale) / mscale(scaling_factor, mscale_all_dim)`` with ``mscale(s, m) = 0.1 m ln(s) + 1``
(1 for ``s <= 1``); MLA's softmax scale is ``mscale(scaling_factor, mscale_all_dim)^2 / sqrt(q_head_dim)``.

No buffers (as ``RotaryEmbedding``): computed in forward on the caller's device.
"""
import math
from typing import Tuple

import torch


def _yarn_find_correction_dim(num_rotations: float, dim: int, rotary_base: float = 10000,
                              max_position_embeddings: int = 2048) -> float:
    """The (fractional) dimension index whose frequency turns ``num_rotations`` times over the original context."""
    return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(rotary_base))


def _yarn_find_correction_range(low_rot: float, high_rot: float, dim: int, rotary_base: float = 10000,
                                max_position_embeddings: int = 2048, round_to_int: bool = True):
    """The ramp's ends (dimension indices of ``beta_fast`` and ``beta_slow`` rotations), clamped to [0, dim - 1]."""
    low = _yarn_find_correction_dim(low_rot, dim, rotary_base, max_position_embeddings)
    high = _yarn_find_correction_dim(high_rot, dim, rotary_base, max_position_embeddings)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn_linear_ramp_mask(low: float, high: float, dim: int, device=None) -> torch.Tensor:
    """0 up to ``low``, 1 from ``high``, linear between (``dim`` entries, float32)."""
    if low == high:
        high += 0.001  # no division by zero
    return torch.clamp((torch.arange(dim, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)


def _yarn_get_mscale(scale: float = 1, mscale: float = 1) -> float:
    """YaRN's magnitude correction ``0.1 mscale ln(scale) + 1`` (1 for ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_get_concentration_factor(scaling_factor: float, mscale, mscale_all_dim) -> float:
    """The factor on cos and sin (upstream's "concentration factor"); without ``mscale`` / ``mscale_all_dim``:
    ``_yarn_get_mscale(scaling_factor)``."""
    if mscale is None or mscale_all_dim is None:
        return _yarn_get_mscale(scaling_factor)
    return float(_yarn_get_mscale(scaling_factor, mscale) / _yarn_get_mscale(scaling_factor, mscale_all_dim))


class YarnRotaryEmbedding(torch.nn.Module):
    """Upstream's constructor arguments (the ones this fork uses; interleaved rotary and sequence-length
    interpolation are not supported). ``forward(max_seq_len, device=None, offset=0)`` returns
    ``(angles [max_seq_len, 1, 1, dim] float32, mscale)``, as upstream's; with context parallelism the caller asks
    for the whole sequence and takes its chunks' rows (``MLASelfAttention``)."""

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_base: float = 10000.0,
                 scaling_factor: float = 1.0, original_max_position_embeddings: int = 4096, beta_fast: float = 32.0,
                 beta_slow: float = 1.0, mscale: float = 1.0, mscale_all_dim: float = 0.0,
                 correction_range_round_to_int: bool = True):
        super().__init__()
        if kv_channels % 2 or kv_channels <= 0:
            raise ValueError(f"YaRN rotary dimension {kv_channels} (qk_pos_emb_head_dim, --qk-pos-emb-head-dim) must "
                             "be a positive even number")
        if rotary_percent != 1.0:
            raise ValueError(f"YaRN rotary embeddings rotate every channel: rotary_percent (--rotary-percent) must be "
                             f"1.0, got {rotary_percent}")
        if not scaling_factor > 0:
            raise ValueError(f"rotary_scaling_factor (--rotary-scaling-factor) must be positive, got {scaling_factor}")
        self.dim = kv_channels
        self.rotary_base = rotary_base
        self.scaling_factor = scaling_factor
        self.original_max_position_embeddings = original_max_position_embeddings
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        self.mscale = mscale
        self.mscale_all_dim = mscale_all_dim
        self.correction_range_round_to_int = correction_range_round_to_int

    def inv_freq(self, device=None) -> torch.Tensor:
        """The blended inverse frequencies (float32, ``dim / 2``)."""
        powers = self.rotary_base ** (torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim)
        extra, inter = 1.0 / powers, 1.0 / (self.scaling_factor * powers)
        low, high = _yarn_find_correction_range(self.beta_fast, self.beta_slow, self.dim, self.rotary_base,
                                                self.original_max_position_embeddings,
                                                self.correction_range_round_to_int)
        keep = 1.0 - _yarn_linear_ramp_mask(low, high, self.dim // 2, device=device)  # 1: the original frequency
        return inter * (1 - keep) + extra * keep

    def forward(self, max_seq_len: int, device=None, offset: int = 0) -> Tuple[torch.Tensor, float]:
        seq = torch.arange(max_seq_len, dtype=torch.float32, device=device) + offset
        freqs = torch.outer(seq, self.inv_freq(device))
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        return emb, _yarn_get_concentration_factor(self.scaling_factor, self.mscale, self.mscale_all_dim)
