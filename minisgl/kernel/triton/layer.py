"""A whole decoder layer of a one-request decode step in one launch: the persistent layer kernel.

A batch-1 decode step is bound by the start and drain of its kernels, not by their bytes (docs/BENCHMARKS.md,
"Per-kernel tables"): five per layer, each waiting for the one before. Here one launch of one program per
SM runs the layer's five stages in turn, and the programs wait for each other at a grid barrier (an atomic
counter in global memory) between stages instead of at kernel boundaries:

| stage | work items, spread over the programs |
| --- | --- |
| 0 | h = x + residual, RMSNorm, the QKV projection: blocks of output rows |
| 1 | q/k norm + rotary, the new K/V stored, split-KV attention: (KV head, split) |
| 2 | the splits merged, the output projection: blocks of output rows |
| 3 | h2 = o + h, RMSNorm, gate and up, silu(gate) * up: blocks of intermediate rows |
| 4 | the down projection: blocks of output rows |

The stages reuse the one-row GEMV's and the decode attention's jit helpers, so every rounding is theirs
(and reference.py's). A barrier needs every program resident at once, hence one program per SM, which
holds on a GPU; Triton's interpreter runs programs one after another, so there each stage is its own
launch (STAGE >= 0) and the barrier is the launch boundary: the CPU tests check the stages that way,
and the GPU tests the single launch against them.

The counter goes back to zero at the end of every launch (the last program out resets it), so CUDA
graphs replay the launch as captured."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .activation import silu_mul
from .attention import _LOG2E, _attend_program, _dot_dtype, _split_len
from .gemv import _dot, _merged_block, _normed_block, _row_block, _row_rstd, _store, _weight_block
from .launch import gdc_begin, launch_opts, pdl

if TYPE_CHECKING:
    from minisgl.kernel.args import LayerWeights

_STAGES = 5


@triton.jit
def _grid_sync(count_ptr, target):
    """Wait until every program has arrived here (the counter reaches target); the stores of each
    program's threads before the barrier are visible to every program after it. The counter is polled
    with plain loads (many programs at once, unlike atomics), then read once with acquire semantics."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    while tl.load(count_ptr, volatile=True) < target:
        pass
    tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _rows(item, stride_wn, w_ptr, N, BLOCK_N: tl.constexpr):
    """Output rows of work item `item` (offsets, mask) and their rows of W."""
    offs_n = item * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    return offs_n, n_mask, w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn


