"""The C kernels of minisgl.kernel.cpu equal an independent torch computation: attention against a float64
loop, the packed linear against float64, the elementwise kernels against kernel/reference.py."""

import pytest
import torch
import torch.nn.functional as F
from helpers import CPU_KERNEL_VARIANTS, cpu_kernel_variant, random_stored_rows

from minisgl import kernel
from minisgl.core import Phase
from minisgl.gguf import blocks
from minisgl.gguf.stored import StoredPart, StoredWeight
from minisgl.kernel import cpu as cpu_kernels
from minisgl.kernel import reference as ref

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler: CPU kernels not built")


def _naive_decode_attention(q, k_cache, v_cache, page_table, rows, lens, scale, window=0):
    """Softmax attention of each request's query over its keys (the last `window` of them where window >
    0), one request and one head at a time, in float64."""
    B, Hq, D = q.shape
    group = Hq // k_cache.shape[1]
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        first = max(0, lens[b] - window) if window else 0
        slots = page_table[rows[b], first : lens[b]].long()
        for h in range(Hq):
            keys = k_cache[slots, h // group].double()
            values = v_cache[slots, h // group].double()
            p = torch.softmax(keys @ q[b, h].double() * scale, dim=0)
            out[b, h] = p @ values
    return out.float()


@needs_kernels
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (9, 3), (7, 1)])
@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])  # 64 and 128 take the AVX2 path where it exists
# one or two long requests: each (request, KV head) cut into splits merged after (an empty one for [1, 700])
@pytest.mark.parametrize("lens", [[1], [7, 8, 9], [33, 1, 100, 64, 5], [300], [1, 700]])
@pytest.mark.parametrize("threads", [1, 2])  # the number of splits follows the threads
def test_decode_attention_matches_naive(num_heads, num_kv_heads, head_dim, lens, threads):
    g = torch.Generator().manual_seed(len(lens) * 131 + head_dim)
    num_slots, max_len = max(400, sum(lens)), max(128, max(lens))
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g) * 2
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g)
    page_table = torch.zeros(len(lens) + 2, max_len, dtype=torch.int32)
    rows = torch.randperm(len(lens) + 2, generator=g)[: len(lens)]
    perm = torch.randperm(num_slots, generator=g).int()  # scattered slots, as after many steps
    start = 0
    for row, n in zip(rows.tolist(), lens):
        page_table[row, :n] = perm[start : start + n]
        start += n
    q = torch.randn(len(lens), num_heads, head_dim, generator=g)
    lens_t = torch.tensor(lens, dtype=torch.int64)
    scale = head_dim**-0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_kernels.decode_attention(q, k_cache, v_cache, page_table, rows, lens_t, scale)
    finally:
        torch.set_num_threads(before)
    expected = _naive_decode_attention(q, k_cache, v_cache, page_table, rows.tolist(), lens, scale)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [24, 64, 128])
