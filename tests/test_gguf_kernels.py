"""Stored GGUF weights: the torch reference dequantization equals gguf.quants.dequantize bit for bit, and
the C kernels (embedding rows, the one-row dot path, the several-row panel path) equal that reference
dequantization followed by a float32 matmul, up to summation order, on random blocks at odd shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import CPU_KERNEL_VARIANTS, cpu_kernel_variant, random_stored_rows

from minisgl.gguf import blocks
from minisgl.gguf.stored import StoredPart, StoredWeight
from minisgl.kernel import cpu as cpu_kernels
from minisgl.kernel import stored as stored_kernels

gguf = pytest.importorskip("gguf")
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler: CPU kernels not built")

BLOCK_TYPES = [
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_NL",
    "IQ4_XS",
    "F16",
    "BF16",
    "F32",
]
random_rows = random_stored_rows


@pytest.mark.parametrize("name", [n for n in BLOCK_TYPES if n not in ("F32",)])
def test_reference_dequantize_equals_gguf(name):
    n, k = 7, 512
    data = random_rows(name, n, k, seed=1)
    expected = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType[name])
    got = blocks.dequantize(blocks.TYPE_IDS[name], data, k)
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(expected, dtype=np.float32)))


@needs_kernels
@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_embedding_rows_are_the_reference_dequantization(name):
    n, k = 37, 512
    data = random_rows(name, n, k, seed=2)
    w = StoredWeight([StoredPart(blocks.TYPE_IDS[name], data, n, k)])
    ids = torch.tensor([[3, 0, 36], [36, 5, 5]])
    expected = blocks.dequantize(blocks.TYPE_IDS[name], data, k)[ids]
    assert torch.equal(
        stored_kernels.embedding(ids, w), expected
    )  # exact: no arithmetic beyond the reference's


@needs_kernels
@pytest.mark.parametrize("name", BLOCK_TYPES)
# 1-9 rows: the dot path (all rows of x at a time), 10+: the panel path; on AVX-512, 16+: x's rows in the
# lanes, in blocks of 16 (a partial block at 33) and 8 blocks at a time (129: a ninth)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 13, 16, 33, 129])
@pytest.mark.parametrize("n", [5, 37])  # not multiples of the 4-row groups or 16-row panels
def test_linear_equals_reference_matmul(name, rows, n):
    t = blocks.TYPE_IDS[name]
    k = 768 if blocks.STORED_TYPES[t][1] == 256 else 352  # 352: a last K chunk shorter than 256
    data = random_rows(name, n, k, seed=rows * 10 + n)
    w = StoredWeight([StoredPart(t, data, n, k)])
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g)
    dense = blocks.dequantize(t, data, k)
    expected = (x.double() @ dense.double().T + bias.double()).float()
    got = stored_kernels.linear(x, w, bias)
    assert stored_kernels._kernel_ok(w), f"{name}: the C kernels do not read it (the reference ran)"
    # float32 sums of k products in another order: a few ulps of the sum of |products|
    tol = 1e-6 * k * (x.abs().double() @ dense.abs().double().T).max().item() / k * 8
    torch.testing.assert_close(got, expected, atol=tol, rtol=1e-5)


@needs_kernels
def test_merged_parts_of_different_types_and_strided_rows():
    """A merged QKV whose parts differ in type writes each part into its columns; x may be a row view."""
    k = 512
    parts = [
        StoredPart(blocks.TYPE_IDS[name], random_rows(name, n, k, seed=i), n, k)
        for i, (name, n) in enumerate([("Q4_K", 24), ("Q6_K", 8), ("Q8_0", 8)])
    ]
    w = StoredWeight(parts)
    for rows in (3, 20):  # the dot path; the panel path (x's rows in the lanes on AVX-512)
        x = torch.randn(rows, 2 * k)[:, :k]  # row stride 2k
        expected = x.double() @ w.dequantize().double().T
        torch.testing.assert_close(stored_kernels.linear(x, w).double(), expected, atol=1e-3, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("variant", ["native", *CPU_KERNEL_VARIANTS])
def test_a_row_of_x_gets_the_same_bits_whatever_rows_go_with_it(variant, monkeypatch):
    """A verify step multiplies up to 9 rows of x where a decode step multiplies one: each row's output must
    be the bits it gets alone (the dot paths agree on every sum's order), or greedy speculation could part
    from greedy decoding at a near-tie. Every type, a last K chunk shorter than 256, and a K long enough that
    9 rows go over it in two spans."""
    if variant != "native":
        monkeypatch.setattr(cpu_kernels, "_lib", cpu_kernel_variant(variant))
    cases = [
        (name, 768 if blocks.STORED_TYPES[blocks.TYPE_IDS[name]][1] == 256 else 352) for name in BLOCK_TYPES
    ]
    for name, k in [*cases, ("Q4_1", 6144), ("Q6_K", 6144)]:
        t = blocks.TYPE_IDS[name]
        data = random_rows(name, 13, k, seed=k)
        x = torch.randn(9, k, generator=torch.Generator().manual_seed(k))
        alone = torch.cat(
            [
                stored_kernels.linear(x[m : m + 1], StoredWeight([StoredPart(t, data, 13, k)]))
                for m in range(9)
            ]
        )
        for rows in range(2, 10):
            got = stored_kernels.linear(x[:rows], StoredWeight([StoredPart(t, data, 13, k)]))
            assert torch.equal(got, alone[:rows]), (
                f"{name}, K {k}, {rows} rows: a row's bits depend on the others"
            )