@triton.jit
def _first_block(w_ptr, stride_wn, N, pid, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weights of this program's first work item (item pid; none past the last item), loaded before
    the barrier that precedes their stage, so they stream while the programs wait."""
    _, n_mask, w_rows = _rows(pid, stride_wn, w_ptr, N, BLOCK_N)
    return _weight_block(w_rows, n_mask, 0, K, BLOCK_K)


@triton.jit
def _gemv_rows(w0, x, w_ptr, stride_wn, b_ptr, y_ptr, N, pid, programs, K: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """y = W x (+ b) over this program's work items (every programs-th block of BLOCK_N rows from pid): x is
    the whole input (K <= BLOCK_K), w0 the first item's weights (_first_block)."""
    offs_n, n_mask, _ = _rows(pid, stride_wn, w_ptr, N, BLOCK_N)
    _store(_dot(w0, x), b_ptr, y_ptr, offs_n, n_mask)
    for item in range(pid + programs, tl.cdiv(N, BLOCK_N), programs):
        offs_n, n_mask, w_rows = _rows(item, stride_wn, w_ptr, N, BLOCK_N)
        _store(_dot(_weight_block(w_rows, n_mask, 0, K, BLOCK_K), x), b_ptr, y_ptr, offs_n, n_mask)


@triton.jit
def _gated_rows(w0_gate, w0_up, x, w_ptr, stride_wn, act_ptr, N, pid, programs, K: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """act = silu(gate) * up with W = [gate | up] (2N rows): gate row n and up row N + n in one work item,
    rounded to act's dtype as the projection's output is, then as silu_and_mul rounds."""
    dtype = act_ptr.dtype.element_ty
    offs_n, n_mask, _ = _rows(pid, stride_wn, w_ptr, N, BLOCK_N)
    tl.store(act_ptr + offs_n, silu_mul(_dot(w0_gate, x).to(dtype), _dot(w0_up, x).to(dtype)), mask=n_mask)
    for item in range(pid + programs, tl.cdiv(N, BLOCK_N), programs):
        offs_n, n_mask, w_rows = _rows(item, stride_wn, w_ptr, N, BLOCK_N)
        gate = _dot(_weight_block(w_rows, n_mask, 0, K, BLOCK_K), x).to(dtype)
        up = _dot(_weight_block(w_rows + N * stride_wn, n_mask, 0, K, BLOCK_K), x).to(dtype)
        tl.store(act_ptr + offs_n, silu_mul(gate, up), mask=n_mask)


@triton.jit
def _decode_layer_kernel(
        # stage 0
        x_ptr, r_ptr, h_ptr, in_nw_ptr, eps, w_qkv_ptr, b_qkv_ptr, qkv_ptr, N_QKV, stride_qkv,
        # stage 1
        k_cache_ptr, v_cache_ptr, page_table_ptr, table_idx_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_pt, stride_mh, stride_ms, stride_lh, scale_log2,
        loc_ptr, pos_ptr, cache_ptr, stride_cache, qw_ptr, kw_ptr, HALF, NUM_SPLITS,
        # stage 2
        w_o_ptr, o_ptr, stride_o,
        # stage 3
        res_ptr, h2_ptr, post_nw_ptr, w_gu_ptr, act_ptr, stride_gu,
        # stage 4
        w_down_ptr, y_ptr, stride_down,
        count_ptr,
        HIDDEN: tl.constexpr, INTER: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
        BN_QKV: tl.constexpr, BK_QKV: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr, BN_GU: tl.constexpr,
        BK_GU: tl.constexpr, BN_DOWN: tl.constexpr, BK_DOWN: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
        DOT: tl.constexpr, STAGE: tl.constexpr, PDL: tl.constexpr):
    """One decoder layer for one request (the module docstring's stages). STAGE < 0: every stage, with a
    grid barrier between them; STAGE = s: stage s only (the interpreter's form). Every stage's first
    weights are loaded before the barrier in front of it (stage 2's before stage 1, which has none)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    if STAGE < 0 or STAGE == 0:
        w0 = _first_block(w_qkv_ptr, stride_qkv, N_QKV, pid, HIDDEN, BN_QKV, BK_QKV)
        gdc_begin(PDL)
        rstd = _row_rstd(x_ptr, r_ptr, h_ptr, eps, HIDDEN, BK_QKV)  # program 0 stores h = x + residual
        x = _normed_block(x_ptr, r_ptr, in_nw_ptr, rstd, 0, HIDDEN, BK_QKV)
        _gemv_rows(w0, x, w_qkv_ptr, stride_qkv, b_qkv_ptr, qkv_ptr, N_QKV, pid, programs, HIDDEN, BN_QKV, BK_QKV)
    if STAGE < 0 or STAGE == 2:
        w0 = _first_block(w_o_ptr, stride_o, HIDDEN, pid, HQ * D, BN_O, BK_O)
    if STAGE < 0:
        _grid_sync(count_ptr, programs)
    if STAGE < 0 or STAGE == 1:
        k_ptr = qkv_ptr + HQ * D
        for item in range(pid, HK * NUM_SPLITS, programs):
            _attend_program(qkv_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, table_idx_ptr, seq_lens_ptr,
                            mid_o_ptr, mid_lse_ptr, 0, D, stride_kt, stride_kh, stride_vt, stride_vh, stride_pt, 0,
                            stride_mh, stride_ms, 0, stride_lh, scale_log2, HQ // HK, D, NUM_SPLITS, k_ptr,
                            k_ptr + HK * D, 0, D, 0, D, loc_ptr, pos_ptr, cache_ptr, stride_cache, qw_ptr, kw_ptr,
                            eps, HALF, pid * 0, item // NUM_SPLITS, item % NUM_SPLITS, BLOCK_H, BLOCK_N, BLOCK_D,
                            PRECISION, DOT)
    if STAGE < 0:
        _grid_sync(count_ptr, 2 * programs)
    if STAGE < 0 or STAGE == 2:
        seq_len = tl.load(seq_lens_ptr)
        n_splits = tl.cdiv(seq_len, _split_len(seq_len, NUM_SPLITS, BLOCK_N))  # the splits holding keys
        x = _merged_block(mid_o_ptr, mid_lse_ptr, n_splits, stride_mh, stride_ms, stride_lh, 0, HQ * D, D, BK_O,
                          o_ptr.dtype.element_ty)
        _gemv_rows(w0, x, w_o_ptr, stride_o, None, o_ptr, HIDDEN, pid, programs, HQ * D, BN_O, BK_O)
    if STAGE < 0 or STAGE == 3:
        w0 = _first_block(w_gu_ptr, stride_gu, INTER, pid, HIDDEN, BN_GU, BK_GU)
        w0_up = _first_block(w_gu_ptr + INTER * stride_gu, stride_gu, INTER, pid, HIDDEN, BN_GU, BK_GU)
    if STAGE < 0:
        _grid_sync(count_ptr, 3 * programs)
    if STAGE < 0 or STAGE == 3:
        rstd = _row_rstd(o_ptr, res_ptr, h2_ptr, eps, HIDDEN, BK_GU)  # program 0 stores h2 = o + residual
        x = _normed_block(o_ptr, res_ptr, post_nw_ptr, rstd, 0, HIDDEN, BK_GU)
        _gated_rows(w0, w0_up, x, w_gu_ptr, stride_gu, act_ptr, INTER, pid, programs, HIDDEN, BN_GU, BK_GU)
    if STAGE < 0 or STAGE == 4:
        w0 = _first_block(w_down_ptr, stride_down, HIDDEN, pid, INTER, BN_DOWN, BK_DOWN)
    if STAGE < 0:
        _grid_sync(count_ptr, 4 * programs)
    if STAGE < 0 or STAGE == 4:
        x = _row_block(act_ptr, 0, INTER, BK_DOWN, False)
        _gemv_rows(w0, x, w_down_ptr, stride_down, None, y_ptr, HIDDEN, pid, programs, INTER, BN_DOWN, BK_DOWN)
    if STAGE < 0:  # noqa: SIM102 (a constexpr branch around a run-time one)
        # the last program out resets the counter for the next launch
        if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == 5 * programs - 1:
            tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")


# ---- launch ------------------------------------------------------------------------------------------------
_TILE = 16384  # weight elements a work item holds (as the GEMV's _GEMV_TILE)


def _blocks(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of a stage over W [n, k]: a whole BLOCK_N x K slice per work item, up to _TILE."""
    block_k = triton.next_power_of_2(k)
    return max(1, min(16, _TILE // block_k)), block_k


def layer_fits(hidden: int, inter: int, q_width: int) -> bool:
    """Whether the layer kernel serves these widths: every stage's input fits one weight block."""
    return max(hidden, inter, q_width) <= _TILE


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counter(device: torch.device) -> torch.Tensor:
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def programs_for(device: torch.device) -> int:
    """Programs of a layer launch: one per SM on a GPU (all resident, as the barrier needs)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 3


def decode_layer(x: torch.Tensor, residual: torch.Tensor | None, lw: LayerWeights, num_heads: int,
                 num_kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                 table_idx: torch.Tensor, seq_lens: torch.Tensor, out_loc: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor, mid_o: torch.Tensor, mid_lse: torch.Tensor, num_splits: int,
                 scale: float, *, block_n: int, precision: str, programs: int | None = None,
                 staged: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer for one request x [1, hidden] on the stream x + residual (x alone on the first
    layer): returns (the MLP's output, the new residual), as the layer's modules would. The attention
    splits follow decode_split's cut (num_splits over seq_lens, whole blocks of block_n keys) into
    mid_o [1, Hq, num_splits, D] / mid_lse [1, Hq, num_splits]. staged: one launch per stage (the default
    under the interpreter, where the programs run one at a time)."""
    hidden = x.shape[1]
    head_dim = k_cache.shape[-1]
    inter = lw.down.shape[1]
    assert x.shape[0] == 1 and x.is_contiguous() and (residual is None or residual.is_contiguous())
    assert lw.gate_up.shape == (2 * inter, hidden) and lw.o.shape == (hidden, num_heads * head_dim)
    dev = x.device
    programs = programs or programs_for(dev)
    if staged is None:
        staged = dev.type != "cuda"
    n_qkv = lw.qkv.shape[0]
    qkv = torch.empty((1, n_qkv), dtype=x.dtype, device=dev)
    h = torch.empty_like(x) if residual is not None else x
    o = torch.empty_like(x)
    h2 = torch.empty_like(x)
    act = torch.empty((1, inter), dtype=x.dtype, device=dev)
    y = torch.empty_like(x)
    args = (x, residual, h if residual is not None else None, lw.in_norm, lw.eps, lw.qkv, lw.qkv_bias, qkv, n_qkv,
            lw.qkv.stride(0),
            k_cache, v_cache, page_table, table_idx, seq_lens, mid_o, mid_lse, k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), page_table.stride(0), mid_o.stride(1), mid_o.stride(2),
            mid_lse.stride(1), scale * _LOG2E, out_loc, positions, cos_sin_cache, cos_sin_cache.stride(0),
            lw.q_norm, lw.k_norm, cos_sin_cache.shape[-1] // 2, num_splits,
            lw.o, o, lw.o.stride(0),
            h, h2, lw.post_norm, lw.gate_up, act, lw.gate_up.stride(0),
            lw.down, y, lw.down.stride(0),
            _counter(dev))
    (bn_qkv, bk_qkv), (bn_o, bk_o) = _blocks(n_qkv, hidden), _blocks(hidden, num_heads * head_dim)
    (bn_gu, bk_gu), (bn_down, bk_down) = _blocks(inter, hidden), _blocks(hidden, inter)
    consts = {"HIDDEN": hidden, "INTER": inter, "HQ": num_heads, "HK": num_kv_heads, "D": head_dim,
              "BN_QKV": bn_qkv, "BK_QKV": bk_qkv, "BN_O": bn_o, "BK_O": bk_o, "BN_GU": max(1, bn_gu // 2),
              "BK_GU": bk_gu, "BN_DOWN": bn_down, "BK_DOWN": bk_down,
              "BLOCK_H": max(16, triton.next_power_of_2(num_heads // num_kv_heads)),  # tl.dot: >= 16 rows
              "BLOCK_N": block_n, "BLOCK_D": triton.next_power_of_2(head_dim), "PRECISION": precision,
              "DOT": _dot_dtype(x, k_cache), "num_warps": 8}
    if staged:
        for stage in range(_STAGES):
            _decode_layer_kernel[(programs,)](*args, STAGE=stage, PDL=False, **consts)
    else:
        _decode_layer_kernel[(programs,)](*args, STAGE=-1, PDL=pdl(x), **consts, **launch_opts(x))
    return y, h2
