"""The C kernels of minisgl.kernel.cpu equal a plain torch computation, and the oneDNN linear equals
x @ W^T in float64; the cpu attention backend equals the torch backend inside the engine."""

import pytest
import torch
import torch.nn.functional as F

from minisgl import kernel
from minisgl.kernel import cpu as cpu_kernels

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler: CPU kernels not built")


def _naive_decode_attention(q, k_cache, v_cache, page_table, rows, lens, scale):
    """Softmax attention of each request's query over its keys, one request and one head at a time, in
    float64."""
    B, Hq, D = q.shape
    group = Hq // k_cache.shape[1]
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        slots = page_table[rows[b], : lens[b]].long()
        for h in range(Hq):
            keys = k_cache[slots, h // group].double()
            values = v_cache[slots, h // group].double()
            p = torch.softmax(keys @ q[b, h].double() * scale, dim=0)
            out[b, h] = p @ values
    return out.float()


@needs_kernels
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (9, 3), (7, 1)])
@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])  # 64 and 128 take the AVX2 path where it exists
@pytest.mark.parametrize("lens", [[1], [7, 8, 9], [33, 1, 100, 64, 5]])
def test_decode_attention_matches_naive(num_heads, num_kv_heads, head_dim, lens):
    g = torch.Generator().manual_seed(len(lens) * 131 + head_dim)
    num_slots, max_len = 400, 128
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
    out = cpu_kernels.decode_attention(q, k_cache, v_cache, page_table, rows, lens_t, scale)
    expected = _naive_decode_attention(q, k_cache, v_cache, page_table, rows.tolist(), lens, scale)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


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


def test_linear_follows_weight_updates():
    """The packed copy of a weight is rebuilt when the weight is written in place."""
    w = torch.randn(16, 8)
    x = torch.randn(4, 8)
    kernel.linear(x, w)
    w.mul_(2)
    torch.testing.assert_close(kernel.linear(x, w), x @ w.t(), atol=1e-5, rtol=1e-5)