# (page-table row, first length, rows) per request: a verify step's rows of one request attend their keys
# together; a run of 12 rows of 8 query heads of 128 is cut in two (at most 8192 query floats a run); the
# rows of (1, 70, 3) then (1, 40, 3) are two runs of one page-table row, not one of 6 rows
@pytest.mark.parametrize(
    "runs",
    [
        [(0, 300, 4)],
        [(2, 5, 9)],
        [(3, 31, 3), (0, 1, 1), (1, 700, 5), (2, 64, 2)],
        [(1, 70, 3), (1, 40, 3), (1, 43, 1)],
        [(3, 90, 12)],
    ],
)
@pytest.mark.parametrize("window", [0, 50])  # 50: some runs' rows start at different keys, so not one run
@pytest.mark.parametrize("threads", [1, 2])
def test_verify_rows_decode_attention_matches_naive(num_heads, num_kv_heads, head_dim, runs, window, threads):
    g = torch.Generator().manual_seed(head_dim + 7 * len(runs) + window)
    max_len = max(n + r for _, n, r in runs)
    k_cache = torch.randn(3000, num_kv_heads, head_dim, generator=g) * 2
    v_cache = torch.randn(3000, num_kv_heads, head_dim, generator=g)
    page_table = torch.randperm(3000, generator=g)[: 4 * max_len].int().reshape(4, max_len)
    rows, lens = [], []
    for row, n, r in runs:
        rows += [row] * r
        lens += list(range(n, n + r))
    q = torch.randn(len(rows), num_heads, head_dim, generator=g)
    rows_t, lens_t = torch.tensor(rows, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_kernels.decode_attention(q, k_cache, v_cache, page_table, rows_t, lens_t, 0.2, window)
    finally:
        torch.set_num_threads(before)
    expected = _naive_decode_attention(q, k_cache, v_cache, page_table, rows, lens, 0.2, window)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("head_dim", [24, 128])
@pytest.mark.parametrize("window", [1, 6, 50, 299])  # 299: the 300-key request's keys but its first
@pytest.mark.parametrize("lens", [[33, 1, 100, 64, 5], [1, 700], [300]])
@pytest.mark.parametrize("threads", [1, 2])
def test_sliding_window_decode_attention_matches_naive(head_dim, window, lens, threads):
    """A sliding-window layer: each query attends its last `window` keys, one task or cut into splits."""
    g = torch.Generator().manual_seed(window + head_dim)
    k_cache = torch.randn(1000, 2, head_dim, generator=g) * 2
    v_cache = torch.randn(1000, 2, head_dim, generator=g)
    page_table = torch.randint(0, 1000, (5, 700), generator=g, dtype=torch.int32)
    rows = torch.randperm(5, generator=g)[: len(lens)]
    q = torch.randn(len(lens), 8, head_dim, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lens_t = torch.tensor(lens, dtype=torch.int64)
        out = cpu_kernels.decode_attention(q, k_cache, v_cache, page_table, rows, lens_t, 0.3, window)
    finally:
        torch.set_num_threads(before)
    expected = _naive_decode_attention(q, k_cache, v_cache, page_table, rows.tolist(), lens, 0.3, window)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("variant", list(CPU_KERNEL_VARIANTS))
def test_fallback_builds_of_attention_and_linear_equal_the_references(variant, monkeypatch):
    """The forms an older CPU runs (AVX2 8-lane vectors, scalar loops), built with its -march: decode
    attention against the float64 loop, the packed float32 linear and the exact stored linear (the dot
    path, the panel path) against float64 products of the same weights."""
    gguf = pytest.importorskip("gguf")
    lib = cpu_kernel_variant(variant)
    monkeypatch.setattr(cpu_kernels, "_lib", lib)  # the wrappers below call this build
    g = torch.Generator().manual_seed(7)
    for hq, hkv, d, lens in [(9, 3, 64, [7, 300]), (8, 8, 128, [33]), (4, 2, 24, [5, 70])]:
        k_cache = torch.randn(700, hkv, d, generator=g)
        v_cache = torch.randn(700, hkv, d, generator=g)
        page_table = torch.randperm(700, generator=g)[: 2 * 300].int().reshape(2, 300)
        rows = torch.arange(len(lens), dtype=torch.int64)
        q = torch.randn(len(lens), hq, d, generator=g)
        lens_t = torch.tensor(lens, dtype=torch.int64)
        out = cpu_kernels.decode_attention(q, k_cache, v_cache, page_table, rows, lens_t, d**-0.5)
        expected = _naive_decode_attention(q, k_cache, v_cache, page_table, rows.tolist(), lens, d**-0.5)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    for m in (1, 5, 9, 20, 40):
        x = torch.randn(m, 288, generator=g)
        if hasattr(lib, "linear_packed_f32"):
            w = torch.randn(37, 288, generator=g)
            got = cpu_kernels.linear(x, cpu_kernels.pack_weight(w), 37)
            torch.testing.assert_close(got, (x.double() @ w.double().T).float(), atol=1e-4, rtol=1e-5)
        for name in ("Q4_0", "Q4_1", "Q8_0"):
            t = blocks.TYPE_IDS[name]
            data = torch.from_numpy(
                gguf.quants.quantize(
                    torch.randn(37, 288, generator=g).numpy() * 0.05, gguf.GGMLQuantizationType[name]
                )
            )
            y = torch.empty(m, 37)
            cpu_kernels.linear_stored(x, t, data, None, y)
            dense = blocks.dequantize(t, data, 288)
            torch.testing.assert_close(y, (x.double() @ dense.double().T).float(), atol=1e-4, rtol=1e-5)
        # every other block type, on random blocks (K-quants: rows of 512, two blocks)
        xk = torch.randn(m, 512, generator=g)
        for name in ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"):
            t = blocks.TYPE_IDS[name]
            data = random_stored_rows(name, 37, 512, seed=m)
            y = torch.empty(m, 37)
            cpu_kernels.linear_stored(xk, t, data, None, y)
            dense = blocks.dequantize(t, data, 512)
            expected = (xk.double() @ dense.double().T).float()
            # float32 sums in another order: a few ulps of the sum of |products| (random scales run large)
            tol = 8e-6 * (xk.abs().double() @ dense.abs().double().T).max().item()
            torch.testing.assert_close(y, expected, atol=tol, rtol=1e-5, msg=f"{name}, {m} rows")
            embedded = cpu_kernels.dequant_rows(t, data, 512, torch.tensor([36, 0, 5]), 3)
            assert torch.equal(embedded, dense[[36, 0, 5]]), f"{name}: rows not the reference's"


@pytest.mark.parametrize("rows", [1, 3, 7, 32, 300])
@pytest.mark.parametrize("out_features,in_features", [(200, 96), (16, 37), (5, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64(rows, out_features, in_features, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    expected = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(kernel.linear(x, w, b), expected, atol=1e-4, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 9, 64])
def test_half_precision_linear_is_the_float64_product_rounded_once(dtype, rows):
    """bf16/fp16 on a CPU: exact products summed in float32 (as a half-precision GEMM accumulates), the
    result rounded to the dtype once; checked against the float64 product rounded to the dtype."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = (torch.randn(130, 96, generator=g) * 0.1).to(dtype)
    b = torch.randn(130, generator=g).to(dtype)
    got = kernel.linear(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, 130)
    exact = F.linear(x.double(), w.double(), b.double())
    # float32 accumulation may land one rounding step of the dtype away from the exact product
    step = (exact.abs() * (2**-7 if dtype == torch.bfloat16 else 2**-10)).clamp_min(1e-3)
    assert ((got.double() - exact).abs() <= step).all()


def test_linear_follows_weight_updates():
    """The packed copy of a weight is rebuilt when the weight is written in place."""
    w = torch.randn(16, 8)
    x = torch.randn(4, 8)
    kernel.linear(x, w)
    w.mul_(2)
    torch.testing.assert_close(kernel.linear(x, w), x @ w.t(), atol=1e-5, rtol=1e-5)


# ---- elementwise kernels, against kernel/reference.py -------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("rows,hidden", [(1, 8), (5, 37), (33, 576)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(rows, hidden, with_residual):
    g = torch.Generator().manual_seed(rows * hidden)
    wide = torch.randn(rows, hidden + 5, generator=g) * 3
    x = wide[:, :hidden]  # rows with a stride, as a slice of a wider projection
    weight = torch.randn(hidden, generator=g)
    if with_residual:
        residual = torch.randn(rows, hidden, generator=g)
        out, new_residual = cpu_kernels.rms_norm(x, weight, 1e-5, residual)
        expected, expected_residual = ref.fused_add_rms_norm(x, residual, weight, 1e-5)
        torch.testing.assert_close(new_residual, expected_residual)
    else:
        out, expected = cpu_kernels.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows,inter", [(1, 3), (4, 13), (32, 1536)])
def test_silu_and_mul_matches_reference(rows, inter):
    g = torch.Generator().manual_seed(inter)
    x = torch.randn(rows, 2 * inter, generator=g) * 8
    x[0, 0], x[-1, inter - 1] = 120.0, -120.0  # far tails of the exponential
    torch.testing.assert_close(cpu_kernels.silu_and_mul(x), ref.silu_and_mul(x), atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("head_dim,rot", [(16, 16), (64, 64), (24, 12)])
def test_rotary_matches_reference(head_dim, rot):
    g = torch.Generator().manual_seed(head_dim + rot)
    T, hq, hk = 6, 4, 2
    qkv = torch.randn(T, (hq + 2 * hk) * head_dim, generator=g)
    q = qkv[:, : hq * head_dim].view(T, hq, head_dim)  # views into the merged projection, as in the model
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(T, hk, head_dim)
    positions = torch.tensor([0, 1, 7, 100, 3, 3])
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.arange(128).float()[:, None] * inv[None, :]
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    expected_q, expected_k = ref.apply_rotary(q.clone(), k.clone(), positions, cache)
    out_q, out_k = cpu_kernels.apply_rotary(q, k, positions, cache)
    torch.testing.assert_close(out_q, expected_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_k, expected_k, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_store_kv_matches_reference():
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(5, 2 * 3 * 8, generator=g)
    k, v = kv[:, :24].view(5, 3, 8), kv[:, 24:].view(5, 3, 8)
    loc = torch.tensor([9, 0, 4, 17, 2])
    caches = [torch.zeros(20, 3, 8) for _ in range(4)]
    cpu_kernels.store_kv(caches[0], caches[1], loc, k, v)
    ref.store_kv(caches[2], caches[3], loc, k, v)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


# ---- half precision through the float32 kernels ----------------------------------------------------------------
@needs_kernels
def test_bf16_model_keeps_a_float32_kv_pool_and_decodes_like_the_torch_backend():
    """A bf16 model on a CPU: `auto` picks the cpu backend over a float32 pool (bf16 K/V stored exactly);
    its decode (query upcast, output rounded once) equals the torch backend's bf16 SDPA on the same keys."""
    from minisgl.attention import AttnConfig, create_attn_backend, kv_cache_dtype
    from minisgl.attention.cpu_backend import CpuAttnBackend
    from minisgl.attention.torch_backend import TorchAttnBackend
    from minisgl.core import Batch, Req, SamplingParams
    from minisgl.kvcache.pool import KVPool

    cpu = torch.device("cpu")
    assert kv_cache_dtype("auto", cpu, torch.bfloat16) == torch.float32
    assert kv_cache_dtype("torch", cpu, torch.bfloat16) == torch.bfloat16
    g = torch.Generator().manual_seed(0)
    lens, Hq, Hkv, D = [5, 40, 17], 6, 2, 64
    cfg = AttnConfig(Hq, Hkv, D, 64, cpu, torch.bfloat16)
    pool = KVPool(1, 70, 1, Hkv, D, torch.float32, cpu)
    pool.k_buffer.copy_(torch.randn(pool.k_buffer.shape, generator=g).bfloat16().float())
    pool.v_buffer.copy_(torch.randn(pool.v_buffer.shape, generator=g).bfloat16().float())
    table = torch.zeros(4, 64, dtype=torch.int32)
    slots = torch.randperm(69, generator=g).to(torch.int32)
    start = 0
    for row, n in enumerate(lens):
        table[row, :n] = slots[start : start + n]
        start += n
    batch = Batch(
        [Req(i, [0], SamplingParams()) for i in range(3)],
        Phase.DECODE,
        [n - 1 for n in lens],
        [1] * 3,
        [True] * 3,
    )
    batch.table_idx = torch.arange(3, dtype=torch.int32)
    batch.seq_lens_t = torch.tensor(lens, dtype=torch.int32)
    batch.out_loc = torch.stack([table[r, n - 1] for r, n in enumerate(lens)])
    q = torch.randn(3, Hq, D, generator=g).bfloat16()
    k, v = (
        pool.k_buffer[0, batch.out_loc.long()].bfloat16(),
        pool.v_buffer[0, batch.out_loc.long()].bfloat16(),
    )
    backend = create_attn_backend("auto", cfg, pool, table)
    assert isinstance(backend, CpuAttnBackend)
    backend.prepare_metadata(batch)
    got = backend.forward(q, k, v, 0, batch)
    reference = TorchAttnBackend(cfg, pool, table)
    reference.prepare_metadata(batch)
    want = reference.forward(q, k, v, 0, batch)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_kernels
@pytest.mark.parametrize("dot", ["exact", "int8"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_stored_experts_in_one_call_equal_the_reference_loop(tokens, dot):
    """A sparse layer's GGUF experts (Q4_K gate, Q8_0 up, Q6_K down) through moe_stored against the
    reference's loop over the experts (kernel/reference.py fused_moe, each expert's stored weights through
    kernel.linear): the same sums, added in the same expert order; some experts chosen by no token. int8:
    both multiply by the int8 dot where it reads the type (the same quantized rows)."""
    E, H, inter, k = 6, 256, 512, 2
    w13, w2 = [], []
    for e in range(E):
        parts = []
        for name, n, kk, seed in (
            ("Q4_K", inter, H, 3 * e),
            ("Q8_0", inter, H, 3 * e + 1),
            ("Q6_K", H, inter, 3 * e + 2),
        ):
            parts.append(StoredPart(blocks.TYPE_IDS[name], random_stored_rows(name, n, kk, seed), n, kk))
        w13.append(StoredWeight(parts[:2]))
        w2.append(StoredWeight(parts[2:]))
        w13[-1].dot = w2[-1].dot = dot
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.randint(0, E - 2, (tokens, k), generator=g, dtype=torch.int32)  # experts 4, 5: none
    ids[:, 1] = (ids[:, 0] + 1 + torch.randint(0, E - 3, (tokens,), generator=g)) % (E - 2)  # distinct
    weights = torch.rand(tokens, k, generator=g)
    desc = cpu_kernels.stored_experts([(*w13[e].parts, *w2[e].parts) for e in range(E)])
    got = cpu_kernels.moe_stored(x, ids, weights, desc, inter, int8=dot == "int8")
    want = ref.fused_moe(x, w13, w2, weights, ids, linear=kernel.linear)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-4)
    if dot == "int8":  # the switch took effect
        for w in w13 + w2:
            w.dot = "exact"
        assert not torch.allclose(
            got, ref.fused_moe(x, w13, w2, weights, ids, linear=kernel.linear), atol=1e-4
        )


def _argmax_cases(g: torch.Generator) -> list[torch.Tensor]:
    """Logit rows whose first maximum sits everywhere the two passes split work: in a vector, in the
    scalar tail, repeated across vectors, at the ends, under infinities; strided rows too."""
    cases = [
        torch.randn(16, 49152, generator=g),
        torch.randn(3, 1000, generator=g),
        torch.randn(5, 7, generator=g),
    ]
    cases.append(torch.randn(1, 1, generator=g))
    ties = torch.randn(6, 300, generator=g).round()  # small integers: many equal values
    ties[0, [5, 17, 250]] = 9.0  # the same maximum in three vectors
    ties[1, [299, 298]] = 9.0  # only in the tail (300 = 18 x 16 + 12)
    ties[2, 0], ties[2, 299] = 9.0, 9.0  # first and last
    ties[3] = float("-inf")  # every value -inf: index 0
    ties[4, [40, 41]] = float("inf")
    ties[5] = 0.0
    ties[5, 100] = -0.0  # equal to +0.0: index 0 stays first
    cases.append(ties)
    cases.append(torch.randn(4, 640, generator=g)[:, 3:517])  # rows 640 apart, 514 wide
    return cases


@needs_kernels
@pytest.mark.parametrize("variant", [None, *CPU_KERNEL_VARIANTS])
def test_the_argmax_kernel_equals_torch_argmax(variant, monkeypatch):
    """Every row's first maximum, as torch.argmax gives it, in every build; a row with a NaN is left to
    torch (which ranks NaN first)."""
    if variant is not None:
        monkeypatch.setattr(cpu_kernels, "_lib", cpu_kernel_variant(variant))
    g = torch.Generator().manual_seed(11)
    for x in _argmax_cases(g):
        got = cpu_kernels.argmax(x)
        assert got is not None and got.dtype == torch.int32
        assert got.tolist() == x.argmax(dim=-1).tolist(), x.shape
    x = torch.randn(3, 100, generator=g)
    x[1, 60] = float("nan")
    assert cpu_kernels.argmax(x) is None
    assert kernel.argmax(x).tolist() == x.argmax(dim=-1).tolist()  # torch's answer, NaN row included
