"""Fused mixture-of-experts: the routing (softmax, top-k, renormalisation per row) and the experts' gated MLPs,
as reference.moe_route and reference.fused_moe.

fused_moe runs five kernels (three for one token, whose k choices are distinct experts: nothing to align),
none of which synchronises with the host, with grids that depend on the number of tokens only (never on the
routing), so decode and prefill CUDA graphs capture them:
1. align (two launches: counts per chunk of pairs, then the placement): the T * k (token, choice) pairs
   sorted by local expert, each expert's list padded with a sentinel to a whole number of BLOCK_M rows; it
   writes each block's expert and the padded row count;
2. gate/up: a grouped GEMM over those blocks (block b multiplies by its expert's w13) with SiLU-and-mul in
   its epilogue, into act [padded rows, I] in x's dtype;
3. down: a grouped GEMM of act by w2 with the routing weight applied to its float32 accumulator, each
   (token, choice) pair's row written to a float32 buffer (K may be split: one part per split);
4. sum: per token, the parts of its k choices that this rank holds, rounded once to x's dtype.
The buffers have their worst-case sizes; GEMM programs past the padded row count return at once, so experts
that receive no token cost nothing. Tiles come per (local experts, H, I, k, tokens, device) from
moe_configs.json (written by `python -m minisgl.benchmark.tune_moe`), else from moe_config()'s heuristic."""

from __future__ import annotations

import functools
import json
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .activation import silu_mul
from .launch import gdc_begin, launch_opts, pdl

CONFIG_FILE = os.path.join(os.path.dirname(__file__), "moe_configs.json")


