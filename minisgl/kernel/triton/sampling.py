"""Sampling a whole batch in one launch: temperature, min-p, top-k, top-p and per-request seeds.

One program per row walks its vocabulary a few times and never sorts it:
1. the row's max (and first argmax, the greedy token) and its lowest finite logit;
2. top-k and top-p thresholds by multi-pivot bisection over the logit value: each pass counts (top-k) or
   sums the probability mass (top-p) above PIVOTS evenly spaced pivots inside the current bracket
   (lo, hi], then keeps the sub-interval holding the boundary; it stops once no two distinct values are
   left inside (the threshold is exact, ties stay together) or after MAX_ITERS passes;
3. the draw: argmax of p / E over the kept tokens, E ~ Exp(1) from a counter-based hash of the row's
   keys and the token id (kernel/reference.py's formula), so the noise needs no state and no loop over
   seeded rows, and a seeded row draws the same token whatever shares its batch.
The torch reference (kernel/reference.py `sample`) computes the same kept set by sorting."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import gdc_begin, launch_opts, pdl


@triton.jit
def _mix32(x):
    """reference.mix32 on uint32 (the multiplies wrap)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _row_keys(seed, counter, step_seed):
    """reference.noise_keys for one row (int64 scalars in, uint32 keys out)."""
    seed = tl.where(counter >= 4294967296, step_seed, seed)
    s = _mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ _mix32(((seed >> 32) & 0xFFFFFFFF).to(tl.uint32) ^ 0x6A09E667))
    k0 = _mix32((counter & 0xFFFFFFFF).to(tl.uint32) ^ _mix32(((counter >> 32) & 0xFFFFFFFF).to(tl.uint32) ^ s))
    return k0, _mix32(k0 ^ 0x3C6EF372)


@triton.jit
def _load(base, offs, V, floor):
    """A block of the row in float32; padding and tokens below the min-p floor read as -inf."""
    x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    return tl.where(x >= floor, x, float("-inf"))


@triton.jit
def _stats(base, V, BLOCK: tl.constexpr):
    """(max, its first index, lowest finite value) of a row."""
    offs0 = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    low = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + offs0
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        better = x > best  # strictly: a lane keeps the first index of its largest value
        best_i = tl.where(better, offs, best_i)
        best = tl.where(better, x, best)
        low = tl.minimum(low, tl.where(x > float("-inf"), x, float("inf")))
    m = tl.max(best, 0)
    return m, tl.min(tl.where(best == m, best_i, V), 0), tl.min(low, 0)


@triton.jit
def _pivot_pass(base, V, lo, hi, zlo, floor, m, scale, MASS: tl.constexpr, BLOCK: tl.constexpr,
                PIVOTS: tl.constexpr):
    """One pass over the row: at PIVOTS points evenly inside (lo, hi), the count (MASS False) or the
    probability mass (MASS True, unnormalised: exp((x - max) / T)) of the tokens strictly above; the
    smallest and largest value inside (lo, hi]; and (MASS) the mass above zlo (+inf: not wanted). A block
    wholly at or below both adds to none of them and is skipped after its load (most of a peaked row,
    once lo has risen)."""
    offs0 = tl.arange(0, BLOCK)
    piv = lo + (hi - lo) * ((tl.arange(0, PIVOTS) + 1).to(tl.float32) / (PIVOTS + 1))
    acc = tl.zeros([PIVOTS, BLOCK], tl.float32)
    z = tl.zeros([BLOCK], tl.float32)
    amin = tl.full([BLOCK], float("inf"), tl.float32)
    amax = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        x = _load(base, start + offs0, V, floor)
        if tl.max(x, 0) > tl.minimum(lo, zlo):
            above = x[None, :] > piv[:, None]
            if MASS:
                e = tl.exp((x - m) * scale)
                z += tl.where(x > zlo, e, 0.0)
                acc += tl.where(above, e[None, :], 0.0)
            else:
                acc += above.to(tl.float32)
            inside = (x > lo) & (x <= hi)
            amin = tl.minimum(amin, tl.where(inside, x, float("inf")))
            amax = tl.maximum(amax, tl.where(inside, x, float("-inf")))
    return piv, tl.sum(acc, 1), tl.min(amin, 0), tl.max(amax, 0), tl.sum(z, 0)


