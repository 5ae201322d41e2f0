"""Sampling a whole batch in a few launches: temperature, min-p, top-k, top-p and per-request seeds.

No row is sorted. Every launch runs one program per (row, chunk of CHUNK tokens), so a batch of one row
still spreads over many SMs, and small per-row state passes between launches:
1. stats: each chunk's max (with its first index, the greedy token) and lowest finite logit;
2. top-k, then top-p, thresholds by multi-pivot bisection over the logit value: a pass counts (top-k) or
   sums the probability mass (top-p) above PIVOTS evenly spaced pivots inside the row's bracket (lo, hi]
   and finds the bracket's smallest and largest value; the next launch's programs each merge the row's
   chunks (the same arithmetic in every program, so they agree) and keep the sub-interval holding the
   boundary. A row stops once no two distinct values are left inside (exact: ties stay together);
   ITERS passes per threshold at most. A filter no row of the batch sets launches no pass; with
   neither, the draw takes each row's max and min-p floor from the stats itself;
3. the draw: per chunk the argmax of p / E over the kept tokens, E ~ Exp(1) from a counter-based hash of
   the row's keys and the token id (kernel/reference.py's formula), then the best chunk per row.
The torch reference (kernel/reference.py `sample`) computes the same kept set by sorting.

Top-p mostly skips its bisection (seven passes over the logits): after top-k, rounds alternate a race
that draws a candidate t among the tokens above the last rejected one and a pass that sums the mass
strictly above t. t is in the nucleus when that mass is below top_p times the kept mass, and then it is
the draw the bisection would give: the nucleus holds only tokens above a rejected candidate, and the
noise is the same, so the winner over a superset that lies in the nucleus wins in the nucleus too. A row
left unresolved after ROUNDS rounds (rare: each candidate is in the nucleus with probability >= top_p)
takes the bisection and the draw, which every other row skips."""

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
def _temperature(temp_ptr, row):
    """(whether the row samples, its temperature, 1 / temperature); a greedy row computes with T = 1."""
    t = tl.load(temp_ptr + row)
    sampled = t > 0.0
    t = tl.where(sampled, t, 1.0)
    return sampled, t, 1.0 / t


@triton.jit
def _pivots(lo, hi, PIVOTS: tl.constexpr):
    return lo + (hi - lo) * ((tl.arange(0, PIVOTS) + 1).to(tl.float32) / (PIVOTS + 1))


