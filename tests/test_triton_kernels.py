"""The Triton kernels and the Triton attention backend equal the torch references.

Without CUDA they run on CPU tensors under TRITON_INTERPRET=1 (small tiles, so short sequences still cross
several tiles and splits); on a CUDA host the same tests run the compiled kernels on the GPU."""

import dataclasses
import math
import os

import pytest
import torch

from minisgl.core import Phase

if not torch.cuda.is_available():  # must be set before Triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from minisgl.attention.base import AttnConfig
from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.attention.triton_backend import TritonAttnBackend
from minisgl.core import Batch, Req, SamplingParams
from minisgl.kernel import reference as ref
from minisgl.kernel import triton as triton_kernels
from minisgl.kvcache.pool import KVPool

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1.6e-2}
    torch.testing.assert_close(a.float(), b.float(), **tol)


# ---- elementwise kernels ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 40), (5, 3, 24), (1, 64)])
def test_rms_norm_matches_reference(shape, dtype):
    x, w = _randn(*shape, dtype=dtype), _randn(shape[-1], dtype=dtype, seed=1)
    _close(triton_kernels.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), dtype)


def test_rms_norm_reads_strided_rows():
    """q sliced out of a fused QKV output: row stride larger than the row."""
    qkv = _randn(6, 100)
    q = qkv[:, :40]
    w = _randn(40, seed=1)
    _close(triton_kernels.rms_norm(q, w, 1e-5), ref.rms_norm(q, w, 1e-5), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_matches_reference(dtype):
    x, res, w = (
        _randn(9, 72, dtype=dtype),
        _randn(9, 72, dtype=dtype, seed=1),
        _randn(72, dtype=dtype, seed=2),
    )
    want_out, want_res = ref.fused_add_rms_norm(x, res.clone(), w, 1e-6)
    out, new_res = triton_kernels.fused_add_rms_norm(x, res, w, 1e-6)
    _close(out, want_out, dtype)
    _close(new_res, want_res, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(6, 37), (3, 1500)])
def test_silu_and_mul_matches_reference(rows, width, dtype):
    x = _randn(rows, 2 * width, dtype=dtype)
    _close(triton_kernels.silu_and_mul(x), ref.silu_and_mul(x), dtype)


@pytest.mark.parametrize("rot_dim", [24, 16])  # 16 < head_dim: partial rotary leaves the tail unchanged
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_matches_reference_on_qkv_views(rot_dim, dtype):
    T, Hq, Hk, D = 6, 4, 2, 24
    qkv = _randn(T, (Hq + 2 * Hk) * D, dtype=dtype)
    q = qkv[:, : Hq * D].view(T, Hq, D)  # strided views, as the attention layer passes them
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    cache = _randn(100, rot_dim, seed=3)
    positions = torch.tensor([0, 5, 99, 17, 17, 42], dtype=torch.int32, device=DEVICE)
    q_out, k_out = triton_kernels.apply_rotary(q, k, positions, cache)
    q_ref, k_ref = ref.apply_rotary(q, k, positions, cache)
    _close(q_out, q_ref, dtype)
    _close(k_out, k_ref, dtype)


