"""Torch reference implementations of every kernel: the CPU path and the oracle for the Triton tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 like Hugging Face, cast back before the weight multiply."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x; return (rms_norm(residual), residual)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary on q [T, Hq, D] and k [T, Hk, D]; cos_sin_cache is [max_pos, D] (cos | sin halves)
    in float32. Rotates the first `rot_dim` = cache width of each head."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, rot/2]
    cos = torch.cat([cos, cos], dim=-1).unsqueeze(1)
    sin = torch.cat([sin, sin], dim=-1).unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rot = cos.shape[-1]
        xr, xp = x[..., :rot], x[..., rot:]
        x1, x2 = xr.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        out = (xr * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))
        return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out

    return rotate(q), rotate(k)


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, out_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write the new tokens' K/V [T, Hkv, D] into the pool rows `out_loc` [T]."""
    k_cache[out_loc] = k.to(k_cache.dtype)
    v_cache[out_loc] = v.to(v_cache.dtype)


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's attention input: RMSNorm over each head of q and k, then rotary."""
    return apply_rotary(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), positions, cos_sin_cache)


def silu_and_mul_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The gated MLP's down projection: silu_and_mul(x) W^T (+ b)."""
    return F.linear(silu_and_mul(x), weight, bias)


def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm projection: h = x + residual (x when residual is None); returns (rms_norm(h) W^T + b, h)."""
    h = x if residual is None else residual + x
    return F.linear(rms_norm(h, norm_weight, eps), weight, bias), h


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixture-of-experts routing as Hugging Face's: softmax over the experts in float32, the top_k of it,
    divided by their sum when renormalize. Returns (weights [T, k] float32, expert ids [T, k] int32)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_start: int = 0,
) -> torch.Tensor:
    """The experts' gated MLPs of x [T, H], weighted by the routing: w13 [El, 2I, H] (gate | up rows), w2
    [El, H, I] hold global experts expert_start .. expert_start + El - 1; other ids contribute nothing
    (another rank holds them). Expert by expert as Hugging Face's blocks: the act rounds to x's dtype, the
    down projection, the routing weight and the sum over the k choices stay in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = topk_ids.long() - expert_start
    hit = local[(local >= 0) & (local < w13.shape[0])].unique()  # a host sync: the reference only
    for e in hit.tolist():
        tokens, slots = torch.where(local == e)
        act = silu_and_mul(F.linear(x[tokens], w13[e]))
        y = F.linear(act.float(), w2[e].float()) * topk_weights[tokens, slots, None].float()
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)