@triton.jit
def _stats_kernel(x_ptr, stride_x, V, spart_ptr, C, CHUNK: tl.constexpr, SUB: tl.constexpr, PDL: tl.constexpr):
    """Program (row, c): chunk c's max, the first index of it, and its lowest finite value."""
    gdc_begin(PDL)
    row, c = tl.program_id(0), tl.program_id(1)
    base = x_ptr + row.to(tl.int64) * stride_x
    best = tl.full([SUB], float("-inf"), tl.float32)
    best_i = tl.zeros([SUB], tl.int32)
    low = tl.full([SUB], float("inf"), tl.float32)
    for j in tl.static_range(CHUNK // SUB):
        offs = c * CHUNK + j * SUB + tl.arange(0, SUB)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        better = x > best  # strictly: a lane keeps the first index of its largest value
        best_i = tl.where(better, offs, best_i)
        best = tl.where(better, x, best)
        low = tl.minimum(low, tl.where(x > float("-inf"), x, float("inf")))
    m = tl.max(best, 0)
    out = spart_ptr + (row * C + c) * 4
    tl.store(out, m)
    tl.store(out + 1, tl.min(tl.where(best == m, best_i, V), 0).to(tl.float32))
    tl.store(out + 2, tl.min(low, 0))


@triton.jit
def _decide(state_ptr, part_ptr, row, C, PIVOTS: tl.constexpr, W: tl.constexpr, BLOCK_C: tl.constexpr):
    """The row's bracket (lo, hi, goal, still searching) after the previous pass, from its state and the
    partial sums of its chunks. State flag 2: the goal is a fraction of the mass the pass summed (top-p)."""
    sp = state_ptr + row * 4
    lo, hi, goal, flag = tl.load(sp), tl.load(sp + 1), tl.load(sp + 2), tl.load(sp + 3)
    above = tl.zeros([PIVOTS], tl.float32)
    amin = float("inf")
    amax = float("-inf")
    z = 0.0
    if flag > 0.0:  # a finished row's chunks wrote nothing: read nothing
        cc = tl.arange(0, BLOCK_C)
        rows = part_ptr + (row * C + cc) * W
        pmask = cc[:, None] < C
        above = tl.sum(tl.load(rows[:, None] + tl.arange(0, PIVOTS)[None, :], mask=pmask, other=0.0), 0)
        amin = tl.min(tl.load(rows + PIVOTS, mask=cc < C, other=float("inf")), 0)
        amax = tl.max(tl.load(rows + PIVOTS + 1, mask=cc < C, other=float("-inf")), 0)
        z = tl.sum(tl.load(rows + PIVOTS + 2, mask=cc < C, other=0.0), 0)
    goal = tl.where(flag == 2.0, goal * z, goal)
    piv = _pivots(lo, hi, PIVOTS)
    many = (flag > 0.0) & (amin < amax)  # two distinct values inside: not resolved yet
    ok = above >= goal  # the pivots low enough (non-increasing "above": a prefix of the pivots)
    lo = tl.where(many, tl.max(tl.where(ok, piv, lo), 0), lo)
    hi = tl.where(many, tl.min(tl.where(ok, hi, piv), 0), hi)
    return lo, hi, goal, many


@triton.jit
def _chunk_pass(base, c, V, lo, hi, zlo, floor, m, scale, part, MASS: tl.constexpr, CHUNK: tl.constexpr,
                SUB: tl.constexpr, PIVOTS: tl.constexpr):
    """Chunk c's pivot pass into `part`: at PIVOTS points evenly inside (lo, hi), the count (MASS False)
    or the probability mass (MASS True, exp((x - max) / T)) strictly above; the smallest and largest value
    inside (lo, hi]; and (MASS) the mass above zlo (+inf: not wanted)."""
    piv = _pivots(lo, hi, PIVOTS)
    # per-lane sums, reduced once at the end (a reduction per block would cost as much as the sums)
    above = tl.zeros([PIVOTS, SUB], tl.float32)
    z = tl.zeros([SUB], tl.float32)
    amin = tl.full([SUB], float("inf"), tl.float32)
    amax = tl.full([SUB], float("-inf"), tl.float32)
    for j in tl.static_range(CHUNK // SUB):
        x = _load(base, c * CHUNK + j * SUB + tl.arange(0, SUB), V, floor)
        if tl.max(x, 0) > tl.minimum(lo, zlo):  # a block wholly below adds nothing
            gt = x[None, :] > piv[:, None]
            if MASS:
                e = tl.exp((x - m) * scale)
                z += tl.where(x > zlo, e, 0.0)
                above += tl.where(gt, e[None, :], 0.0)
            else:
                above += gt.to(tl.float32)
            inside = (x > lo) & (x <= hi)
            amin = tl.minimum(amin, tl.where(inside, x, float("inf")))
            amax = tl.maximum(amax, tl.where(inside, x, float("-inf")))
    tl.store(part + tl.arange(0, PIVOTS), tl.sum(above, 1))
    tl.store(part + PIVOTS, tl.min(amin, 0))
    tl.store(part + PIVOTS + 1, tl.max(amax, 0))
    tl.store(part + PIVOTS + 2, tl.sum(z, 0))


@triton.jit
def _row_stats(spart_ptr, min_p_ptr, info_ptr, row, c, C, V, t, BLOCK_C: tl.constexpr):
    """The row's max m, its min-p floor (-inf: none) and a value below every finite token, from its
    chunks' stats; chunk 0 stores m, the floor and the greedy token (the first index of m) in info."""
    cc = tl.arange(0, BLOCK_C)
    stats = spart_ptr + (row * C + cc) * 4
    maxes = tl.load(stats, mask=cc < C, other=float("-inf"))
    m = tl.max(maxes, 0)
    tok = tl.min(tl.where(maxes == m, tl.load(stats + 1, mask=cc < C, other=V), V), 0)
    lowest = tl.min(tl.load(stats + 2, mask=cc < C, other=float("inf")), 0)
    min_p = tl.load(min_p_ptr + row)
    floor = tl.where(min_p > 0.0, m + t * tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))  # 0: none
    tl.store(info_ptr + row * 4, m, mask=c == 0)
    tl.store(info_ptr + row * 4 + 1, floor, mask=c == 0)
    tl.store(info_ptr + row * 4 + 2, tok, mask=c == 0)
    return m, floor, lowest - (1.0 + tl.abs(lowest)) * 0.001


@triton.jit
def _search_kernel(x_ptr, stride_x, V, temp_ptr, top_p_ptr, min_p_ptr, top_k_ptr, spart_ptr, info_ptr, state_in,
                   state_out, part_in, part_out, fin_ptr, C, START: tl.constexpr, MASS: tl.constexpr,
                   CHUNK: tl.constexpr, SUB: tl.constexpr, PIVOTS: tl.constexpr, W: tl.constexpr,
                   BLOCK_C: tl.constexpr, ROUNDS: tl.constexpr, PDL: tl.constexpr):
    """Program (row, c): the row's bracket after the previous launch (START 0: the first top-k bracket from
    the stats; 1: the previous pass decided; 2: top-k decided, the first top-p bracket, for a row the
    rounds left unresolved where ROUNDS), stored by chunk 0, then chunk c's pivot pass while the row still
    searches."""
    gdc_begin(PDL)
    row, c = tl.program_id(0), tl.program_id(1)
    sampled, t, scale = _temperature(temp_ptr, row)
    zlo = float("inf")  # the kept mass is summed in top-p's first pass only
    if START == 0:
        m, floor, lo = _row_stats(spart_ptr, min_p_ptr, info_ptr, row, c, C, V, t, BLOCK_C)
        hi = m
        k = tl.load(top_k_ptr + row)
        goal = k.to(tl.float32)
        active = sampled & (k > 0) & (k < V)
        flag = tl.where(active, 1.0, 0.0)
    else:
        m, floor = tl.load(info_ptr + row * 4), tl.load(info_ptr + row * 4 + 1)
        lo, hi, goal, active = _decide(state_in, part_in, row, C, PIVOTS, W, BLOCK_C)
        flag = tl.where(active, 1.0, 0.0)
        if START == 2:
            p = tl.load(top_p_ptr + row)
            active = sampled & (p < 1.0)
            if ROUNDS:
                active = active & (tl.load(fin_ptr + row * 8) == 2.0)
            zlo = lo  # top-p takes its share of what min-p and top-k kept
            # tokens below this carry less than half of the (1 - p) mass top-p drops (what is kept has mass
            # >= 1, the max token's): the boundary lies above it, so the bracket starts there
            start = tl.maximum(lo, m + tl.log(tl.maximum((1.0 - p) / (2.0 * V), 1e-30)) / scale)
            lo = tl.where(active, start, lo)
            hi = m
            goal = p
            flag = tl.where(active, 2.0, 0.0)
    out = state_out + row * 4
    tl.store(out, lo, mask=c == 0)
    tl.store(out + 1, hi, mask=c == 0)
    tl.store(out + 2, goal, mask=c == 0)
    tl.store(out + 3, flag, mask=c == 0)
    if active:
        _chunk_pass(x_ptr + row.to(tl.int64) * stride_x, c, V, lo, hi, zlo, floor, m, scale,
                    part_out + (row * C + c) * W, MASS, CHUNK, SUB, PIVOTS)


@triton.jit
def _race(x, offs, lo, m, scale, k0, k1):
    """A block's p = exp((x - max) / T) and race scores p / E of its tokens above lo (-1 elsewhere)."""
    h = _mix32(_mix32(offs.to(tl.uint32) * 0x9E3779B9 + k0) ^ k1)
    v = (h.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 2**-32
    noise = tl.where(v < 0.015625, v * (1.0 + v * (0.5 + v * (0.33333334 + v * 0.25))), -tl.log(1.0 - v))
    e = tl.exp((x - m) * scale)
    return e, tl.where(x > lo, e / noise, -1.0)


@triton.jit
def _draw_kernel(x_ptr, stride_x, V, temp_ptr, seed_ptr, counter_ptr, step_ptr, info_ptr, state_in, part_in,
                 dpart_ptr, fin_ptr, spart_ptr, min_p_ptr, C, CHUNK: tl.constexpr, SUB: tl.constexpr,
                 PIVOTS: tl.constexpr, W: tl.constexpr, BLOCK_C: tl.constexpr, ROUNDS: tl.constexpr,
                 STATS: tl.constexpr, PDL: tl.constexpr):
    """Program (row, c): the final bracket, then chunk c's best p / E over the kept tokens and its index
    (ROUNDS: only for a row the top-p rounds left unresolved). STATS: no search ran (no row sets top-k
    or top-p): the row's max, floor and bracket come from the stats, as the first search pass takes them."""
    gdc_begin(PDL)
    row, c = tl.program_id(0), tl.program_id(1)
    sampled, t, scale = _temperature(temp_ptr, row)
    if STATS:
        m, floor, lo = _row_stats(spart_ptr, min_p_ptr, info_ptr, row, c, C, V, t, BLOCK_C)
    if ROUNDS:
        sampled = sampled & (tl.load(fin_ptr + row * 8) == 2.0)
    best = tl.full([SUB], -1.0, tl.float32)
    best_i = tl.zeros([SUB], tl.int32)
    if sampled:
        if not STATS:
            m, floor = tl.load(info_ptr + row * 4), tl.load(info_ptr + row * 4 + 1)
            lo, _hi, _goal, _many = _decide(state_in, part_in, row, C, PIVOTS, W, BLOCK_C)
        k0, k1 = _row_keys(tl.load(seed_ptr + row), tl.load(counter_ptr + row), tl.load(step_ptr))
        base = x_ptr + row.to(tl.int64) * stride_x
        for j in tl.static_range(CHUNK // SUB):
            offs = c * CHUNK + j * SUB + tl.arange(0, SUB)
            x = _load(base, offs, V, floor)
            if tl.max(x, 0) > lo:  # the noise of a block with no kept token is never looked at
                _e, score = _race(x, offs, lo, m, scale, k0, k1)
                better = score > best
                best_i = tl.where(better, offs, best_i)
                best = tl.where(better, score, best)
    top = tl.max(best, 0)
    out = dpart_ptr + (row * C + c) * 2
    tl.store(out, top)
    tl.store(out + 1, tl.min(tl.where(best == top, best_i, V), 0).to(tl.float32))


@triton.jit
def _settle(base, state_ptr, part_ptr, top_p_ptr, row, C, V, RACED: tl.constexpr, BLOCK_C: tl.constexpr):
    """A row's top-p state after a round: (status 0 greedy, 1 resolved, 2 searching; the kept mass; the
    candidate's index and value). After a race (RACED) its winner is the candidate (after the first race,
    which also summed the kept mass, a row without top-p is resolved by it); after a mass pass the
    candidate stays if the mass above it is below top_p of the kept mass (resolved), and else its value
    bounds the next race."""
    sp = state_ptr + row * 8
    status, z, cand_i, cand, first = tl.load(sp), tl.load(sp + 1), tl.load(sp + 2), tl.load(sp + 3), tl.load(sp + 4)
    if status == 2.0:
        cc = tl.arange(0, BLOCK_C)
        parts = part_ptr + (row * C + cc) * 4
        mass = tl.sum(tl.load(parts + 2, mask=cc < C, other=0.0), 0)
        p = tl.load(top_p_ptr + row)
        if RACED:
            scores = tl.load(parts, mask=cc < C, other=-2.0)
            top = tl.max(scores, 0)
            cand_i = tl.min(tl.where(scores == top, tl.load(parts + 1, mask=cc < C, other=V), V), 0)
            cand = tl.load(base + cand_i.to(tl.int32), mask=cand_i < V, other=float("-inf")).to(tl.float32)
            z = tl.where(first == 1.0, mass, z)
            done = (first == 1.0) & (p >= 1.0)
        else:
            done = mass < p * z
        status = tl.where(done, 1.0, 2.0)
    return status, z, cand_i, cand


@triton.jit
def _round_kernel(x_ptr, stride_x, V, temp_ptr, top_p_ptr, seed_ptr, counter_ptr, step_ptr, info_ptr, kstate,
                  kpart, rs_in, rp_in, rs_out, rp_out, C, FIRST: tl.constexpr, RACE: tl.constexpr,
                  RACED: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, PIVOTS: tl.constexpr, W: tl.constexpr,
                  BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """Program (row, c): a top-p round. The row's state after the previous round (FIRST: top-k's kept set
    as the bound), stored by chunk 0; then, while the row searches, over chunk c's tokens above the
    candidate (or bound): the race (RACE) and their mass."""
    gdc_begin(PDL)
    row, c = tl.program_id(0), tl.program_id(1)
    sampled, _t, scale = _temperature(temp_ptr, row)
    base = x_ptr + row.to(tl.int64) * stride_x
    if FIRST:
        lo, _hi, _goal, _many = _decide(kstate, kpart, row, C, PIVOTS, W, BLOCK_C)
        status = tl.where(sampled, 2.0, 0.0)
        z = 0.0
        cand_i = 0.0
        cand = lo
        first = 1.0
    else:
        status, z, cand_i, cand = _settle(base, rs_in, rp_in, top_p_ptr, row, C, V, RACED, BLOCK_C)
        first = 0.0
    out = rs_out + row * 8
    tl.store(out, status, mask=c == 0)
    tl.store(out + 1, z, mask=c == 0)
    tl.store(out + 2, cand_i, mask=c == 0)
    tl.store(out + 3, cand, mask=c == 0)
    tl.store(out + 4, first, mask=c == 0)
    if status == 2.0:
        m, floor = tl.load(info_ptr + row * 4), tl.load(info_ptr + row * 4 + 1)
        k0, k1 = _row_keys(tl.load(seed_ptr + row), tl.load(counter_ptr + row), tl.load(step_ptr))
        best = tl.full([SUB], -1.0, tl.float32)
        best_i = tl.zeros([SUB], tl.int32)
        mass = tl.zeros([SUB], tl.float32)
        for j in tl.static_range(CHUNK // SUB):
            offs = c * CHUNK + j * SUB + tl.arange(0, SUB)
            x = _load(base, offs, V, floor)
            if tl.max(x, 0) > cand:  # a block with nothing above the candidate is only read
                if RACE:
                    e, score = _race(x, offs, cand, m, scale, k0, k1)
                    better = score > best
                    best_i = tl.where(better, offs, best_i)
                    best = tl.where(better, score, best)
                else:
                    e = tl.exp((x - m) * scale)
                mass += tl.where(x > cand, e, 0.0)
        part = rp_out + (row * C + c) * 4
        if RACE:
            top = tl.max(best, 0)
            tl.store(part, top)
            tl.store(part + 1, tl.min(tl.where(best == top, best_i, V), 0).to(tl.float32))
        tl.store(part + 2, tl.sum(mass, 0))


@triton.jit
def _settle_kernel(x_ptr, stride_x, V, top_p_ptr, rs_in, rp_in, fin_ptr, C, BLOCK_C: tl.constexpr,
                   PDL: tl.constexpr):
    """Program r: the row's state after the last round (a mass pass), for the bisection, the draw and the
    pick."""
    gdc_begin(PDL)
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_x
    status, _z, cand_i, _cand = _settle(base, rs_in, rp_in, top_p_ptr, row, C, V, False, BLOCK_C)
    out = fin_ptr + row * 8
    tl.store(out, status)
    tl.store(out + 2, cand_i)


@triton.jit
def _pick_kernel(temp_ptr, info_ptr, dpart_ptr, fin_ptr, out_ptr, C, V, BLOCK_C: tl.constexpr,
                 ROUNDS: tl.constexpr, PDL: tl.constexpr):
    """Program r: the first index of the best chunk's draw, the token the rounds resolved, or the greedy
    token."""
    gdc_begin(PDL)
    row = tl.program_id(0)
    cc = tl.arange(0, BLOCK_C)
    parts = dpart_ptr + (row * C + cc) * 2
    scores = tl.load(parts, mask=cc < C, other=-2.0)
    top = tl.max(scores, 0)
    drawn = tl.min(tl.where(scores == top, tl.load(parts + 1, mask=cc < C, other=V), V), 0)
    if ROUNDS:
        drawn = tl.where(tl.load(fin_ptr + row * 8) == 1.0, tl.load(fin_ptr + row * 8 + 2), drawn)
    tok = tl.where(tl.load(temp_ptr + row) > 0.0, drawn, tl.load(info_ptr + row * 4 + 2))
    tl.store(out_ptr + row, tok.to(tl.int32))


_CHUNK = 4096  # tokens per program: a row of 151,936 spreads over 38 programs
_SUB = 1024  # tokens per step inside a program
_PIVOTS = 8  # per pass: each narrows the bracket ninefold
_ITERS = 7  # passes per threshold (a float tie that never separates stops there)
_ROUNDS = 4  # top-p rounds, race and mass in turn: two candidates, both rejected with probability <= (1 - top_p)^2


def _rounds(logits, rows, info, kstate, kpart, fin, rounds: int, c: int, shape: dict, w: int) -> None:
    """The top-p rounds after top-k (its final state and partial sums in kstate / kpart), their outcome
    per row into fin. `rounds` is even: the last one sums the mass above a candidate."""
    s, v = logits.shape
    assert rounds % 2 == 0, rounds
    rs = torch.empty(rounds, s, 8, dtype=torch.float32, device=logits.device)
    rp = torch.empty(rounds, s, c, 4, dtype=torch.float32, device=logits.device)
    block_c = triton.next_power_of_2(c)
    for j in range(rounds):
        _round_kernel[(s, c)](logits, logits.stride(0), v, rows.temperature, rows.top_p, rows.seed, rows.counter,
                              rows.step_seed, info, kstate, kpart, rs[j - 1], rp[j - 1], rs[j], rp[j], c,
                              FIRST=j == 0, RACE=j % 2 == 0, RACED=j % 2 == 1, PIVOTS=_PIVOTS, W=w, BLOCK_C=block_c, **shape)
    _settle_kernel[(s,)](logits, logits.stride(0), v, rows.top_p, rs[-1], rp[-1], fin, c, BLOCK_C=block_c,
                         PDL=shape["PDL"], num_warps=1, **launch_opts(logits))


def sample(logits: torch.Tensor, rows, chunk: int = _CHUNK) -> torch.Tensor:
    """reference.sample for 2-D logits with a unit last stride (`rows` a kernel.SamplingRows): a fixed
    sequence of launches, no host synchronisation, so a CUDA graph captures it. `chunk`: tokens per
    program (a power of two; the tests make rows span several)."""
    s, v = logits.shape
    out = torch.empty(s, dtype=torch.int32, device=logits.device)
    if not s:
        return out
    chunk = min(chunk, triton.next_power_of_2(v))
    sub = min(_SUB, chunk)
    c = triton.cdiv(v, chunk)
    w = triton.next_power_of_2(_PIVOTS + 3)
    dev, f32 = logits.device, torch.float32
    spart, info = torch.empty(s, c, 4, dtype=f32, device=dev), torch.empty(s, 4, dtype=f32, device=dev)
    state, part = torch.empty(2, s, 4, dtype=f32, device=dev), torch.empty(2, s, c, w, dtype=f32, device=dev)
    dpart = torch.empty(s, c, 2, dtype=f32, device=dev)
    grid, shape = (s, c), dict(CHUNK=chunk, SUB=sub, PDL=pdl(logits), num_warps=4, **launch_opts(logits))
    _stats_kernel[grid](logits, logits.stride(0), v, spart, c, **shape)
    rounds = _ROUNDS if rows.has_top_p else 0
    fin = torch.empty(s, 8, dtype=f32, device=dev)
    passes = []  # (START, MASS) of each search launch; none where no row sets top-k or top-p
    if rows.has_top_k or rows.has_top_p:
        passes = [(0, False)] + [(1, False)] * ((_ITERS - 1) if rows.has_top_k else 0)
    n_k, block_c = len(passes), triton.next_power_of_2(c)
    if rows.has_top_p:
        passes += [(2, True)] + [(1, True)] * (_ITERS - 1)
    search = dict(shape, num_warps=8)  # 4 tokens a thread: room for the per-lane pivot sums
    for i, (start, mass) in enumerate(passes):
        if i == n_k and rounds:
            _rounds(logits, rows, info, state[(i + 1) % 2], part[(i + 1) % 2], fin, rounds, c, shape, w)
        _search_kernel[grid](logits, logits.stride(0), v, rows.temperature, rows.top_p, rows.min_p, rows.top_k,
                             spart, info, state[(i + 1) % 2], state[i % 2], part[(i + 1) % 2], part[i % 2], fin, c,
                             START=start, MASS=mass, PIVOTS=_PIVOTS, W=w, BLOCK_C=block_c, ROUNDS=rounds > 0,
                             **search)
    last = (len(passes) - 1) % 2
    _draw_kernel[grid](logits, logits.stride(0), v, rows.temperature, rows.seed, rows.counter, rows.step_seed, info,
                       state[last], part[last], dpart, fin, spart, rows.min_p, c, PIVOTS=_PIVOTS, W=w,
                       BLOCK_C=block_c, ROUNDS=rounds > 0, STATS=not passes, **shape)
    _pick_kernel[(s,)](rows.temperature, info, dpart, fin, out, c, v, BLOCK_C=block_c, ROUNDS=rounds > 0,
                       PDL=pdl(logits), num_warps=1, **launch_opts(logits))
    return out