@pytest.mark.parametrize("rot_dim", [24, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rotary_matches_reference_on_qkv_views(rot_dim, dtype):
    """Qwen3's per-head q/k RMSNorm fused into rotary equals norm-then-rotate."""
    T, Hq, Hk, D = 5, 4, 2, 24
    qkv = _randn(T, (Hq + 2 * Hk) * D, dtype=dtype)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    q_w, k_w = _randn(D, dtype=dtype, seed=1), _randn(D, dtype=dtype, seed=2)
    cache = _randn(100, rot_dim, seed=3)
    positions = torch.tensor([0, 5, 99, 17, 42], dtype=torch.int32, device=DEVICE)
    got = triton_kernels.qk_norm_rotary(q, k, q_w, k_w, 1e-6, positions, cache)
    # against float32 arithmetic: the bf16 reference rounds each rotary product, and where the two
    # products cancel that rounding alone exceeds the tolerance
    want = ref.qk_norm_rotary(q.float(), k.float(), q_w.float(), k_w.float(), 1e-6, positions, cache)
    for g, w in zip(got, want):
        _close(g, w, dtype)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_with_kv_store_writes_the_rotated_k_and_v_into_the_pool_rows_only(norm, dtype):
    """kv_store: the rotated k and v land in the pool rows out_loc (nothing else in the pool changes) and
    q is the same as without it; no k is returned."""
    T, Hq, Hk, D, slots = 5, 4, 2, 24, 32
    qkv = _randn(T, (Hq + 2 * Hk) * D, dtype=dtype)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    v = qkv[:, (Hq + Hk) * D :].view(T, Hk, D)
    q_w, k_w = _randn(D, dtype=dtype, seed=1), _randn(D, dtype=dtype, seed=2)
    cache = _randn(100, 16, seed=3)
    positions = torch.tensor([0, 5, 99, 17, 42], dtype=torch.int32, device=DEVICE)
    out_loc = torch.tensor([7, 30, 0, 12, 13], dtype=torch.int32, device=DEVICE)
    k_cache, v_cache = _randn(slots, Hk, D, dtype=dtype, seed=4), _randn(slots, Hk, D, dtype=dtype, seed=5)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    weights = (q_w, k_w, 1e-6) if norm else ()
    rotate = triton_kernels.qk_norm_rotary if norm else triton_kernels.apply_rotary
    want_q, want_k = rotate(q, k, *weights, positions, cache)
    got_q, got_k = rotate(q, k, *weights, positions, cache, kv_store=(k_cache, v_cache, out_loc, v))
    assert got_k is None
    assert torch.equal(got_q, want_q)
    rows = out_loc.long()
    assert torch.equal(k_cache[rows], want_k) and torch.equal(v_cache[rows], v)
    others = torch.ones(slots, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(k_cache[others], k_before[others]) and torch.equal(v_cache[others], v_before[others])


# the tolerance the skinny GEMM's float32 dot gets: float32's in the interpreter (exact float32); bf16's on a
# GPU, where tl.dot takes float32 inputs as TF32 (10-bit mantissa; the engine sends it half-precision rows only)
GEMM_TOL_DTYPE = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16


def _close_norm(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """|got - want| / |want| over the whole output: a GEMM's rounding error scales with the row, not
    with each (possibly tiny) element."""
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 1e-2), f"relative error {rel:.3g}"


# (BLOCK_N, BLOCK_K): K = 40 is not a multiple of 16 and N = 37 not one of 4, so both tails are masked;
# None: the tuned tiles (one K block)
GEMV_TILES = [(4, 16), None]


@pytest.mark.parametrize("tiles", GEMV_TILES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(tiles, dtype, bias):
    x = _randn(1, 64, dtype=dtype)[:, :40]
    w, b = _randn(37, 40, dtype=dtype, seed=1), _randn(37, dtype=dtype, seed=2) if bias else None
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    _close_norm(triton_kernels.gemv(x, w, b, tiles=tiles), want, dtype)


@pytest.mark.parametrize("tiles", GEMV_TILES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_gemv_matches_silu_and_mul_then_linear(tiles, dtype):
    x, w = _randn(1, 80, dtype=dtype), _randn(37, 40, dtype=dtype, seed=1)
    # the activation rounds to dtype as in the reference; the product itself is checked in float32
    want = torch.nn.functional.linear(ref.silu_and_mul(x).float(), w.float())
    _close_norm(triton_kernels.gemv(x, w, gated=True, tiles=tiles), want, dtype)


@pytest.mark.parametrize("tiles", GEMV_TILES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemv_add_rms_norm_matches_norm_then_linear(tiles, dtype, with_residual):
    """h = x + residual and rms_norm(h) W^T + b in one launch (h is exact on a GPU: test_gpu_kernels)."""
    x = _randn(1, 40, dtype=dtype)
    residual = _randn(1, 40, dtype=dtype, seed=1) if with_residual else None
    nw, w, b = (
        _randn(40, dtype=dtype, seed=2),
        _randn(37, 40, dtype=dtype, seed=3),
        _randn(37, dtype=dtype, seed=4),
    )
    y, h = triton_kernels.gemv_add_rms_norm(x, residual, nw, 1e-6, w, b, tiles=tiles)
    want_h = x if residual is None else residual + x
    _close(h, want_h, dtype)  # the interpreter's float32 -> bf16 cast may round differently from torch's
    # the normalised input rounds to dtype as in the reference; the product itself is checked in float32
    normed = ref.rms_norm(want_h, nw, 1e-6)
    _close_norm(y, torch.nn.functional.linear(normed.float(), w.float(), b.float()), dtype)


@pytest.mark.parametrize("tiles", [(4, 16), None])  # K = 4 heads x 10 dims: the (4, 16) blocks cut heads
@pytest.mark.parametrize("bias", [False, True])
# (splits, seq_len, splits holding keys): 50 keys over 8 splits of whole 16-key blocks fill 4 of them, one
# group of the splits read at once; 150 keys over 12 fill 10, three groups with a running max across them
@pytest.mark.parametrize("layout", [(8, 50, 4), (12, 150, 10)])
def test_gemv_merged_equals_merging_the_splits_then_linear(tiles, bias, layout):
    """The output projection that merges a one-request split-KV decode output as it reads it: the splits
    that hold keys weighted by their log-sum-exps; the empty ones hold NaN and must not be read."""
    from minisgl.kernel import SplitAttention

    S, seq_len, held = layout
    Hq, D, N = 4, 10, 37
    mid_o = _randn(1, Hq, S, D, seed=3)
    mid_lse = _randn(1, Hq, S, seed=4) * 3
    mid_o[:, :, held:], mid_lse[:, :, held:] = float("nan"), float("nan")
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=DEVICE)
    w = _randn(N, Hq * D, dtype=torch.bfloat16, seed=5)
    b = _randn(N, dtype=torch.bfloat16, seed=6) if bias else None
    weights = torch.softmax(mid_lse[0, :, :held] * math.log(2), dim=-1)  # 2^lse, normalised
    merged = (weights[:, :, None] * mid_o[0, :, :held]).sum(1).to(torch.bfloat16).view(1, -1)
    want = torch.nn.functional.linear(merged.float(), w.float(), None if b is None else b.float())
    parts = SplitAttention(mid_o, mid_lse, seq_lens, S, 16, torch.bfloat16, lambda: None)
    assert triton_kernels.gemv_merge_fits(parts, w)
    _close_norm(triton_kernels.gemv_merged(parts, w, b, tiles=tiles), want, torch.bfloat16)


def test_decode_of_one_request_in_several_splits_leaves_the_merge_to_linear():
    """One request in several splits: the plan says merge_in_o_proj, forward returns a SplitAttention, and
    kernel.linear of it equals linear of the merged output that the same batch gives without that fusion
    (float32: through the merge kernel, bit for bit). Several requests keep the merge in attention."""
    from minisgl import kernel
    from minisgl.kernel import SplitAttention

    setup = PagedSetup(4, 4, 2, [70])
    batch = setup.batch(Phase.DECODE, [69], [1])
    backend = TritonAttnBackend(setup.config, setup.pool, setup.page_table)
    backend.num_sms = 1000  # one split per key block
    backend.prepare_metadata(batch)
    plan = backend.fusion_plan(batch)
    assert plan.rope_in_attention and plan.merge_in_o_proj
    q = _randn(1, 4, HEAD_DIM, seed=7)
    k, v = _randn(1, 2, HEAD_DIM, seed=8), _randn(1, 2, HEAD_DIM, seed=9)
    w = _randn(11, 4 * HEAD_DIM, seed=10)
    parts = backend.forward(q, k, v, 0, batch)
    assert isinstance(parts, SplitAttention) and parts.num_splits > 1
    batch.attn_metadata.plan = dataclasses.replace(plan, merge_in_o_proj=False)
    want = backend.forward(q, k, v, 0, batch).view(1, -1)
    assert torch.equal(kernel.linear(parts, w), kernel.linear(want, w))
    two = PagedSetup(4, 4, 2, [70, 9])
    pair = two.batch(Phase.DECODE, [69, 8], [1, 1])
    backend = TritonAttnBackend(two.config, two.pool, two.page_table)
    backend.num_sms = 1000
    backend.prepare_metadata(pair)
    assert pair.attn_metadata.num_splits > 1 and not backend.fusion_plan(pair).merge_in_o_proj


def test_gemv_serves_one_half_precision_row_only():
    w = torch.empty(8, 16, dtype=torch.bfloat16)
    assert triton_kernels.gemv_fits(torch.empty(1, 16, dtype=torch.bfloat16), w)
    assert triton_kernels.gemv_fits(torch.empty(1, 16, dtype=torch.float16), w.half())
    assert not triton_kernels.gemv_fits(torch.empty(2, 16, dtype=torch.bfloat16), w)
    assert not triton_kernels.gemv_fits(torch.empty(0, 16, dtype=torch.bfloat16), w)
    assert not triton_kernels.gemv_fits(torch.empty(1, 16), w.float())
    assert not triton_kernels.gemv_fits(torch.empty(1, 32, dtype=torch.bfloat16)[:, ::2], w)


# (BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, num_warps) at K = 128: one slice of 4 blocks, 2 slices of 2, 4 slices
# of one (split-K, the parts summed by the last program of each N block), and the default for the shape
GEMM_CONFIGS = [(16, 16, 32, 4, 4), (16, 32, 32, 2, 4), (16, 16, 32, 1, 4), None]


@pytest.mark.parametrize("config", GEMM_CONFIGS)
@pytest.mark.parametrize("rows", [3, 21])  # 21 > BLOCK_M: the program loops over row blocks
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_matches_linear(config, rows, gated, bias):
    """float32 inputs: the interpreter's bf16 dot is not exact (the GPU tests cover bf16); on a GPU the
    dot runs them as TF32, so the tolerance is bf16's there."""
    x = _randn(rows, 2 * 128 if gated else 128)
    w, b = _randn(37, 128, seed=1), _randn(37, seed=2) if bias else None  # N = 37: masked tail
    want = torch.nn.functional.linear(ref.silu_and_mul(x) if gated else x, w, b)
    got = triton_kernels.gemm(x, w, b, gated=gated, config=config)
    _close_norm(got, want, GEMM_TOL_DTYPE)
    assert torch.equal(
        triton_kernels.gemm(x, w, b, gated=gated, config=config), got
    )  # the parts' sum order is fixed


@pytest.mark.parametrize("config", GEMM_CONFIGS)
@pytest.mark.parametrize("rows", [3, 21])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemm_add_rms_norm_matches_norm_then_linear(config, rows, with_residual):
    """h = x + residual and rms_norm(h) W^T + b in one launch, every program computing the rows' rms."""
    x = _randn(rows, 128)
    residual = _randn(rows, 128, seed=1) if with_residual else None
    nw, w, b = _randn(128, seed=2), _randn(37, 128, seed=3), _randn(37, seed=4)
    y, h = triton_kernels.gemm_add_rms_norm(x, residual, nw, 1e-6, w, b, config=config)
    want_h = x if residual is None else residual + x
    assert torch.equal(h, want_h)
    _close_norm(y, torch.nn.functional.linear(ref.rms_norm(want_h, nw, 1e-6), w, b), GEMM_TOL_DTYPE)


def test_split_k_gemm_leaves_its_counters_at_zero():
    x, w = _randn(5, 256), _randn(64, 256, seed=1)
    from minisgl.kernel.triton.gemm import _split_counters

    got = triton_kernels.gemm(x, w, config=(16, 16, 64, 1, 4))  # 4 slices
    assert not _split_counters(x.device).any()
    _close_norm(got, torch.nn.functional.linear(x, w), GEMM_TOL_DTYPE)


def test_gemm_serves_few_half_precision_rows_of_small_weights_only():
    w = torch.empty(64, 128, dtype=torch.bfloat16)
    assert triton_kernels.gemm_fits(torch.empty(2, 128, dtype=torch.bfloat16), w)
    assert triton_kernels.gemm_fits(torch.empty(16, 256, dtype=torch.bfloat16), w, gated=True)
    assert not triton_kernels.gemm_fits(torch.empty(1, 128, dtype=torch.bfloat16), w)  # the GEMV's
    assert not triton_kernels.gemm_fits(torch.empty(17, 128, dtype=torch.bfloat16), w)  # cuBLAS's
    assert not triton_kernels.gemm_fits(torch.empty(8, 128), w.float())
    assert not triton_kernels.gemm_fits(torch.empty(8, 96, dtype=torch.bfloat16), w[:, :96])  # K % 64
    assert not triton_kernels.gemm_fits(torch.empty(8, 256, dtype=torch.bfloat16), w)  # not [gate | up] of K
    big = torch.empty(0, dtype=torch.bfloat16).new_empty((8193, 1024))  # 16 MiB + 2 KiB of weights
    assert not triton_kernels.gemm_fits(torch.empty(8, 1024, dtype=torch.bfloat16), big)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [64, 4096])  # many chunks, one chunk
def test_argmax_gives_the_first_index_of_the_largest_value_as_torch(dtype, block):
    x = _randn(6, 1000, dtype=dtype)
    x[0, 10] = x[0, 990] = 50  # a tie across chunks
    x[1, 70] = x[1, 71] = 50  # a tie inside a chunk
    x[2] = 0  # all equal
    x[3, 999] = 50  # the masked tail's last entry
    got = triton_kernels.argmax(x, block)
    assert got.dtype == torch.int32 and torch.equal(got, x.argmax(dim=-1).int())
    assert got[:4].tolist() == [10, 70, 0, 999]


def test_store_kv_writes_the_given_slots_only():
    T, H, D = 5, 2, 24
    kv = _randn(T, 2 * H * D)
    k, v = kv[:, : H * D].view(T, H, D), kv[:, H * D :].view(T, H, D)
    loc = torch.tensor([31, 0, 7, 12, 40], dtype=torch.int32, device=DEVICE)
    k_cache, v_cache = _randn(48, H, D, seed=1), _randn(48, H, D, seed=2)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    ref.store_kv(k_want, v_want, loc, k, v)
    triton_kernels.store_kv(k_cache, v_cache, loc, k, v)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


# ---- attention ---------------------------------------------------------------------------------------------
HEAD_DIM = 24  # not a power of two: every tile masks its tail
MAX_SEQ = 128


class PagedSetup:
    """A KV pool with random contents and a page table whose requests own shuffled pages."""

    def __init__(
        self,
        page_size: int,
        num_heads: int,
        num_kv_heads: int,
        seq_lens,
        seed: int = 0,
        kv_dtype=torch.float32,
        head_dim: int = HEAD_DIM,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        num_pages = sum(-(-n // page_size) for n in seq_lens) + 3
        self.config = AttnConfig(num_heads, num_kv_heads, head_dim, MAX_SEQ, DEVICE, torch.float32)
        self.pool = KVPool(1, num_pages, page_size, num_kv_heads, head_dim, kv_dtype, DEVICE)
        self.pool.k_buffer.copy_(torch.randn(self.pool.k_buffer.shape, generator=g))
        self.pool.v_buffer.copy_(torch.randn(self.pool.v_buffer.shape, generator=g))
        rows = len(seq_lens) + 2
        self.page_table = torch.zeros(rows, MAX_SEQ, dtype=torch.int32, device=DEVICE)
        pages = torch.randperm(num_pages, generator=g).tolist()
        self.rows = list(range(rows - 1, rows - 1 - len(seq_lens), -1))  # rows out of request order
        for row, n in zip(self.rows, seq_lens):
            own = [pages.pop() for _ in range(-(-n // page_size))]
            slots = [p * page_size + i for p in own for i in range(page_size)][:n]
            self.page_table[row, :n] = torch.tensor(slots, dtype=torch.int32)

    def batch(self, phase: str, prefix_lens, extend_lens) -> Batch:
        reqs = [Req(i, [0], SamplingParams()) for i in range(len(prefix_lens))]
        batch = Batch(reqs, phase, list(prefix_lens), list(extend_lens), [True] * len(reqs))
        batch.table_idx = torch.tensor(self.rows, dtype=torch.int32, device=DEVICE)
        batch.seq_lens_t = torch.tensor(batch.seq_lens, dtype=torch.int32, device=DEVICE)
        batch.out_loc = torch.cat(
            [self.page_table[r, p : p + e] for r, p, e in zip(self.rows, prefix_lens, extend_lens)]
        )
        batch.positions = torch.cat(
            [torch.arange(p, p + e, device=DEVICE) for p, e in zip(prefix_lens, extend_lens)]
        )
        return batch


def naive_attention(q, k_cache, v_cache, page_table, rows, prefix_lens, extend_lens, scale):
    """Per request and head: softmax(q K^T) V over keys 0..prefix + i, read through the page table."""
    out, start = torch.empty_like(q), 0
    group = q.shape[1] // k_cache.shape[1]
    for row, prefix, extend in zip(rows, prefix_lens, extend_lens):
        slots = page_table[row, : prefix + extend].long()
        keys, values = k_cache[slots], v_cache[slots]  # [S, Hkv, D]
        for i in range(extend):
            visible = prefix + i + 1
            for h in range(q.shape[1]):
                scores = (keys[:visible, h // group] @ q[start + i, h]) * scale
                out[start + i, h] = torch.softmax(scores, 0) @ values[:visible, h // group]
        start += extend
    return out


def naive_over_pool(setup: PagedSetup, batch: Batch, q: torch.Tensor) -> torch.Tensor:
    """naive_attention of q over setup's pool and page table for the requests of batch."""
    return naive_attention(
        q,
        setup.pool.k(0),
        setup.pool.v(0),
        setup.page_table,
        setup.rows,
        batch.prefix_lens,
        batch.extend_lens,
        HEAD_DIM**-0.5,
    )


HEADS = [(2, 2), (4, 2), (4, 1)]  # GQA ratios 1, 2 and 4


def _run_both(setup: PagedSetup, batch: Batch, seed: int = 5, num_sms: int = 0):
    """Run the Triton backend on random q/k/v; check the pool writes and the output against the naive
    reference and the torch backend. Returns the Triton backend and its metadata."""
    T = batch.num_tokens
    cfg = setup.config
    q = _randn(T, cfg.num_heads, HEAD_DIM, seed=seed)
    k = _randn(T, cfg.num_kv_heads, HEAD_DIM, seed=seed + 1)
    v = _randn(T, cfg.num_kv_heads, HEAD_DIM, seed=seed + 2)
    triton_backend = TritonAttnBackend(cfg, setup.pool, setup.page_table)
    if num_sms:
        triton_backend.num_sms = num_sms
    triton_backend.prepare_metadata(batch)
    meta = batch.attn_metadata
    if (
        batch.is_decode and meta.mid_o is not None
    ):  # empty splits are never written: the merge must not read them
        meta.mid_o.fill_(float("nan"))
        meta.mid_lse.fill_(float("nan"))
    out = triton_backend.forward(q, k, v, 0, batch)
    # the new K/V are in the pool now; the references read them from there
    assert torch.equal(setup.pool.k(0)[batch.out_loc.long()], k)
    assert torch.equal(setup.pool.v(0)[batch.out_loc.long()], v)
    want = naive_over_pool(setup, batch, q)
    torch_backend = TorchAttnBackend(cfg, setup.pool, setup.page_table)
    torch_backend.prepare_metadata(batch)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out, torch_backend.forward(q, k, v, 0, batch), atol=2e-5, rtol=1e-5)
    return triton_backend, meta


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"gqa{h[0] // h[1]}")
def test_extend_matches_reference_over_cached_prefixes(page_size, heads):
    """One launch over a mixed batch: a fresh prompt, a single new token on a prefix, and a chunk on a
    prefix that is not tile-aligned (tiles 16x16 on a CPU, so every path of the kernel runs)."""
    prefix_lens, extend_lens = [0, 13, 37], [20, 1, 17]
    setup = PagedSetup(page_size, *heads, [p + e for p, e in zip(prefix_lens, extend_lens)])
    _run_both(setup, setup.batch(Phase.PREFILL, prefix_lens, extend_lens))


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"gqa{h[0] // h[1]}")
def test_decode_matches_reference(page_size, heads):
    seq_lens = [1, 23, 50]
    setup = PagedSetup(page_size, *heads, seq_lens)
    _run_both(setup, setup.batch(Phase.DECODE, [n - 1 for n in seq_lens], [1] * len(seq_lens)))


@pytest.mark.parametrize("num_heads", [1, 3, 6, 16, 24])
@pytest.mark.parametrize("num_splits", [2, 5, 40])
def test_merge_of_several_heads_a_program_equals_the_log_sum_exp_merge(num_heads, num_splits):
    """The merge kernel takes several query heads a program (a power of two dividing the head count, fewer
    the more splits there are): every (request, head) still gets the log-sum-exp-weighted mean of exactly
    the splits that hold keys of it (the rest hold NaN, as stage 1 leaves them)."""
    from minisgl.kernel.triton.attention import merge_splits

    block_n, seq_lens = 4, [1, 37, 160, 9]
    bs, d = len(seq_lens), HEAD_DIM
    mid_o = _randn(bs, num_heads, num_splits, d, seed=1)
    mid_lse = _randn(bs, num_heads, num_splits, seed=2) * 4
    want = torch.empty(bs, num_heads, d, device=DEVICE)
    for b, n in enumerate(seq_lens):
        chunk = math.ceil(math.ceil(n / num_splits) / block_n) * block_n
        used = math.ceil(n / chunk)
        mid_o[b, :, used:] = float("nan")
        mid_lse[b, :, used:] = float("nan")
        weight = torch.softmax(mid_lse[b, :, :used] * math.log(2), dim=1)  # 2^lse, normalised
        want[b] = (weight[:, :, None] * mid_o[b, :, :used]).sum(1)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.empty(bs, num_heads, d, device=DEVICE)
    merge_splits(mid_o, mid_lse, lens, num_splits, out, block_n)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_sms", [1, 1000])
def test_decode_is_exact_with_one_split_and_with_many_mostly_empty_splits(num_sms, monkeypatch):
    """num_sms sets the split count (one program wanted per SM here): 1 split, or as many as there are
    key blocks (so short requests leave most of their splits empty and the merge must ignore them)."""
    from minisgl.attention import triton_backend

    monkeypatch.setattr(triton_backend, "_WAVES", 1)
    seq_lens = [2, 95, 17]
    setup = PagedSetup(4, 4, 2, seq_lens)
    batch = setup.batch(Phase.DECODE, [n - 1 for n in seq_lens], [1] * 3)
    backend, meta = _run_both(setup, batch, num_sms=num_sms)
    want = 1 if num_sms == 1 else -(-max(seq_lens) // backend.decode_tile(3)[0])
    assert meta.num_splits == want
    assert (meta.mid_o is None) == (want == 1)  # one split writes the output directly


# 16 keys: the smallest block a GPU dot takes (tl.dot needs 16 on every side)
@pytest.mark.parametrize("tiles", ["16:4:2:2,32:4:2:2", "32:4:2:2,16:4:2:2"])
def test_decode_tile_of_a_batch_and_of_one_request_each_cut_their_own_splits(tiles, monkeypatch):
    """MINISGL_DECODE_TILE sets one decode tile for batches of several requests and one for a single
    request (on an H200: 32-key blocks for batches, 64 for one request). Each cuts the splits in its own
    key blocks, and the merges, in the merge kernel or in the output projection's GEMV at one request,
    cut them alike: both stay exact against the naive reference."""
    from minisgl.kernel import SplitAttention

    monkeypatch.setenv("MINISGL_DECODE_TILE", tiles)
    batch_tile, one_tile = (tuple(int(x) for x in t.split(":")) for t in tiles.split(","))
    seq_lens = [2, 95, 17]
    setup = PagedSetup(4, 4, 2, seq_lens)
    batch = setup.batch(Phase.DECODE, [n - 1 for n in seq_lens], [1] * 3)
    _, meta = _run_both(setup, batch, num_sms=1000)
    assert meta.tile[:4] == batch_tile and meta.num_splits == -(-95 // batch_tile[0])

    one = PagedSetup(4, 4, 2, [70])
    single = one.batch(Phase.DECODE, [69], [1])
    backend = TritonAttnBackend(one.config, one.pool, one.page_table)
    backend.num_sms = 1000
    backend.prepare_metadata(single)
    meta = single.attn_metadata
    assert (
        meta.tile[:4] == one_tile and meta.num_splits == -(-70 // one_tile[0]) and meta.plan.merge_in_o_proj
    )
    q = _randn(1, 4, HEAD_DIM, seed=7)
    k, v = _randn(1, 2, HEAD_DIM, seed=8), _randn(1, 2, HEAD_DIM, seed=9)
    parts = backend.forward(q, k, v, 0, single)
    want = naive_over_pool(one, single, q).view(1, -1)
    torch.testing.assert_close(parts.merge(), want, atol=2e-5, rtol=1e-5)
    # the GEMV that merges as it reads (half precision) cuts the splits with the parts' block
    half = SplitAttention(
        parts.mid_o,
        parts.mid_lse,
        parts.seq_lens,
        parts.num_splits,
        parts.block_n,
        torch.bfloat16,
        lambda: None,
    )
    w = _randn(11, 4 * HEAD_DIM, dtype=torch.bfloat16, seed=10)
    want_y = torch.nn.functional.linear(want.to(torch.bfloat16).float(), w.float())
    _close_norm(triton_kernels.gemv_merged(half, w), want_y, torch.bfloat16)


def test_decode_tile_sets_the_programs_an_sm_its_split_count_aims_for(monkeypatch):
    """A fifth field of a MINISGL_DECODE_TILE tile: the split count fills that many programs an SM (here
    4 SMs, 3 requests x 2 KV heads = 6 programs a split: 8 an SM (the default) wants 6 splits, 1 wants
    one); a malformed value is refused naming the variable."""
    seq_lens = [2, 95, 17]
    setup = PagedSetup(4, 4, 2, seq_lens)
    batch = setup.batch(Phase.DECODE, [n - 1 for n in seq_lens], [1] * 3)
    for tiles, splits in (("16:4:2:2,16:4:2:2", 6), ("16:4:2:2:1,16:4:2:2", 1), ("16:4:2:2:4,16:4:2:2", 3)):
        monkeypatch.setenv("MINISGL_DECODE_TILE", tiles)
        _, meta = _run_both(setup, batch, num_sms=4)  # 4 on a GPU too
        assert meta.num_splits == splits
    for bad in ("16:4:2:2", "16:4:2,16:4:2:2", "16:4:x:2,16:4:2:2", "0:4:2:2,16:4:2:2"):
        monkeypatch.setenv("MINISGL_DECODE_TILE", bad)
        with pytest.raises(ValueError, match="MINISGL_DECODE_TILE"):
            TritonAttnBackend(setup.config, setup.pool, setup.page_table)


def test_the_decode_step_switch_reads_auto_on_and_off_and_refuses_the_rest(monkeypatch):
    """MINISGL_DECODE_STEP: unset or auto lets the decode graph runner time the one-kernel step (where it
    builds), 1 / 0 and their spellings force it on / off, anything else is refused naming the variable when
    a backend is built; on a CPU the one-kernel step is never planned either way."""
    from minisgl.env import ENV

    setup = PagedSetup(4, 4, 2, [3])
    monkeypatch.delenv("MINISGL_DECODE_STEP", raising=False)
    assert ENV.decode_step == "auto"
    for value, mode in (
        ("auto", "auto"),
        (" AUTO ", "auto"),
        ("1", "on"),
        ("on", "on"),
        ("0", "off"),
        ("no", "off"),
    ):
        monkeypatch.setenv("MINISGL_DECODE_STEP", value)
        assert ENV.decode_step == mode
        backend = TritonAttnBackend(setup.config, setup.pool, setup.page_table)
        assert not backend.step_sizes and not backend.whole_step_undecided
    for bad in ("2", "maybe"):
        monkeypatch.setenv("MINISGL_DECODE_STEP", bad)
        with pytest.raises(ValueError, match="MINISGL_DECODE_STEP"):
            TritonAttnBackend(setup.config, setup.pool, setup.page_table)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("num_sms", [1, 1000])  # one split (direct output) and one split per key block
@pytest.mark.parametrize("rot_dim", [HEAD_DIM, 16])  # 16: partial rotary
def test_decode_with_rope_rotates_stores_and_attends_like_the_separate_kernels(norm, num_sms, rot_dim):
    """With a Rope the decode kernel takes the projection's raw q/k/v: the pool rows of the new tokens
    get the rotated k (as the rotary kernel computes it) and v, no other row changes, and the output is
    attention over the pool with the rotated q (naive reference on reference-rotated q)."""
    from minisgl.kernel import Rope

    seq_lens = [1, 23, 50]
    setup = PagedSetup(4, 4, 2, seq_lens)
    batch = setup.batch(Phase.DECODE, [n - 1 for n in seq_lens], [1] * 3)
    B, Hq, Hk, D = 3, 4, 2, HEAD_DIM
    qkv = _randn(B, (Hq + 2 * Hk) * D, seed=11)
    q = qkv[:, : Hq * D].view(B, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(B, Hk, D)
    v = qkv[:, (Hq + Hk) * D :].view(B, Hk, D)
    q_w, k_w = (_randn(D, seed=12), _randn(D, seed=13)) if norm else (None, None)
    cache = _randn(MAX_SEQ, rot_dim, seed=14)
    weights = (q_w, k_w, 1e-6) if norm else ()
    want_q, want_k = (ref.qk_norm_rotary if norm else ref.apply_rotary)(
        q, k, *weights, batch.positions, cache
    )
    _, kernel_k = (triton_kernels.qk_norm_rotary if norm else triton_kernels.apply_rotary)(
        q, k, *weights, batch.positions, cache
    )
    k_before, v_before = setup.pool.k(0).clone(), setup.pool.v(0).clone()
    backend = TritonAttnBackend(setup.config, setup.pool, setup.page_table)
    backend.num_sms = num_sms
    backend.prepare_metadata(batch)
    assert backend.fusion_plan(batch).rope_in_attention
    out = backend.forward(q, k, v, 0, batch, rope=Rope(batch.positions, cache, q_w, k_w, 1e-6))
    rows = batch.out_loc.long()
    assert torch.equal(setup.pool.k(0)[rows], kernel_k) and torch.equal(setup.pool.v(0)[rows], v)
    torch.testing.assert_close(setup.pool.k(0)[rows], want_k, atol=1e-5, rtol=1e-5)
    others = torch.ones(setup.pool.k(0).shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.equal(setup.pool.k(0)[others], k_before[others])
    assert torch.equal(setup.pool.v(0)[others], v_before[others])
    want = naive_over_pool(setup, batch, want_q)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)


def test_decode_graph_metadata_is_exact_for_any_length_below_max_seq_len():
    """Captured metadata fixes the split count for max_seq_len; shorter requests still attend exactly."""
    seq_lens = [3, 40]
    setup = PagedSetup(1, 4, 2, seq_lens)
    batch = setup.batch(Phase.DECODE, [n - 1 for n in seq_lens], [1, 1])
    backend = TritonAttnBackend(setup.config, setup.pool, setup.page_table)
    backend.init_capture_graph(4, [1, 2, 4])
    backend.prepare_for_capture(batch)
    assert batch.attn_metadata.num_splits == backend.num_splits(2, MAX_SEQ)
    q = _randn(2, 4, HEAD_DIM, seed=7)
    k, v = _randn(2, 2, HEAD_DIM, seed=8), _randn(2, 2, HEAD_DIM, seed=9)
    out = backend.forward(q, k, v, 0, batch)
    want = naive_over_pool(setup, batch, q)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.PREFILL])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])
def test_fp8_pool_holds_rounded_kv_and_attention_reads_it_upcast(phase, qdtype, head_dim):
    """--kv-cache-dtype fp8_e4m3: the new K/V land in the pool rounded to float8 e4m3 as torch rounds them
    (checked on a GPU: the interpreter's emulated cast rounds values just below a power of two down to the
    power below), and decode and extend attend over the pool's values upcast: the naive reference over
    the same pool in float32, and the torch backend. bf16 queries attend in fp16 over a float8 pool (its
    one-instruction conversion): a bf16 tolerance. Heads of 64 dims and more take V's fp16 conversion
    before the PV dots, one dot per dim class d % 4 (attention._e4m3_quarters)."""
    prefix_lens, extend_lens = ([12, 40, 0], [1, 1, 1]) if phase == Phase.DECODE else ([0, 13], [20, 9])
    lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    setup = PagedSetup(4, 4, 2, lens, kv_dtype=torch.float8_e4m3fn, head_dim=head_dim)
    batch = setup.batch(phase, prefix_lens, extend_lens)
    T, cfg = batch.num_tokens, dataclasses.replace(setup.config, dtype=qdtype)
    q = _randn(T, cfg.num_heads, head_dim, seed=1, dtype=qdtype)
    k = (_randn(T, cfg.num_kv_heads, head_dim, seed=2) * 3).to(qdtype)
    v = _randn(T, cfg.num_kv_heads, head_dim, seed=3, dtype=qdtype)
    backend = TritonAttnBackend(cfg, setup.pool, setup.page_table)
    backend.prepare_metadata(batch)
    out = backend.forward(q, k, v, 0, batch).float()
    loc, fp8 = batch.out_loc.long(), torch.float8_e4m3fn
    assert setup.pool.k(0).dtype == fp8
    if DEVICE.type == "cuda":
        assert torch.equal(setup.pool.k(0)[loc].float(), k.to(fp8).float())
        assert torch.equal(setup.pool.v(0)[loc].float(), v.to(fp8).float())
    assert not torch.equal(setup.pool.k(0)[loc].float(), k.float())  # rounded: 3 mantissa bits
    pool_k, pool_v = setup.pool.k(0).float(), setup.pool.v(0).float()
    scale = head_dim**-0.5
    want = naive_attention(
        q.float(), pool_k, pool_v, setup.page_table, setup.rows, prefix_lens, extend_lens, scale
    )
    tol = {"atol": 2e-5, "rtol": 1e-5} if qdtype == torch.float32 else {"atol": 2e-2, "rtol": 1.6e-2}
    torch.testing.assert_close(out, want, **tol)
    torch_backend = TorchAttnBackend(cfg, setup.pool, setup.page_table)
    torch_backend.prepare_metadata(batch)
    torch.testing.assert_close(out, torch_backend.forward(q, None, None, 0, batch).float(), **tol)


# ---- the whole model -----------------------------------------------------------------------------------
def test_llm_with_triton_attention_and_decode_graphs_equals_hf(tiny_model_dirs, hf_reference):
    """Qwen3 tiny (GQA 2, head_dim 40) through the scheduler: chunked prefill over cached prefixes
    (a shared prompt prefix, page size 4) and decode replayed through the graphs of 1, 2 and 4 requests
    (emulated on a CPU) give Hugging Face's greedy tokens."""
    from helpers import TINY_SPECS, assert_tokens_equal_hf, make_llm, random_prompt, tiny_llm_kwargs

    vocab = TINY_SPECS["qwen3"].config_kwargs["vocab_size"]
    prompts = [random_prompt(n, vocab, seed) for n, seed in [(23, 1), (5, 2), (40, 3)]]
    prompts.append(prompts[2][:30] + [7, 8])
    kwargs = tiny_llm_kwargs(attn="triton", page_size=4, cuda_graph_max_bs=4, max_prefill_length=16)
    with make_llm(tiny_model_dirs["qwen3"], **kwargs) as llm:
        assert llm.scheduler.engine.graph_runner is not None
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert_tokens_equal_hf(out["token_ids"], hf_reference("qwen3"), prompt, "triton attention + graphs")


def test_llm_verify_steps_with_triton_attention_equal_hf(tiny_model_dirs, hf_reference):
    """Speculative decoding through the Triton backend: a verify step's rows of one request store their
    K/V before the decode kernel attends (the extend plan), between decode steps replayed through the
    (emulated) graphs; Hugging Face's greedy tokens."""
    from helpers import TINY_SPECS, assert_tokens_equal_hf, make_llm, random_prompt, tiny_llm_kwargs

    vocab = TINY_SPECS["qwen3"].config_kwargs["vocab_size"]
    base = random_prompt(5, vocab, 9)
    prompts = [base * 3 + base[:2], random_prompt(12, vocab, 10)]
    kwargs = tiny_llm_kwargs(attn="triton", page_size=4, cuda_graph_max_bs=4, max_prefill_length=16)
    with make_llm(tiny_model_dirs["qwen3"], **kwargs, speculative="ngram", num_speculative_tokens=3) as llm:
        llm.scheduler.step_costs.best_k = lambda hits, n, max_k: max_k  # verify whatever the timings
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
        assert llm.stats()["spec_verify_steps"] > 0
    for prompt, out in zip(prompts, outs):
        assert_tokens_equal_hf(out["token_ids"], hf_reference("qwen3"), prompt, "triton verify steps")


@pytest.mark.parametrize("arch", ["llama3_rope", "qwen2", "qwen3"])  # rope scaling, QKV bias, q/k norm
def test_llm_with_the_layer_kernel_equals_hf(arch, tiny_model_dirs, hf_reference, monkeypatch):
    """One request at a time, so every decode step runs each layer as one layer-kernel launch (its stages
    launch by launch under the interpreter), replayed through the graph of one request: Hugging Face's
    greedy tokens. The layer's own kernels do not run: the count of layer launches says so."""
    from helpers import TINY_SPECS, assert_tokens_equal_hf, make_llm, random_prompt, tiny_llm_kwargs

    from minisgl.kernel.triton import layer

    monkeypatch.setenv("MINISGL_LAYER_KERNEL", "1")
    launches = []
    real = layer.decode_layer
    monkeypatch.setattr(layer, "decode_layer", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    monkeypatch.setattr(triton_kernels, "decode_layer", layer.decode_layer)
    vocab = TINY_SPECS[arch].config_kwargs["vocab_size"]
    prompts = [random_prompt(n, vocab, seed) for n, seed in [(21, 4), (6, 5)]]
    kwargs = tiny_llm_kwargs(attn="triton", page_size=4, cuda_graph_max_bs=1, max_running_req=1)
    with make_llm(tiny_model_dirs[arch], **kwargs) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    layers = TINY_SPECS[arch].config_kwargs["num_hidden_layers"]
    # the interpreter's emulated graphs run the layers' Python at every replay (4 decode steps a request);
    # a GPU's graphs launch what was captured, so there the count is that of the capture and warm-up
    assert len(launches) >= (4 * 2 * layers if DEVICE.type == "cpu" else layers)
    for prompt, out in zip(prompts, outs):
        assert_tokens_equal_hf(out["token_ids"], hf_reference(arch), prompt, "the layer kernel")


def test_llm_with_prefill_graphs_equals_hf(tiny_model_dirs, hf_reference):
    """Prefill through the (emulated) prefill graphs: chunks of up to 16 tokens padded to a captured size,
    several requests a step, chunks on cached prefixes (page size 4, a shared prompt prefix), decode through
    the decode graphs: Hugging Face's greedy tokens, and every prefill step was a replay."""
    from helpers import TINY_SPECS, assert_tokens_equal_hf, make_llm, random_prompt, tiny_llm_kwargs

    vocab = TINY_SPECS["qwen3"].config_kwargs["vocab_size"]
    prompts = [random_prompt(n, vocab, seed) for n, seed in [(23, 4), (3, 5), (40, 6), (9, 7)]]
    prompts.append(prompts[2][:30] + [7, 8])
    kwargs = tiny_llm_kwargs(
        attn="triton", page_size=4, cuda_graph_max_bs=4, cuda_graph_max_prefill=32, max_prefill_length=16
    )
    with make_llm(tiny_model_dirs["qwen3"], **kwargs) as llm:
        runner = llm.scheduler.engine.prefill_graphs
        assert runner is not None and runner.sizes == [16, 32]
        engine, prefill_steps = llm.scheduler.engine, []
        forward = engine.forward_batch

        def counting_forward(batch):
            prefill_steps.append(batch.num_tokens) if batch.is_prefill else None
            return forward(batch)

        engine.forward_batch = counting_forward
        outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
        assert len(prefill_steps) >= 5 and runner.replays == len(prefill_steps)
        assert any(n < 16 for n in prefill_steps)  # some steps were padded
        # a batch of more requests than a graph holds, or of more tokens than the largest, runs eagerly
        many = Batch(
            [None] * (runner.max_reqs + 1),
            Phase.PREFILL,
            [0] * (runner.max_reqs + 1),
            [1] * (runner.max_reqs + 1),
            [True] * (runner.max_reqs + 1),
        )
        long = Batch([None], Phase.PREFILL, [0], [runner.max_tokens + 1], [True])
        assert not runner.can_run(many) and not runner.can_run(long)
        assert runner.can_run(Batch([None], Phase.PREFILL, [0], [runner.max_tokens], [True]))
    for prompt, out in zip(prompts, outs):
        assert_tokens_equal_hf(out["token_ids"], hf_reference("qwen3"), prompt, "prefill graphs")


# ---- the layer kernel ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("qk_norm", [False, True])  # Llama / Qwen3
@pytest.mark.parametrize("first_layer", [False, True])  # no residual yet: h is x
@pytest.mark.parametrize("splits", [1, 3, 8])  # one split of several key blocks; 3 and 8 (4 holding keys)
def test_decode_layer_equals_the_layer_op_by_op(qk_norm, first_layer, splits):
    """The layer kernel (one request, its stages one launch each under the interpreter; on a GPU also the
    single launch with its grid barriers) against the layer written with the torch references: the
    pre-norm QKV projection (with a bias), q/k norm + rotary, the new K/V stored, attention over the pool
    (naive reference), the output projection, the post-norm gated MLP. Odd shapes: every tile masks."""
    from minisgl.kernel import LayerWeights
    from minisgl.kernel.triton.layer import decode_layer

    hidden, inter, Hq, Hk, D, seq_len = 40, 56, 4, 2, HEAD_DIM, 50
    setup = PagedSetup(4, Hq, Hk, [seq_len])
    batch = setup.batch(Phase.DECODE, [seq_len - 1], [1])
    n_qkv = (Hq + 2 * Hk) * D
    lw = LayerWeights(
        1 + _randn(hidden, seed=1) / 4,
        _randn(n_qkv, hidden, seed=2) / 5,
        _randn(n_qkv, seed=3) / 5,
        (1 + _randn(D, seed=4) / 4) if qk_norm else None,
        (1 + _randn(D, seed=5) / 4) if qk_norm else None,
        _randn(hidden, Hq * D, seed=6) / 8,
        1 + _randn(hidden, seed=7) / 4,
        _randn(2 * inter, hidden, seed=8) / 5,
        _randn(hidden, inter, seed=9) / 6,
        1e-6,
    )
    x = _randn(1, hidden, seed=10)
    residual = None if first_layer else _randn(1, hidden, seed=11)
    cache = _randn(MAX_SEQ, D, seed=12)
    pool_k, pool_v = setup.pool.k(0), setup.pool.v(0)

    # the reference, op by op, on a copy of the pool
    want_setup = PagedSetup(4, Hq, Hk, [seq_len])
    qkv, h = ref.add_rms_norm_linear(x, residual, lw.in_norm, lw.eps, lw.qkv, lw.qkv_bias)
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    q, k, v = q.view(1, Hq, D), k.view(1, Hk, D), v.view(1, Hk, D)
    if qk_norm:
        q, k = ref.qk_norm_rotary(q, k, lw.q_norm, lw.k_norm, lw.eps, batch.positions, cache)
    else:
        q, k = ref.apply_rotary(q, k, batch.positions, cache)
    ref.store_kv(want_setup.pool.k(0), want_setup.pool.v(0), batch.out_loc.long(), k, v)
    attn = naive_over_pool(want_setup, batch, q).view(1, -1)
    gate_up, want_h2 = ref.add_rms_norm_linear(attn @ lw.o.T, h, lw.post_norm, lw.eps, lw.gate_up)
    want_y = ref.silu_and_mul_linear(gate_up, lw.down)

    mid_o = torch.full((1, Hq, splits, D), float("nan"), device=DEVICE)  # empty splits are never read
    mid_lse = torch.full((1, Hq, splits), float("nan"), device=DEVICE)
    forms = [True] + ([False] if DEVICE.type == "cuda" else [])  # staged; the single launch on a GPU
    for staged in forms:
        fresh = PagedSetup(4, Hq, Hk, [seq_len]).pool  # the pool as before the step
        setup.pool.k_buffer.copy_(fresh.k_buffer)
        setup.pool.v_buffer.copy_(fresh.v_buffer)
        y, h2 = decode_layer(
            x,
            residual,
            lw,
            Hq,
            Hk,
            pool_k,
            pool_v,
            setup.page_table,
            batch.table_idx,
            batch.seq_lens_t,
            batch.out_loc,
            batch.positions,
            cache,
            mid_o,
            mid_lse,
            splits,
            D**-0.5,
            block_n=16,
            precision="ieee",
            staged=staged,
        )
        # the projection sums in another order than F.linear: the stored rows equal up to rounding
        torch.testing.assert_close(pool_v, want_setup.pool.v(0), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pool_k, want_setup.pool.k(0), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h2, want_h2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y, want_y, atol=2e-5, rtol=1e-5)