@triton.jit
def _bisect(base, V, lo, hi, target, zlo, active, floor, m, scale, MASS: tl.constexpr, BLOCK: tl.constexpr,
            PIVOTS: tl.constexpr, MAX_ITERS: tl.constexpr):
    """The bracket (lo, hi] narrowed around the boundary: the count (or mass) above lo stays >= the goal
    and above hi stays < it. The goal is `target` (a count), or with MASS `target` times the mass above
    zlo (top-p's share of what min-p and top-k kept, summed in the first pass). Keeping x > lo is exact
    once one distinct value at most is left inside."""
    it = 0
    goal = target
    go = active
    while go:
        zlo_now = tl.where(it == 0, zlo, float("inf"))  # the kept mass, in the first pass only
        piv, above, amin, amax, z = _pivot_pass(base, V, lo, hi, zlo_now, floor, m, scale, MASS, BLOCK, PIVOTS)
        if MASS:
            goal = tl.where(it == 0, target * z, goal)
        many = amin < amax  # two distinct values inside: not resolved yet
        ok = above >= goal  # the pivots low enough (non-increasing "above": a prefix of the pivots)
        lo = tl.where(many, tl.max(tl.where(ok, piv, lo), 0), lo)
        hi = tl.where(many, tl.min(tl.where(ok, hi, piv), 0), hi)
        it += 1
        go = many & (it < MAX_ITERS)
    return lo


@triton.jit
def _sample_kernel(x_ptr, stride_x, V, temp_ptr, top_p_ptr, min_p_ptr, top_k_ptr, seed_ptr, counter_ptr, step_ptr,
                   out_ptr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr, MAX_ITERS: tl.constexpr, PDL: tl.constexpr):
    """Program r: row r's token (see the module docstring)."""
    gdc_begin(PDL)
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_x
    t = tl.load(temp_ptr + row)
    sampled = t > 0.0
    t = tl.where(sampled, t, 1.0)
    scale = 1.0 / t
    m, tok, lowest = _stats(base, V, BLOCK)
    min_p = tl.load(min_p_ptr + row)
    floor = tl.where(min_p > 0.0, m + t * tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))  # 0: no floor
    lo = lowest - (1.0 + tl.abs(lowest)) * 0.001  # below every finite token
    k = tl.load(top_k_ptr + row)
    lo = _bisect(base, V, lo, m, k.to(tl.float32), lo, sampled & (k > 0) & (k < V), floor, m, scale, False,
                 BLOCK, PIVOTS, MAX_ITERS)
    p = tl.load(top_p_ptr + row)
    # tokens below this carry less than half of the (1 - p) mass top-p drops (what is kept has mass >= 1,
    # the max token's): the boundary lies above it, so the bracket starts there
    start_p = tl.maximum(lo, m + tl.log(tl.maximum((1.0 - p) / (2.0 * V), 1e-30)) / scale)
    lo = _bisect(base, V, start_p, m, p, lo, sampled & (p < 1.0), floor, m, scale, True, BLOCK, PIVOTS,
                 MAX_ITERS)
    if sampled:
        k0, k1 = _row_keys(tl.load(seed_ptr + row), tl.load(counter_ptr + row), tl.load(step_ptr))
        offs0 = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], -1.0, tl.float32)
        best_i = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + offs0
            x = _load(base, offs, V, floor)
            if tl.max(x, 0) > lo:  # the noise of a block with no kept token is never looked at
                h = _mix32(_mix32(offs.to(tl.uint32) * 0x9E3779B9 + k0) ^ k1)
                v = (h.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 2**-32
                noise = tl.where(v < 0.015625, v * (1.0 + v * (0.5 + v * (0.33333334 + v * 0.25))),
                                 -tl.log(1.0 - v))
                score = tl.where(x > lo, tl.exp((x - m) * scale) / noise, -1.0)
                better = score > best
                best_i = tl.where(better, offs, best_i)
                best = tl.where(better, score, best)
        top = tl.max(best, 0)
        tok = tl.min(tl.where(best == top, best_i, V), 0)
    tl.store(out_ptr + row, tok)


_BLOCK = 1024  # vocabulary entries per step of a row's loop
_PIVOTS = 8  # per pass: each narrows the bracket ninefold
_MAX_ITERS = 8  # passes per threshold at most (float ties that never separate stop here)


def sample(logits: torch.Tensor, rows) -> torch.Tensor:
    """reference.sample for 2-D logits with a unit last stride (`rows` a kernel.SamplingRows)."""
    s, v = logits.shape
    out = torch.empty(s, dtype=torch.int32, device=logits.device)
    if s:
        block = min(_BLOCK, triton.next_power_of_2(v))
        _sample_kernel[(s,)](logits, logits.stride(0), v, rows.temperature, rows.top_p, rows.min_p, rows.top_k,
                             rows.seed, rows.counter, rows.step_seed, out, BLOCK=block, PIVOTS=_PIVOTS,
                             MAX_ITERS=_MAX_ITERS, PDL=pdl(logits), num_warps=8 if block >= 1024 else 4,
                             **launch_opts(logits))
    return out