# ---- routing ----------------------------------------------------------------------------------------------
@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_l, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One row: softmax over the E experts in float32, its TOP_K largest (the first index on ties), divided by
    their sum when RENORM."""
    gdc_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(mask, p / tl.sum(p, axis=0), -1.0)  # -1: below every probability, never picked
    offs_k = tl.arange(0, BLOCK_K)
    vals = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        at = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)
        vals = tl.where(offs_k == j, best, vals)
        ids = tl.where(offs_k == j, at, ids)
        p = tl.where(offs == at, -2.0, p)
    if RENORM:
        vals = vals / tl.sum(vals, axis=0)
    k_mask = offs_k < TOP_K
    tl.store(w_ptr + row * TOP_K + offs_k, vals, mask=k_mask)
    tl.store(ids_ptr + row * TOP_K + offs_k, ids, mask=k_mask)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int32) of router_logits [T, E], as reference.moe_route."""
    t, e = router_logits.shape
    assert 1 <= top_k <= e and router_logits.stride(-1) == 1
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=router_logits.device)
    if t:
        block_e = triton.next_power_of_2(e)
        _route_kernel[(t,)](router_logits, weights, ids, e, router_logits.stride(0), TOP_K=top_k,
                            RENORM=renormalize, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
                            PDL=pdl(router_logits), num_warps=max(1, min(8, block_e // 128)),
                            **launch_opts(router_logits))
    return weights, ids


# ---- 1. align: (token, choice) pairs sorted by expert, padded to blocks -------------------------------------
@triton.jit
def _onehot(ids_ptr, c0, M, expert_start, EL, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """[BLOCK_E, CHUNK] int32: pair c0 + i is routed to local expert e (ids outside the local range: none).
    Experts along the first axis, so that the scans below run along the last."""
    offs = c0 + tl.arange(0, CHUNK)
    local = tl.load(ids_ptr + offs, mask=offs < M, other=-1) - expert_start
    local = tl.where((local >= 0) & (local < EL), local, -1)
    return (tl.arange(0, BLOCK_E)[:, None] == local[None, :]).to(tl.int32)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, M, expert_start, EL, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                  PDL: tl.constexpr):
    """Program p: how many of the pairs p * CHUNK ... (p + 1) * CHUNK - 1 go to each local expert."""
    gdc_begin(PDL)
    p = tl.program_id(0)
    counts = tl.sum(_onehot(ids_ptr, p * CHUNK, M, expert_start, EL, CHUNK, BLOCK_E), axis=1)
    tl.store(counts_ptr + p * BLOCK_E + tl.arange(0, BLOCK_E), counts)


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, sorted_ptr, expert_ptr, total_ptr, M, P, expert_start, EL,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr,
                  PDL: tl.constexpr):
    """Program p: from every chunk's counts, lay the experts' lists out one after the other, each padded to
    whole BLOCK_M blocks, and place chunk p's pairs (flat index t * k + j) in their experts' lists after the
    earlier chunks' (pair order: the layout is the same on every run, without atomics). Program 0 also
    writes the padding (the sentinel M), every block's expert and the padded row count."""
    gdc_begin(PDL)
    p = tl.program_id(0)
    total_e = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)  # pairs of earlier chunks, per expert
    experts = tl.arange(0, BLOCK_E)
    for r0 in range(0, P, BLOCK_P):
        rows = r0 + tl.arange(0, BLOCK_P)
        c = tl.load(counts_ptr + rows[:, None] * BLOCK_E + experts[None, :], mask=rows[:, None] < P, other=0)
        total_e += tl.sum(c, axis=0)
        before += tl.sum(tl.where(rows[:, None] < p, c, 0), axis=0)
    padded = tl.cdiv(total_e, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    onehot = _onehot(ids_ptr, p * CHUNK, M, expert_start, EL, CHUNK, BLOCK_E)
    rank = tl.cumsum(onehot, axis=1) - onehot  # earlier pairs of the chunk with the same expert
    pos = tl.sum(onehot * (starts[:, None] + before[:, None] + rank), axis=0)
    pairs = p * CHUNK + tl.arange(0, CHUNK)
    tl.store(sorted_ptr + pos, pairs, mask=tl.sum(onehot, axis=0) > 0)
    if p == 0:
        total = tl.sum(padded, axis=0)
        tl.store(total_ptr, total)
        pad = starts[:, None] + total_e[:, None] + tl.arange(0, BLOCK_M)[None, :]  # each last block's tail
        tl.store(sorted_ptr + pad, tl.zeros(pad.shape, dtype=tl.int32) + M, mask=pad < ends[:, None])
        for b0 in range(0, total // BLOCK_M, CHUNK):
            blocks = b0 + tl.arange(0, CHUNK)
            expert = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
            tl.store(expert_ptr + blocks, expert, mask=blocks * BLOCK_M < total)


# ---- 2./3. the grouped GEMMs --------------------------------------------------------------------------------
@triton.jit
def _tile(NUM_M, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(m block, n block) of this program: GROUP_M m blocks walk the n blocks together, so neighbouring
    programs share weight tiles in L2."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size = tl.minimum(NUM_M - first_m, GROUP_M)
    return first_m + (pid % group) % size, (pid % group) // size


@triton.jit
def _dot(a, b, acc, EXACT: tl.constexpr):
    """acc + a b; EXACT: in float32 arithmetic (float32 inputs not as TF32; on CPU tensors, in Triton's
    interpreter, whose half-precision dot gives wrong sums, half inputs upcast exactly)."""
    if EXACT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _block_rows(sorted_ptr, expert_ptr, total_ptr, ids_ptr, pid_m, M, expert_start, EL, BLOCK_M: tl.constexpr):
    """(live, rows, pairs, local expert) of m block pid_m: its rows of the sorted, padded list and their pairs
    (M: padding). Without sorted_ptr (one token, whose k choices are distinct experts: no align) block j
    holds choice j alone. Not live: past the padded row count, or a choice another rank holds."""
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if sorted_ptr is None:
        expert = tl.load(ids_ptr + pid_m) - expert_start
        live = (expert >= 0) & (expert < EL)
        pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, M)
    else:
        live = pid_m * BLOCK_M < tl.load(total_ptr)
        pair = tl.load(sorted_ptr + offs_r)
        expert = tl.load(expert_ptr + pid_m)
    return live, offs_r, pair, expert.to(tl.int64)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_ptr, expert_ptr, total_ptr, ids_ptr, expert_start, EL, M, N,
                    K, NUM_M, stride_xm, stride_we, stride_wn, stride_am, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EXACT: tl.constexpr,
                    PDL: tl.constexpr):
    """act[r, n block] = silu(x[t] g_e^T) * (x[t] u_e^T) for the BLOCK_M sorted rows r of an m block (t the
    token of row r's pair, e the block's expert; g_e and u_e: rows 0..N-1 and N..2N-1 of w13[e]). The gate
    and up products round to x's dtype before the SiLU-and-mul, as a separate projection would; padding
    rows read zeros."""
    pid_m, pid_n = _tile(NUM_M, N, BLOCK_N, GROUP_M)
    gdc_begin(PDL)
    live, offs_r, pair, expert = _block_rows(sorted_ptr, expert_ptr, total_ptr, ids_ptr, pid_m, M, expert_start, EL,
                                             BLOCK_M)
    if live == 0:  # past the padded rows, or (one token) held by another rank
        return
    valid = pair < M
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        x = tl.load(x_ptrs + k0, mask=valid[:, None] & k_mask[None, :], other=0.0)
        g = tl.load(g_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        u = tl.load(u_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc_g = _dot(x, g, acc_g, EXACT)
        acc_u = _dot(x, u, acc_u, EXACT)
    dtype = act_ptr.dtype.element_ty
    act = silu_mul(acc_g.to(dtype), acc_u.to(dtype))
    tl.store(act_ptr + offs_r.to(tl.int64)[:, None] * stride_am + offs_n[None, :], act, mask=n_mask[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, part_ptr, weight_ptr, sorted_ptr, expert_ptr, total_ptr, ids_ptr, expert_start, EL,
                 M, N, K, NUM_M, stride_am, stride_we, stride_wn, K_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr):
    """part[s, pair, n block] = routing weight of the pair * act[r, K slice s] w2[e, n block, K slice s]^T in
    float32, for the BLOCK_M sorted rows r of an m block (padding rows are not stored)."""
    pid_m, pid_n = _tile(NUM_M, N, BLOCK_N, GROUP_M)
    pid_s = tl.program_id(1)
    gdc_begin(PDL)
    live, offs_r, pair, expert = _block_rows(sorted_ptr, expert_ptr, total_ptr, ids_ptr, pid_m, M, expert_start, EL,
                                             BLOCK_M)
    if live == 0:  # past the padded rows, or (one token) held by another rank
        return
    valid = pair < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + offs_r.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_hi - k_lo, BLOCK_K):
        k_mask = offs_k < k_hi - k0
        a = tl.load(a_ptrs + k0, mask=k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _dot(a, b, acc, EXACT)
    acc *= tl.load(weight_ptr + pair, mask=valid, other=0.0)[:, None]
    rows = (pid_s * M + pair).to(tl.int64)
    tl.store(part_ptr + rows[:, None] * N + offs_n[None, :], acc, mask=valid[:, None] & n_mask[None, :])


# ---- 4. the sum over the k choices --------------------------------------------------------------------------
@triton.jit
def _sum_kernel(part_ptr, ids_ptr, out_ptr, M, N, expert_start, EL, TOP_K: tl.constexpr, BLOCK_J: tl.constexpr,
                SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """out[t, n block] = the sum of the parts of token t's choices whose expert this rank holds (the rows of
    the others were never written), rounded once to out's dtype."""
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    gdc_begin(PDL)
    offs_j = tl.arange(0, BLOCK_J)
    local = tl.load(ids_ptr + t * TOP_K + offs_j, mask=offs_j < TOP_K, other=0) - expert_start
    held = (offs_j < TOP_K) & (local >= 0) & (local < EL)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        rows = (s * M + t * TOP_K + offs_j).to(tl.int64)
        parts = tl.load(part_ptr + rows[:, None] * N + offs_n[None, :], mask=held[:, None] & n_mask[None, :],
                        other=0.0)
        acc += tl.sum(parts, axis=0)
    tl.store(out_ptr + t.to(tl.int64) * N + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


# ---- tiles ----------------------------------------------------------------------------------------------------
# A config: BLOCK_M (shared by both GEMMs: the align pads to it) and per GEMM its tiles and launch options;
# the down GEMM also splits K into SPLIT_K slices (more programs at few tokens).
GEMM_KEYS = ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


def shape_key(experts: int, hidden: int, inter: int, top_k: int) -> str:
    """The key of a layer shape in moe_configs.json: local experts, H, I (per rank), k."""
    return f"E={experts},H={hidden},I={inter},k={top_k}"


@functools.cache
def _table() -> dict:
    """moe_configs.json: device name -> shape key -> tokens (as a string) -> config."""
    try:
        with open(CONFIG_FILE) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def default_config(experts: int, hidden: int, inter: int, top_k: int, tokens: int) -> dict:
    """The tiles where the table has no entry, from the rows an expert gets on average: few rows, small
    BLOCK_M with narrow N tiles (many programs stream the weights) and a split K for the down GEMM; many
    rows, larger tiles that reuse each weight tile over more rows."""
    pairs = tokens * top_k
    rows = pairs / max(1, min(experts, pairs))
    if rows <= 16:
        block_m, gate_up, down = 16, (32, 128, 1, 4, 4), (64, 128, 1, 4, 4)
    elif rows <= 64:
        block_m, gate_up, down = 32, (64, 64, 4, 4, 4), (64, 64, 4, 4, 4)
    else:
        block_m, gate_up, down = 64, (128, 64, 8, 8, 3), (128, 64, 8, 8, 3)
    # split the down GEMM's K while its programs would not give each SM of a large GPU (132 on an H200)
    # about four to balance, and each slice keeps at least one K block
    programs = min(pairs, experts) * triton.cdiv(max(1, round(rows)), block_m) * triton.cdiv(hidden, down[0])
    split = 1
    while split < 8 and programs * split < 512 and inter // (2 * split) >= down[1]:
        split *= 2
    return {"BLOCK_M": block_m, "gate_up": dict(zip(GEMM_KEYS, gate_up)),
            "down": dict(zip(GEMM_KEYS, down), SPLIT_K=split)}


@functools.lru_cache(maxsize=4096)
def moe_config(device_name: str, experts: int, hidden: int, inter: int, top_k: int, tokens: int) -> dict:
    """The tiles for a layer shape at a token count: the table's entry for the device and shape at the
    smallest tuned token count >= tokens (else the largest), or default_config()."""
    tuned = _table().get(device_name, {}).get(shape_key(experts, hidden, inter, top_k))
    if not tuned:
        return default_config(experts, hidden, inter, top_k, tokens)
    counts = sorted(int(t) for t in tuned)
    at = next((t for t in counts if t >= tokens), counts[-1])
    return tuned[str(at)]


def _exact(x: torch.Tensor) -> bool:
    """Whether the GEMMs multiply in float32 arithmetic: float32 inputs, or CPU tensors (the interpreter)."""
    return x.dtype == torch.float32 or not x.is_cuda


def _device_name(x: torch.Tensor) -> str:
    return torch.cuda.get_device_name(x.device) if x.is_cuda else "cpu"


# ---- launches -----------------------------------------------------------------------------------------------
def max_blocks(pairs: int, experts: int, block_m: int) -> int:
    """The most BLOCK_M blocks the align can fill: each nonempty expert pads at most block_m - 1 rows, and
    every block holds at least one pair."""
    return min(pairs, (pairs + min(experts, pairs) * (block_m - 1)) // block_m)


class Aligned(NamedTuple):
    """The routing as the GEMMs read it: see _place_kernel; sorted_ids None: one token, block j = choice j."""

    sorted_ids: torch.Tensor | None  # [blocks * block_m] int32 pairs (t * k + j) by expert, padded
    expert_ids: torch.Tensor | None  # [blocks] int32 each block's local expert
    total: torch.Tensor | None  # [1] int32 the padded row count (rows past it are left unwritten)
    topk_ids: torch.Tensor  # [T, k] int32
    expert_start: int
    experts: int  # held here
    blocks: int  # the grid's m blocks (the most the routing can fill)


def align(topk_ids: torch.Tensor, experts: int, block_m: int, expert_start: int = 0) -> Aligned:
    """Step 1: the (token, choice) pairs of topk_ids [T, k] sorted by held expert in padded blocks (see
    _count_kernel and _place_kernel, a program per chunk of pairs); for one token nothing to sort (its
    choices are distinct experts)."""
    if topk_ids.shape[0] == 1:
        return Aligned(None, None, None, topk_ids, expert_start, experts, topk_ids.shape[1])
    pairs = topk_ids.numel()
    blocks = max_blocks(pairs, experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(blocks, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    block_e = triton.next_power_of_2(experts)
    chunk = max(16, min(256, 8192 // block_e, triton.next_power_of_2(pairs)))  # 8192 (expert, pair) cells
    chunks = triton.cdiv(pairs, chunk)
    counts = torch.empty((chunks, block_e), dtype=torch.int32, device=dev)
    opts = dict(BLOCK_E=block_e, CHUNK=chunk, PDL=pdl(topk_ids), **launch_opts(topk_ids))
    _count_kernel[(chunks,)](topk_ids, counts, pairs, expert_start, experts, num_warps=4, **opts)
    _place_kernel[(chunks,)](topk_ids, counts, sorted_ids, expert_ids, total, pairs, chunks, expert_start, experts,
                             BLOCK_M=block_m, BLOCK_P=max(1, min(16, 4096 // block_e)), num_warps=4, **opts)
    return Aligned(sorted_ids, expert_ids, total, topk_ids, expert_start, experts, blocks)


def gate_up(x: torch.Tensor, w13: torch.Tensor, top_k: int, al: Aligned, block_m: int,
            tiles: dict) -> torch.Tensor:
    """Step 2: act [blocks * block_m, I] in x's dtype (see _gate_up_kernel)."""
    inter, hidden = w13.shape[1] // 2, w13.shape[2]
    num_m = al.blocks
    act = torch.empty((num_m * block_m, inter), dtype=x.dtype, device=x.device)
    grid = (num_m * triton.cdiv(inter, tiles["BLOCK_N"]),)
    _gate_up_kernel[grid](x, w13, act, al.sorted_ids, al.expert_ids, al.total, al.topk_ids, al.expert_start,
                          al.experts, x.shape[0] * top_k, inter, hidden, num_m, x.stride(0), w13.stride(0),
                          w13.stride(1), act.stride(0), TOP_K=top_k, BLOCK_M=block_m, EXACT=_exact(x), PDL=pdl(x),
                          **tiles, **launch_opts(x))
    return act


def down(act: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, al: Aligned, block_m: int,
         tiles: dict) -> torch.Tensor:
    """Step 3: parts [splits, T * k, H] float32 (see _down_kernel)."""
    hidden, inter = w2.shape[1], w2.shape[2]
    tiles = dict(tiles)
    k_split = triton.cdiv(triton.cdiv(inter, tiles.pop("SPLIT_K", 1)), tiles["BLOCK_K"]) * tiles["BLOCK_K"]
    splits = triton.cdiv(inter, k_split)
    pairs = topk_weights.numel()
    parts = torch.empty((splits, pairs, hidden), dtype=torch.float32, device=act.device)
    num_m = al.blocks
    grid = (num_m * triton.cdiv(hidden, tiles["BLOCK_N"]), splits)
    _down_kernel[grid](act, w2, parts, topk_weights, al.sorted_ids, al.expert_ids, al.total, al.topk_ids,
                       al.expert_start, al.experts, pairs, hidden, inter, num_m, act.stride(0), w2.stride(0),
                       w2.stride(1), k_split, BLOCK_M=block_m, EXACT=_exact(act), PDL=pdl(act), **tiles,
                       **launch_opts(act))
    return parts


def combine(parts: torch.Tensor, topk_ids: torch.Tensor, experts: int, expert_start: int,
            dtype: torch.dtype) -> torch.Tensor:
    """Step 4: out [T, H] in dtype, the sum of each token's held choices (see _sum_kernel)."""
    t, top_k = topk_ids.shape
    splits, pairs, hidden = parts.shape
    out = torch.empty((t, hidden), dtype=dtype, device=parts.device)
    block_n = min(1024, triton.next_power_of_2(hidden))
    grid = (t, triton.cdiv(hidden, block_n))
    _sum_kernel[grid](parts, topk_ids, out, pairs, hidden, expert_start, experts, TOP_K=top_k,
                      BLOCK_J=triton.next_power_of_2(top_k), SPLITS=splits, BLOCK_N=block_n, PDL=pdl(parts),
                      num_warps=4, **launch_opts(parts))
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_start: int = 0, config: dict | None = None) -> torch.Tensor:
    """The experts' gated MLPs of x [T, H] weighted by the routing, as reference.fused_moe; `config`
    overrides the tiles (see moe_config)."""
    t, hidden = x.shape
    experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    assert w13.shape[2] == hidden and w2.shape == (experts, hidden, two_inter // 2) and topk_ids.shape[0] == t
    assert x.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1
    if t == 0:
        return torch.empty_like(x)
    topk_ids, topk_weights = topk_ids.to(torch.int32).contiguous(), topk_weights.float().contiguous()
    cfg = config or moe_config(_device_name(x), experts, hidden, two_inter // 2, top_k, t)
    block_m = cfg["BLOCK_M"]
    aligned = align(topk_ids, experts, block_m, expert_start)
    act = gate_up(x, w13, top_k, aligned, block_m, cfg["gate_up"])
    parts = down(act, w2, topk_weights, aligned, block_m, cfg["down"])
    return combine(parts, topk_ids, experts, expert_start, x.dtype)
