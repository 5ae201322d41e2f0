"""Rotary position embedding (neox layout, as Hugging Face's Llama/Qwen use), with the rope scalings
the supported models need."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from minisgl import kernel
from minisgl.kernel import Rope


def _yarn(inv_freq: torch.Tensor, rot_dim: int, theta: float, scaling: dict[str, Any], max_position: int):
    """YaRN: interpolated frequencies (divided by `factor`) for the dims that turn fewer than `beta_slow`
    times over the original context, the original ones past `beta_fast` turns, a linear ramp between;
    cos and sin scaled by the attention factor (0.1 ln(factor) + 1 unless the config gives it)."""
    old_len = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_position / old_len)

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attn_factor = scaling.get("attention_factor")
    if attn_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn_factor = mscale(m) / mscale(m_all) if m and m_all else mscale(1.0)

    def dim_of(turns: float) -> float:  # the dim whose wavelength fits `turns` times in the original context
        return rot_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency, 0: interpolated
    wavelen = theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim)
    return 1.0 / (factor * wavelen) * (1 - keep) + inv_freq * keep, float(attn_factor)


def _inv_freq(
    rot_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int
) -> tuple[torch.Tensor, float]:
    """The rotary frequencies and the factor on cos and sin (1 but for YaRN)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    # dynamic NTK changes the base only past max_position_embeddings, which no sequence here reaches
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, rot_dim, theta, scaling, max_position)
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r} (supported: default, linear, dynamic, yarn, llama3)"
    )


class RotaryEmbedding(nn.Module):
    """Applies rotary to q and k at the batch's positions from a precomputed float32 cos|sin table."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        partial_factor: float = 1.0,
    ) -> None:
        super().__init__()
        rot_dim = int(head_dim * partial_factor)
        inv_freq, mscale = _inv_freq(rot_dim, theta, scaling, max_position)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        cos_sin = torch.cat([freqs.cos() * mscale, freqs.sin() * mscale], dim=-1)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        kv_store: tuple | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotary on q [T, Hq, D] and k [T, Hk, D]; with q_norm/k_norm (RMSNorms over head_dim), normalise
        each head first, in the same kernel. kv_store = (k_cache, v_cache, out_loc, v): write the rotated
        k and v into the KV pool instead of returning k (see kernel.apply_rotary)."""
        if q_norm is None:
            return kernel.apply_rotary(q, k, positions, self.cos_sin_cache, kv_store)
        assert k_norm is not None and q_norm.eps == k_norm.eps
        return kernel.qk_norm_rotary(
            q, k, q_norm.weight, k_norm.weight, q_norm.eps, positions, self.cos_sin_cache, kv_store
        )

    def spec(
        self, positions: torch.Tensor, q_norm: nn.Module | None = None, k_norm: nn.Module | None = None
    ) -> Rope:
        """What forward would apply, for an attention backend that rotates q/k inside its kernel."""
        if q_norm is None:
            return Rope(positions, self.cos_sin_cache, None, None, 0.0)
        assert k_norm is not None and q_norm.eps == k_norm.eps
        return Rope(positions, self.cos_sin_cache, q_norm.weight, k_norm.weight, q_norm.eps)
