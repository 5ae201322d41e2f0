"""Torch reference implementations of every kernel: the CPU path and the oracle for the Triton tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
    linear: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The experts' gated MLPs of x [T, H], weighted by the routing: w13 [El, 2I, H] (gate | up rows), w2
    [El, H, I] hold global experts expert_start .. expert_start + El - 1; other ids contribute nothing
    (another rank holds them). Expert by expert as Hugging Face's blocks: the act rounds to x's dtype, the
    down projection, the routing weight and the sum over the k choices stay in float32. `linear(a, w)`
    multiplies by one expert's weight (default F.linear in a's dtype; stored experts, a list of weights as
    stored per expert, pass kernel.linear)."""
    mm = linear or (lambda a, w: F.linear(a, w.to(a.dtype)))
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = topk_ids.long() - expert_start
    hit = local[(local >= 0) & (local < len(w13))].unique()  # a host sync: the reference only
    for e in hit.tolist():
        tokens, slots = torch.where(local == e)
        act = silu_and_mul(mm(x[tokens], w13[e]))
        y = mm(act.float(), w2[e]) * topk_weights[tokens, slots, None].float()
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)


# ---- sampling ------------------------------------------------------------------------------------------
# Counter-based noise shared by the torch reference and the Triton kernel: every uint32 is held in an int64
# tensor here (torch has no uint32 arithmetic); a product of two of them may wrap past 2**63, which keeps
# the low 64 bits, so masking to 32 bits gives the same word as the kernel's wrapping uint32 multiply.
MASK32 = 0xFFFFFFFF
UNSEEDED = 1 << 32  # a counter at or above this: the row draws from the step seed, not its own
SERIES_BELOW = 0.015625  # below this v, -log(1 - v) by its series (1 - v would round away v's low bits)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit mixer (Wellons' lowbias32) on uint32 values held in int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def noise_keys(seed: torch.Tensor, counter: torch.Tensor, step_seed: torch.Tensor):
    """Each row's two noise keys [S] from its seed and counter (int64): a seeded row's counter is its position,
    so its noise depends on (seed, position) alone; a row with counter >= UNSEEDED uses the step's seed."""
    seed = torch.where(counter >= UNSEEDED, step_seed, seed)
    s = mix32((seed & MASK32) ^ mix32(((seed >> 32) & MASK32) ^ 0x6A09E667))
    k0 = mix32((counter & MASK32) ^ mix32(((counter >> 32) & MASK32) ^ s))
    return k0, mix32(k0 ^ 0x3C6EF372)


def exponential_noise(k0: torch.Tensor, k1: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, vocab] float32 Exp(1) draws, one per (row keys, token id): E = -log(1 - v), v uniform in (0, 1)."""
    tok = torch.arange(vocab, dtype=torch.int64, device=k0.device)
    h = mix32(((tok[None, :] * 0x9E3779B9) + k0[:, None]) & MASK32)
    h = mix32(h ^ k1[:, None])
    v = (h.to(torch.float32) + 0.5) * 2.0**-32
    series = v * (1.0 + v * (0.5 + v * (0.33333334 + v * 0.25)))  # the small E that pick the winners
    return torch.where(v < SERIES_BELOW, series, -torch.log(1.0 - v))


def sample(logits: torch.Tensor, rows) -> torch.Tensor:
    """Token ids [S] int32 of logits [S, V] under each row's temperature (0: greedy, the first argmax), min-p,
    top-k and top-p (over what min-p and top-k keep, renormalised), as vLLM orders them. A threshold keeps
    every token tied with the last one kept. The draw is argmax(p / E) over the kept tokens, E from
    exponential_noise: the same formula as the Triton kernel. `rows` is a kernel.SamplingRows."""
    e, keep, greedy = _weights(logits, rows)
    k0, k1 = noise_keys(rows.seed, rows.counter, rows.step_seed)
    score = torch.where(keep, e / exponential_noise(k0, k1, e.shape[-1]), -1.0)
    return torch.where(rows.temperature > 0, score.argmax(dim=-1), greedy).to(torch.int32)


def probabilities(logits: torch.Tensor, rows) -> torch.Tensor:
    """The distribution `sample` draws each row from, [S, V] float32 summing to 1: the tokens min-p, top-k and
    top-p keep, at the row's temperature, renormalised (a greedy row's is its softmax: not what it draws)."""
    e, keep, _ = _weights(logits, rows)
    w = torch.where(keep, e, 0.0)
    return w / w.sum(dim=-1, keepdim=True)


def _weights(logits: torch.Tensor, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each token's unnormalised probability [S, V] at the row's temperature, the tokens min-p, top-k and
    top-p keep [S, V], the greedy token [S]): the distribution `sample` draws from is e over `keep`."""
    x = logits.float()
    m, greedy = x.max(dim=-1)
    t = torch.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
    e = torch.exp((x - m[:, None]) * (1.0 / t))  # as the kernel rounds it
    floor = torch.where(rows.min_p > 0, m + t[:, 0] * torch.log(rows.min_p), float("-inf"))[:, None]
    keep = (x > float("-inf")) & (x >= floor)
    if rows.has_top_k or rows.has_top_p:
        keep = keep & _top_k_top_p(x, e, keep, rows)
    return e, keep, greedy


def _top_k_top_p(x: torch.Tensor, e: torch.Tensor, keep: torch.Tensor, rows) -> torch.Tensor:
    """The tokens top-k then top-p keep among `keep` (both by value thresholds: ties stay together)."""
    vocab = x.shape[-1]
    sv, order = x.masked_fill(~keep, float("-inf")).sort(dim=-1, descending=True)
    kth = sv.gather(1, (rows.top_k.clamp(1, vocab) - 1)[:, None])
    kept = (sv >= kth) & (sv > float("-inf"))
    se = torch.where(kept, e.gather(1, order), 0.0)
    csum = se.cumsum(dim=-1)
    # the mass of strictly more likely tokens: the exclusive sum at the first token of each run of ties
    pos = torch.arange(vocab, device=x.device).expand_as(sv)
    starts = torch.ones_like(kept)
    starts[:, 1:] = sv[:, 1:] != sv[:, :-1]
    above = (csum - se).gather(1, torch.where(starts, pos, 0).cummax(dim=-1).values)
    kept &= (above < rows.top_p[:, None] * csum[:, -1:]) | (rows.top_p[:, None] >= 1.0)
    last = kept.sum(dim=-1, keepdim=True).clamp(min=1) - 1
    return x >= sv.gather(1, last)
