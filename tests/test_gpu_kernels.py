"""GPU only (`pytest -m gpu tests/test_gpu_kernels.py` on the GPU host): the Triton kernels and attention
backend at real model shapes in bfloat16 against the torch references, and CUDA-graph decode of a
real-size model (Qwen3-0.6B shapes, dummy weights) against its eager forward.

The small-shape float32 versions of these checks are tests/test_triton_kernels.py and
tests/test_graph_runner.py, which run on the GPU as well when CUDA is present."""

from __future__ import annotations

import os
import time

import pytest
import torch

from minisgl.core import Phase

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BF16_TOL = {"atol": 2e-2, "rtol": 1.6e-2}
QWEN3_06B = os.path.join(os.path.dirname(__file__), "..", "minisgl", "benchmark", "configs", "qwen3-0.6b")


def _randn(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


# ---- elementwise kernels ---------------------------------------------------------------------------------
def test_norms_and_silu_match_reference_at_model_shapes():
    from minisgl.kernel import reference as ref
    from minisgl.kernel import triton as triton_kernels

    torch.manual_seed(0)
    x, res, w = _randn(4096, 4096), _randn(4096, 4096), _randn(4096)
    torch.testing.assert_close(
        triton_kernels.rms_norm(x, w, 1e-6).float(), ref.rms_norm(x, w, 1e-6).float(), **BF16_TOL
    )
    want, want_res = ref.fused_add_rms_norm(x, res.clone(), w, 1e-6)
    got, got_res = triton_kernels.fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(got.float(), want.float(), **BF16_TOL)
    torch.testing.assert_close(got_res.float(), want_res.float(), **BF16_TOL)
    q = _randn(4096, 16, 128)  # Qwen3's per-head q norm
    torch.testing.assert_close(
        triton_kernels.rms_norm(q, w[:128], 1e-6).float(), ref.rms_norm(q, w[:128], 1e-6).float(), **BF16_TOL
    )
    gate_up = _randn(4096, 2 * 14336)
    torch.testing.assert_close(
        triton_kernels.silu_and_mul(gate_up).float(), ref.silu_and_mul(gate_up).float(), **BF16_TOL
    )


@pytest.mark.parametrize("rot_dim", [128, 64])
def test_rotary_matches_reference_at_model_shapes(rot_dim):
    from minisgl.kernel import reference as ref
    from minisgl.kernel import triton as triton_kernels
    from minisgl.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    T, Hq, Hk, D = 4096, 32, 8, 128
    cache = RotaryEmbedding(D, 32768, 500000.0, partial_factor=rot_dim / D).cos_sin_cache.cuda()
    qkv = _randn(T, (Hq + 2 * Hk) * D)
    q, k = qkv[:, : Hq * D].view(T, Hq, D), qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    positions = torch.randint(0, 32768, (T,), device="cuda", dtype=torch.int32)
    for got, want in zip(
        triton_kernels.apply_rotary(q, k, positions, cache), ref.apply_rotary(q, k, positions, cache)
    ):
        torch.testing.assert_close(got.float(), want.float(), **BF16_TOL)


def test_qk_norm_rotary_matches_reference_at_model_shapes():
    """Qwen3-0.6B heads (16 q, 8 kv, head_dim 128) at decode (1 token) and prefill (4096 tokens)."""
    from minisgl.kernel import reference as ref
    from minisgl.kernel import triton as triton_kernels
    from minisgl.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    Hq, Hk, D = 16, 8, 128
    cache = RotaryEmbedding(D, 40960, 1e6).cos_sin_cache.cuda()
    q_w, k_w = 1 + 0.1 * _randn(D), 1 + 0.1 * _randn(D)
    for T in (1, 4096):
        qkv = _randn(T, (Hq + 2 * Hk) * D)
        q, k = qkv[:, : Hq * D].view(T, Hq, D), qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
        positions = torch.randint(0, 40960, (T,), device="cuda", dtype=torch.int32)
        got = triton_kernels.qk_norm_rotary(q, k, q_w, k_w, 1e-6, positions, cache)
        want = ref.qk_norm_rotary(q.float(), k.float(), q_w.float(), k_w.float(), 1e-6, positions, cache)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.float(), w, **BF16_TOL)


# (N, K) of Qwen3-0.6B's projections (qkv, o, gate|up, down) and its LM head, and of Qwen3-8B's qkv/down
GEMV_SHAPES = [
    (4096, 1024),
    (1024, 2048),
    (6144, 1024),
    (1024, 3072),
    (151936, 1024),
    (6144, 4096),
    (4096, 12288),
]


