"""Rotary position embedding (neox layout, as Hugging Face's Llama/Qwen use), with the rope scalings
the supported models need."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from minisgl import kernel
from minisgl.kernel import Rope


def _inv_freq(rot_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
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
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


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
        inv_freq = _inv_freq(rot_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

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