@pytest.mark.parametrize("n,k", GEMV_SHAPES)
def test_gemv_matches_float32_linear_at_model_shapes(n, k):
    """One row, with and without bias, plain (from a strided row) and gated (silu_and_mul input)."""
    from minisgl.kernel import reference as ref
    from minisgl.kernel import triton as triton_kernels

    torch.manual_seed(n + k)
    w, b = _randn(n, k, scale=k**-0.5), _randn(n)
    x = _randn(1, 2 * k)
    for bias in (None, b):
        for gated in (False, True):
            inp = ref.silu_and_mul(x) if gated else x[:, :k]
            want = torch.nn.functional.linear(inp.float(), w.float(), None if bias is None else bias.float())
            got = triton_kernels.gemv(x if gated else x[:, :k], w, bias, gated=gated)
            rel = ((got.float() - want).norm() / want.norm()).item()
            assert got.shape == (1, n) and rel < 1e-2, f"bias={bias is not None} gated={gated}: {rel:.3g}"


@pytest.mark.parametrize("n,k", GEMV_SHAPES)
def test_gemv_add_rms_norm_matches_norm_then_linear_at_model_shapes(n, k):
    """The pre-norm projection of one row: h = x + residual exactly, and rms_norm(h) W^T + b."""
    from minisgl.kernel import triton as triton_kernels

    torch.manual_seed(n + k + 1)
    w, b, nw = _randn(n, k, scale=k**-0.5), _randn(n), 1 + 0.1 * _randn(k)
    _check_add_rms_norm_linear(triton_kernels.gemv_add_rms_norm, _randn(1, k), _randn(1, k), nw, w, b)


def _check_add_rms_norm_linear(fn, x, residual, nw, w, b) -> None:
    """fn(x, residual or None, ...) against the torch reference: h = x + residual exactly, and
    rms_norm(h) W^T + b in float32 within 1%."""
    from minisgl.kernel import reference as ref

    for res in (None, residual):
        y, h = fn(x, res, nw, 1e-6, w, b)
        want_h = x if res is None else res + x
        assert torch.equal(h, want_h)
        want = torch.nn.functional.linear(ref.rms_norm(want_h, nw, 1e-6).float(), w.float(), b.float())
        rel = ((y.float() - want).norm() / want.norm()).item()
        assert rel < 1e-2, f"rows={x.shape[0]} residual={res is not None}: {rel:.3g}"


@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)])
def test_gemm_matches_float32_linear_at_model_shapes(n, k):
    """2 to 16 rows (the default tiling) and 100 (several row blocks), with and without bias, plain and
    gated; a second call gives the same bits (split-K sums its parts in a fixed order and resets its
    counters)."""
    from minisgl.kernel import reference as ref
    from minisgl.kernel import triton as triton_kernels

    torch.manual_seed(n + k)
    w, b = _randn(n, k, scale=k**-0.5), _randn(n)
    for m in (2, 9, 16, 100):
        x = _randn(m, 2 * k)
        for bias, gated in ((None, False), (b, True), (b, False)):
            inp = ref.silu_and_mul(x) if gated else x[:, :k]
            want = torch.nn.functional.linear(inp.float(), w.float(), None if bias is None else bias.float())
            assert triton_kernels.gemm_fits(x if gated else x[:, :k], w, gated) == (m <= 16)
            got = triton_kernels.gemm(x if gated else x[:, :k], w, bias, gated=gated)
            rel = ((got.float() - want).norm() / want.norm()).item()
            assert got.shape == (m, n) and rel < 1e-2, (
                f"m={m} bias={bias is not None} gated={gated}: {rel:.3g}"
            )
            assert torch.equal(triton_kernels.gemm(x if gated else x[:, :k], w, bias, gated=gated), got)


@pytest.mark.parametrize("n,k", [(4096, 1024), (6144, 1024)])
def test_gemm_add_rms_norm_matches_norm_then_linear_at_model_shapes(n, k):
    from minisgl.kernel import triton as triton_kernels

    torch.manual_seed(n + k)
    w, b, nw = _randn(n, k, scale=k**-0.5), _randn(n), _randn(k)
    for m in (2, 9, 16):
        _check_add_rms_norm_linear(triton_kernels.gemm_add_rms_norm, _randn(m, k), _randn(m, k), nw, w, b)


@pytest.mark.parametrize("rows", [1, 37, 256])
def test_argmax_equals_torch_over_a_vocabulary(rows):
    from minisgl.kernel import triton as triton_kernels

    torch.manual_seed(rows)
    x = _randn(rows, 151936)
    x[0, 7] = x[0, 150000] = 100.0  # a tie: the first index
    assert torch.equal(triton_kernels.argmax(x), x.argmax(dim=-1).int())


def test_store_kv_writes_exactly_the_given_slots_in_a_large_pool():
    from minisgl.kernel import reference as ref
    from minisgl.kernel import triton as triton_kernels

    torch.manual_seed(0)
    T, H, D, slots = 8192, 8, 128, 2_200_000  # slot * row size exceeds int32: the kernel indexes in int64
    k_cache = torch.zeros(slots, H, D, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    kv = _randn(T, 2 * H * D)
    k, v = kv[:, : H * D].view(T, H, D), kv[:, H * D :].view(T, H, D)
    loc = torch.randperm(slots, device="cuda")[:T].to(torch.int32)
    loc[0] = slots - 1
    k_want, v_want = k_cache.clone(), v_cache.clone()
    ref.store_kv(k_want, v_want, loc, k, v)
    triton_kernels.store_kv(k_cache, v_cache, loc, k, v)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


# ---- attention ---------------------------------------------------------------------------------------------
HEADS = [(32, 8, 128), (16, 8, 128), (14, 2, 64), (64, 8, 128)]  # Llama-8B, Qwen3-0.6B, Qwen2-0.5B, 70B/TP1


def _paged(
    page_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seq_lens,
    max_seq: int,
    kv_dtype=torch.bfloat16,
):
    """A pool (bf16 unless kv_dtype) with random contents and a page table whose requests own shuffled
    pages."""
    from minisgl.attention.base import AttnConfig
    from minisgl.kvcache.pool import KVPool

    num_pages = sum(-(-n // page_size) for n in seq_lens) + 8
    pool = KVPool(1, num_pages, page_size, num_kv_heads, head_dim, kv_dtype, torch.device("cuda"))
    pool.k_buffer.copy_(torch.randn(pool.k_buffer.shape, device="cuda"))
    pool.v_buffer.copy_(torch.randn(pool.v_buffer.shape, device="cuda"))
    table = torch.zeros(len(seq_lens), max_seq, dtype=torch.int32, device="cuda")
    pages = torch.randperm(num_pages, device="cuda").to(torch.int32)
    used = 0
    for row, n in enumerate(seq_lens):
        num = -(-n // page_size)
        own = pages[used : used + num]
        used += num
        table[row, :n] = (own[:, None] * page_size + torch.arange(page_size, device="cuda")).flatten()[:n]
    config = AttnConfig(num_heads, num_kv_heads, head_dim, max_seq, torch.device("cuda"), torch.bfloat16)
    return config, pool, table


def _batch(phase, table, prefix_lens, extend_lens):
    from minisgl.core import Batch, Req, SamplingParams

    reqs = [Req(i, [0], SamplingParams()) for i in range(len(prefix_lens))]
    batch = Batch(reqs, phase, list(prefix_lens), list(extend_lens), [True] * len(reqs))
    batch.table_idx = torch.arange(len(reqs), dtype=torch.int32, device="cuda")
    batch.seq_lens_t = torch.tensor(batch.seq_lens, dtype=torch.int32, device="cuda")
    batch.out_loc = torch.cat([table[r, p : p + e] for r, (p, e) in enumerate(zip(prefix_lens, extend_lens))])
    return batch


def _compare_backends(config, pool, table, batch):
    from minisgl.attention.torch_backend import TorchAttnBackend
    from minisgl.attention.triton_backend import TritonAttnBackend
    from minisgl.kernel import SplitAttention

    T = batch.num_tokens
    q = _randn(T, config.num_heads, config.head_dim)
    k, v = _randn(T, config.num_kv_heads, config.head_dim), _randn(T, config.num_kv_heads, config.head_dim)
    triton_backend = TritonAttnBackend(config, pool, table)
    triton_backend.prepare_metadata(batch)
    got = triton_backend.forward(q, k, v, 0, batch)
    if isinstance(got, SplitAttention):  # one request in several splits: the plan leaves the merge to o_proj
        got = got.merge().view(q.shape)
    torch_backend = TorchAttnBackend(config, pool, table)
    torch_backend.prepare_metadata(batch)
    want = torch_backend.forward(q, k, v, 0, batch)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
@pytest.mark.parametrize("batch_size", [1, 33, 256])
def test_decode_matches_torch_backend_at_model_shapes(page_size, heads, batch_size):
    _compare_decode(page_size, heads, batch_size, 4096 if batch_size <= 33 else 1024)


def _compare_decode(page_size, heads, batch_size, max_len, kv_dtype=torch.bfloat16):
    """A decode step of batch_size requests (one of max_len keys, one of 1, the rest random) over a
    random pool: Triton backend against torch backend."""
    torch.manual_seed(batch_size)
    seq_lens = torch.randint(1, max_len + 1, (batch_size,)).tolist()
    seq_lens[0] = max_len
    if batch_size > 1:
        seq_lens[1] = 1
    config, pool, table = _paged(page_size, *heads, seq_lens, max_seq=max_len, kv_dtype=kv_dtype)
    _compare_backends(
        config, pool, table, _batch(Phase.DECODE, table, [n - 1 for n in seq_lens], [1] * batch_size)
    )


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", HEADS + [(8, 4, 256)], ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
@pytest.mark.parametrize("batch_size", [1, 33, 256])
def test_decode_over_a_float8_pool_matches_torch_backend_at_model_shapes(page_size, heads, batch_size):
    """--kv-cache-dtype fp8_e4m3: V converts to fp16 from 32-bit words before the PV dots (one dot per dim
    class d % 4), K in the dot; up to 5,000 keys."""
    max_len = 5000 if batch_size <= 33 else 1024
    _compare_decode(page_size, heads, batch_size, max_len, kv_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
def test_extend_matches_torch_backend_at_model_shapes(page_size, heads):
    torch.manual_seed(0)
    prefix_lens, extend_lens = [0, 1000, 3000, 17, 0], [2048, 500, 1, 1300, 7]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    config, pool, table = _paged(page_size, *heads, seq_lens, max_seq=4096)
    _compare_backends(config, pool, table, _batch(Phase.PREFILL, table, prefix_lens, extend_lens))


# ---- CUDA graphs ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_engine():
    from minisgl.engine import Engine, EngineConfig

    config = EngineConfig(
        model_path=QWEN3_06B,
        dtype=torch.bfloat16,
        device="cuda",
        attn="triton",
        load_format="dummy",
        page_size=16,
        num_pages=4096,
        max_running_req=64,
        max_seq_len_override=4096,
        cuda_graph_max_bs=64,
        show_progress=False,
    )
    engine = Engine(config)
    engine.kv_pool.k_buffer.normal_()
    engine.kv_pool.v_buffer.normal_()
    try:
        yield engine
    finally:
        engine.shutdown()


def _decode_batch(engine, seq_lens):
    from minisgl.core import Batch, Req, SamplingParams

    ps, page, out_loc = engine.config.page_size, 0, []
    for row, n in enumerate(seq_lens):
        num = -(-n // ps)
        engine.page_table[row, :n] = torch.arange(
            page * ps, (page + num) * ps, dtype=torch.int32, device="cuda"
        )[:n]
        out_loc.append(page * ps + n - 1)
        page += num
    assert page <= engine.num_pages
    bs = len(seq_lens)
    batch = Batch(
        [Req(i, [0], SamplingParams()) for i in range(bs)],
        Phase.DECODE,
        [n - 1 for n in seq_lens],
        [1] * bs,
        [True] * bs,
    )
    batch.positions = torch.tensor([n - 1 for n in seq_lens], dtype=torch.int32, device="cuda")
    # the input tokens, where decode reads them
    engine.token_pool[torch.arange(bs, device="cuda"), batch.positions] = torch.randint(
        0, 151936, (bs,), dtype=torch.int32, device="cuda"
    )
    batch.out_loc = torch.tensor(out_loc, dtype=torch.int32, device="cuda")
    batch.table_idx = torch.arange(bs, dtype=torch.int32, device="cuda")
    batch.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return batch


@torch.inference_mode()
def _eager(engine, batch):
    engine.prepare_inputs(batch)
    engine.attn_backend.prepare_metadata(batch)
    with engine.ctx.forward_batch(batch):
        return engine.model()


@pytest.mark.parametrize("batch_size", [1, 5, 64])
def test_cuda_graph_decode_matches_eager_for_a_real_size_model(qwen3_engine, batch_size):
    runner = qwen3_engine.graph_runner
    assert runner is not None and runner.max_bs == 64
    torch.manual_seed(batch_size)
    seq_lens = torch.randint(1, 1000, (batch_size,)).tolist()
    batch = _decode_batch(qwen3_engine, seq_lens)
    want = _eager(qwen3_engine, batch).float()
    with torch.inference_mode():
        got = runner.replay(batch).hidden[:batch_size].float()
    assert batch.padded_size == runner.padded_size(batch_size)
    rel = (got - want).norm() / want.norm()
    assert rel < 5e-2, f"graph replay differs from eager by {rel:.3g} (relative)"


def test_cuda_graph_replay_is_faster_than_eager_at_batch_size_1(qwen3_engine):
    """Decode at batch 1 is launch-bound: this is what the graphs are for."""
    runner = qwen3_engine.graph_runner
    batch = _decode_batch(qwen3_engine, [1000])

    def timed(fn, n=20):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / n

    with torch.inference_mode():
        graph_s = timed(lambda: runner.replay(batch))
    eager_s = timed(lambda: _eager(qwen3_engine, batch))
    print(f"Qwen3-0.6B decode step at batch 1: graph {graph_s * 1e3:.2f} ms, eager {eager_s * 1e3:.2f} ms")
    assert graph_s < eager_s
