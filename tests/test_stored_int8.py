"""The opt-in int8-activation dot for stored Q4_0/Q4_1/Q8_0 weights, and Q4_K/Q5_K/Q6_K with AVX-512 VNNI
(`stored_dot="int8"`).

The C kernel equals a numpy reference of llama.cpp's arithmetic (activations quantized to int8 blocks of
32 with round half away from zero, exact integer block sums, float per-block terms) up to float summation
order, at any row count (the VNNI, AVX2 and scalar builds alike); it stays within a few percent of the
float32 matmul on the dequantized weights; and a tiny GGUF model's logits, through the CPU decode step
and through prefill, stay close to the exact path's while differing from them (so the switch took
effect)."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import CPU_KERNEL_VARIANTS, cpu_kernel_variant, make_llm, random_stored_rows, tiny_llm_kwargs

from minisgl.gguf.blocks import STORED_TYPES, TYPE_IDS, dequantize
from minisgl.gguf.stored import StoredPart, StoredWeight
from minisgl.kernel import cpu as cpu_kernels
from minisgl.kernel import stored as stored_kernels

gguf = pytest.importorskip("gguf")
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler: CPU kernels not built")

Q8_TYPES = ["Q4_0", "Q4_1", "Q8_0"]
_F32 = np.float32


def quantized_rows(name: str, n: int, k: int, seed: int, outliers: bool = False) -> torch.Tensor:
    """n random rows of k weights as `name` blocks from gguf's quantizer (uint8 [n, row bytes])."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(_F32)
    if outliers:  # a few weights 40x the spread: their blocks get large scales
        w[rng.integers(0, n, 8), rng.integers(0, k, 8)] = 2.0
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType[name])))


def _unpack(name: str, data: np.ndarray, k: int):
    """A stored weight's blocks as (quants int64 [n, k/32, 32], d, m float32 [n, k/32]), read from the
    GGUF block layout directly."""
    n, nb = data.shape[0], k // 32
    blocks = data.reshape(n, nb, -1)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(_F32)
    m = np.zeros_like(d)
    if name == "Q8_0":
        return blocks[..., 2:34].copy().view(np.int8).astype(np.int64), d, m
    if name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(_F32)
    qs = blocks[..., -16:].astype(np.int64)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # elements 0..15 low nibbles, 16..31 high
    return (q - 8 if name == "Q4_0" else q), d, m


def reference_quantize(x: np.ndarray):
    """x float32 [M, K] -> (q int64 [M, K/32, 32], d, s float32 [M, K/32]): llama.cpp's activation blocks."""
    xb = x.reshape(x.shape[0], -1, 32)
    d = (np.abs(xb).max(-1) / _F32(127)).astype(_F32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, _F32(1) / d, _F32(0)).astype(_F32)
    v = (xb * inv[..., None]).astype(np.float64)  # the float32 product, widened exactly
    q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int64)  # round half away from zero
    s = (d * q.sum(-1).astype(_F32)).astype(_F32)
    return q, d, s


def reference_int8_linear(name: str, x: np.ndarray, data: np.ndarray, bias: np.ndarray | None):
    """(y, magnitude) in float64: the per-block float32 terms of the int8 dot, summed; and the sum over
    blocks of |d_w d_x| sum |q_w q_x| (+ |m_w s_x|), which bounds every partial sum the kernel rounds."""
    k = x.shape[1]
    qx, dx, sx = reference_quantize(x)
    qw, dw, mw = _unpack(name, data, k)
    isum = np.einsum("mbj,nbj->mnb", qx, qw)  # exact integers
    iabs = np.einsum("mbj,nbj->mnb", np.abs(qx), np.abs(qw))
    scale = (dx[:, None, :] * dw[None, :, :]).astype(_F32)
    terms = (scale * isum.astype(_F32)).astype(_F32)
    mag = np.abs(scale.astype(np.float64)) * iabs
    if name == "Q4_1":
        mins = (mw[None, :, :] * sx[:, None, :]).astype(_F32)
        terms, mag = terms + mins, mag + np.abs(mins.astype(np.float64))
    y = terms.astype(np.float64).sum(-1)
    if bias is not None:
        y = y + bias.astype(np.float64)
    return y, mag.sum(-1)


def int8_linear(
    name: str, x: torch.Tensor, data: torch.Tensor, bias: torch.Tensor | None, lib=None
) -> np.ndarray:
    """The kernel's y (float64); lib: another build of the library (linear_stored_q8 called directly)."""
    y = torch.empty(x.shape[0], data.shape[0], dtype=torch.float32)
    if lib is None:
        cpu_kernels.linear_stored_q8(x, TYPE_IDS[name], data, bias, y)
    else:
        assert lib.linear_stored_q8(*cpu_kernels._stored_args(x, TYPE_IDS[name], data, bias, y)) == 0
    return y.numpy().astype(np.float64)


def _activations(rows: int, k: int, seed: int, zero_block: bool = False, outliers: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    if zero_block:
        x[:, 32:64] = 0.0  # d = 0: the block contributes nothing
    if outliers:
        x[:, 5] = 60.0  # one value dominates its block's scale
        x[-1, -1] = -300.0
    return x


def _check(name: str, x: torch.Tensor, data: torch.Tensor, bias: torch.Tensor | None, lib=None) -> None:
    got = int8_linear(name, x, data, bias, lib)
    expected, mag = reference_int8_linear(
        name, x.numpy(), data.numpy(), None if bias is None else bias.numpy()
    )
    _assert_within(got, expected, mag, x.shape[1], name)


def _assert_within(got: np.ndarray, expected: np.ndarray, mag: np.ndarray, k: int, what: str) -> None:
    """got is the reference's sum in another order: float32 sums of the same terms (the kernel's per-lane
    partial sums, per-block roundings, then the lanes' sum), at most one rounding of the magnitude per block
    and a few more."""
    tol = 1e-5 * np.abs(expected) + (k // 32 + 8) * 2**-24 * mag + 1e-7
    bad = np.abs(got - expected) > tol
    assert not bad.any(), (what, np.abs(got - expected)[bad][:5], tol[bad][:5])


@needs_kernels
@pytest.mark.parametrize("name", Q8_TYPES)
# passes of three or four rows of x and their tails; past 128 rows (MB_DOT) blocks of rows and a tail
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 32, 33, 100, 257])
# odd N: a partial group of 4 rows; K of 3, 17 and 6 blocks: partial groups of blocks
@pytest.mark.parametrize(("n", "k"), [(37, 96), (131, 544), (19, 192)])
def test_int8_dot_equals_the_reference(name, rows, n, k):
    data = quantized_rows(name, n, k, seed=rows * 7 + n)
    x = _activations(rows, k, seed=rows + k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)) if rows % 2 else None
    _check(name, x, data, bias)


@pytest.fixture(scope="module", params=list(CPU_KERNEL_VARIANTS))
def variant_lib(request):
    """The library built for an older CPU."""
    return cpu_kernel_variant(request.param)


@needs_kernels
@pytest.mark.parametrize("name", Q8_TYPES)
def test_fallback_builds_equal_the_reference(name, variant_lib):
    """The same integer sums without AVX-512 VNNI (AVX-VNNI's 256-bit dpbusd where the CPU has it, else
    maddubs/madd), without VNNI (AVX2), and without AVX2 (scalar)."""
    for rows, (n, k) in [(1, (37, 96)), (6, (131, 544)), (41, (19, 192))]:
        data = quantized_rows(name, n, k, seed=rows + n, outliers=True)
        x = _activations(rows, k, seed=rows, zero_block=True, outliers=True)
        _check(name, x, data, torch.randn(n, generator=torch.Generator().manual_seed(n)), variant_lib)


@needs_kernels
@pytest.mark.parametrize("name", Q8_TYPES)
def test_zero_blocks_and_outliers(name):
    n, k = 37, 544
    data = quantized_rows(name, n, k, seed=3, outliers=True)
    x = _activations(5, k, seed=4, zero_block=True, outliers=True)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(8))
    _check(name, x, data, bias)
    zero = torch.zeros(2, k)  # every block d = 0: exactly the bias
    assert np.array_equal(int8_linear(name, zero, data, bias), bias.numpy()[None].repeat(2, 0))


@needs_kernels
@pytest.mark.parametrize("name", Q8_TYPES + ["Q4_K", "Q5_K", "Q6_K"])
def test_int8_dot_is_close_to_the_float32_matmul(name):
    if name not in Q8_TYPES and not cpu_kernels.int8_dot_supported(TYPE_IDS[name]):
        pytest.skip("the int8 K-quant dot needs AVX-512 VNNI")
    n, k = 131, 768
    data = quantized_rows(name, n, k, seed=5) if name in Q8_TYPES else random_stored_rows(name, n, k, seed=5)
    x = _activations(4, k, seed=6)
    dense = dequantize(TYPE_IDS[name], data, k).double()
    exact = (x.double() @ dense.T).numpy()
    got = int8_linear(name, x, data, None)
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert 0 < rel < 0.02, rel  # 8-bit activations: about 0.5% per element, never exact


# ---- Q4_K / Q5_K / Q6_K (AVX-512 VNNI builds) ------------------------------------------------------------
K_TYPES = ["Q4_K", "Q5_K", "Q6_K"]
needs_k_int8 = pytest.mark.skipif(
    not cpu_kernels.int8_dot_supported(TYPE_IDS["Q4_K"]),
    reason="the int8 K-quant dot needs AVX-512 VNNI",
)


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16)[..., 0].astype(_F32)


def _unpack_k(name: str, data: np.ndarray, k: int):
    """A K-quant weight's values as integers per sub-block of 16 (q int64 [n, k/16, 16], Q6_K's offset of 32
    taken off) with each one's scale (float32 [n, k/16]: d sc) and, for Q4_K/Q5_K, each sub-block of 32's min
    (float32 [n, k/32]: dmin m), read from ggml's super-block layout directly."""
    n = data.shape[0]
    b = data.reshape(n, k // 256, -1).astype(np.int64)
    if name in ("Q4_K", "Q5_K"):
        blk = data.reshape(n, k // 256, -1)
        d, dmin, sc8 = _f16(blk[..., 0:2]), _f16(blk[..., 2:4]), b[..., 4:16]
        qs = b[..., 48:] if name == "Q5_K" else b[..., 16:]
        sc = np.concatenate([sc8[..., 0:4] & 63, (sc8[..., 8:12] & 15) | ((sc8[..., 0:4] >> 6) << 4)], -1)
        mn = np.concatenate([sc8[..., 4:8] & 63, (sc8[..., 8:12] >> 4) | ((sc8[..., 4:8] >> 6) << 4)], -1)
        # sub-block 2j: low nibbles of qs[32j:32j+32], 2j+1: their high nibbles; Q5_K's fifth bit of
        # sub-block t's element l: bit t of qh[l]
        q = np.stack([qs.reshape(n, -1, 4, 32) & 15, qs.reshape(n, -1, 4, 32) >> 4], 3).reshape(n, -1, 8, 32)
        if name == "Q5_K":
            qh = b[..., 16:48]
            q = q | (((qh[..., None, :] >> np.arange(8)[:, None]) & 1) << 4)
        dl = (d[..., None] * sc.astype(_F32)).astype(_F32)  # [n, S, 8]
        ml = (dmin[..., None] * mn.astype(_F32)).astype(_F32)
        return q.reshape(n, -1, 16), np.repeat(dl.reshape(n, -1), 2, 1), ml.reshape(n, -1)
    ql, qh, sc = b[..., 0:128], b[..., 128:192], data.reshape(n, k // 256, -1)[..., 192:208].view(np.int8)
    d = _f16(data.reshape(n, k // 256, -1)[..., 208:210])
    halves = []
    for h in range(2):
        lo, hi = ql[..., 64 * h : 64 * h + 64], qh[..., 32 * h : 32 * h + 32]
        halves += [(lo[..., :32] & 15) | ((hi & 3) << 4), (lo[..., 32:] & 15) | (((hi >> 2) & 3) << 4),
                   (lo[..., :32] >> 4) | (((hi >> 4) & 3) << 4), (lo[..., 32:] >> 4) | (((hi >> 6) & 3) << 4)]  # fmt: skip
    q = np.stack(halves, 2).reshape(n, -1, 16) - 32
    dl = (d[..., None] * sc.astype(_F32)).astype(_F32).reshape(n, -1)
    return q, dl, None


def reference_int8_linear_k(name: str, x: np.ndarray, data: np.ndarray):
    """(y, magnitude) in float64 as reference_int8_linear: per sub-block of 16 the exact integer sum times
    (d sc) d_x, and Q4_K/Q5_K's -(dmin m) s_x per block of 32, each term rounded to float32, summed."""
    k = x.shape[1]
    qx, dx, sx = reference_quantize(x)
    qw, dl, ml = _unpack_k(name, data, k)
    qx16 = qx.reshape(x.shape[0], -1, 16)
    isum = np.einsum("mbj,nbj->mnb", qx16, qw)
    iabs = np.einsum("mbj,nbj->mnb", np.abs(qx16), np.abs(qw))
    scale = (np.repeat(dx, 2, 1)[:, None, :] * dl[None, :, :]).astype(_F32)
    terms = (scale * isum.astype(_F32)).astype(_F32)
    mag = (np.abs(scale.astype(np.float64)) * iabs).sum(-1)
    y = terms.astype(np.float64).sum(-1)
    if ml is not None:
        mins = (ml[None, :, :] * sx[:, None, :]).astype(_F32)
        y, mag = y - mins.astype(np.float64).sum(-1), mag + np.abs(mins.astype(np.float64)).sum(-1)
    return y, mag


@needs_kernels
@needs_k_int8
@pytest.mark.parametrize("name", K_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 31])  # passes and their tails, up to Q8_K_ROWS
@pytest.mark.parametrize(("n", "k"), [(37, 256), (19, 768)])
def test_int8_k_quant_dot_equals_the_reference(name, rows, n, k):
    data = random_stored_rows(name, n, k, seed=rows * 7 + n)
    x = _activations(rows, k, seed=rows + k, zero_block=rows == 3, outliers=rows == 5)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)) if rows % 2 else None
    got = int8_linear(name, x, data, bias)
    expected, mag = reference_int8_linear_k(name, x.numpy(), data.numpy())
    if bias is not None:
        expected = expected + bias.numpy().astype(np.float64)
    _assert_within(got, expected, mag, k, name)


@needs_kernels
@needs_k_int8
@pytest.mark.parametrize("name", K_TYPES)
def test_k_quants_at_32_rows_and_more_take_the_exact_kernels(name):
    """From 32 rows of x (a prefill) the exact GEMM on dequantized panels is the faster: the same bytes as
    the exact dot's."""
    n, k = 37, 512
    data = random_stored_rows(name, n, k, seed=13)
    for rows in (32, 70):
        x = _activations(rows, k, seed=rows)
        exact = torch.empty(rows, n)
        cpu_kernels.linear_stored(x, TYPE_IDS[name], data, None, exact)
        assert np.array_equal(int8_linear(name, x, data, None), exact.numpy().astype(np.float64))


@needs_kernels
def test_other_types_and_shapes_are_refused():
    y = torch.empty(2, 8)
    q3_k = torch.zeros(8, 110, dtype=torch.uint8)
    with pytest.raises(ValueError):  # not a type the int8 dot reads
        cpu_kernels.linear_stored_q8(torch.randn(2, 256), TYPE_IDS["Q3_K"], q3_k, None, y)
    q8_0 = torch.zeros(8, 68, dtype=torch.uint8)
    with pytest.raises(ValueError):  # k 48: not whole blocks of 32
        cpu_kernels.linear_stored_q8(torch.randn(2, 48), TYPE_IDS["Q8_0"], q8_0, None, y)


# ---- through the CPU decode step ------------------------------------------------------------------------
def _one_step(engine, tokens: torch.Tensor, slot0: int) -> SimpleNamespace:
    """A decode batch of the first tokens of len(tokens) fresh sequences (page-table rows 0.., slots from
    slot0), as CpuDecodeStep.run reads it."""
    B = tokens.shape[0]
    rows = torch.arange(B, dtype=torch.int64)
    pos = torch.zeros(B, dtype=torch.int64)
    loc = slot0 + rows
    engine.page_table[rows, 0] = loc.to(engine.page_table.dtype)
    meta = SimpleNamespace(rows=rows, lens=pos + 1)
    return SimpleNamespace(size=B, input_ids=tokens, positions=pos, out_loc=loc, attn_metadata=meta)


def _step_logits(engine, step, seqs: torch.Tensor, slot0: int) -> torch.Tensor:
    """Logits [T, B, vocab] of the decode step run token by token over seqs [B, T] (teacher-forced: the
    same tokens whatever it predicts), each sequence on page-table row b, its keys at slots from slot0."""
    B, T = seqs.shape
    rows = torch.arange(B, dtype=torch.int64)
    out = []
    for t in range(T):
        pos = torch.full((B,), t, dtype=torch.int64)
        loc = slot0 + rows * T + t
        engine.page_table[rows, t] = loc.to(engine.page_table.dtype)
        meta = SimpleNamespace(rows=rows, lens=pos + 1)  # what CpuAttnBackend.prepare_metadata makes
        batch = SimpleNamespace(size=B, input_ids=seqs[:, t], positions=pos, out_loc=loc, attn_metadata=meta)
        out.append(engine.model.compute_logits(step.run(batch)).float())
    return torch.stack(out)


@pytest.mark.skipif(not cpu_kernels.decode_step_available(), reason="no AVX2 build of the C kernels")
@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe"])
def test_decode_step_int8_is_close_to_exact(name, tmp_path):
    """Both steps teacher-forced over the same sequences (the engine's LM head multiplies as int8)."""
    from test_gguf_stored import SPECS, write_tiny_gguf

    from minisgl.engine.cpu_step import CpuDecodeStep

    gguf_path, _ = write_tiny_gguf(name, str(tmp_path))
    vocab = SPECS[name][3]["vocab_size"]
    kw = tiny_llm_kwargs(weights_format="stored", attn="cpu", stored_dot="int8", max_running_req=40)
    with make_llm(gguf_path, **kw) as llm, torch.inference_mode():
        engine = llm.scheduler.engine
        int8 = engine.cpu_step
        args = (engine.model, engine.kv_pool, engine.page_table, engine.attn_backend, engine.dtype)
        exact = CpuDecodeStep.create(*args, "exact")
        prepared = engine.model_dir
        for B in (3, 5, 13, 40):  # passes of three or four rows of x and their tails; past the old 32
            seqs = torch.randint(0, vocab, (B, 6), generator=torch.Generator().manual_seed(B))
            a = _step_logits(engine, exact, seqs, slot0=0)
            b = _step_logits(engine, int8, seqs, slot0=1000)
            cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
            # ~1% of the logits (about 10 here): the mean stays put, the minimum falls with more rows; with
            # experts a token whose router's top k flips under the perturbation moves further (one of 40,
            # which by itself takes up to (1 - 0.9) / 40 off the mean; which token flips depends on the ISA's
            # int8 rounding: on an AVX2-only machine one row lands at 0.80, so the mean is 0.9988 there)
            lo = (0.995, 0.75) if name == "qwen3_moe" else (0.9995, 0.995)
            assert cos.mean() > lo[0] and cos.min() > lo[1], (name, B, cos.mean(), cos.min())
            assert (cos > 0.995).float().mean() > 0.95, (name, B, cos)
            assert (a - b).abs().max() > 0, "the int8 dot changed nothing: the exact path ran"
        # the LM head: the model's own, its weight's dot int8 in this engine (gguf.stored.set_dot): the int8 dot
        # where the head is a type it reads (llama: the tied Q8_0 embedding; qwen3: Q6_K with AVX-512
        # VNNI), exact otherwise
        h = exact.run(_one_step(engine, seqs[:4, 0], slot0=2000))
        head = engine.model.lm_head.weight
        assert head.dot == "int8"
        got = engine.model.compute_logits(h).double().numpy()
        part = head.parts[0]
        plain = (h.double() @ part.dequantize().double().T).numpy()
        kind = STORED_TYPES[part.ggml_type][0]
        if cpu_kernels.int8_dot_supported(part.ggml_type):
            ref = reference_int8_linear_k if kind in K_TYPES else reference_int8_linear
            want, mag = ref(kind, h.numpy(), part.data.numpy(), *([] if kind in K_TYPES else [None]))
            _assert_within(got, want, mag, part.k, "the LM head")
            assert not np.allclose(got, plain, rtol=1e-5, atol=1e-5)
        else:
            assert np.allclose(got, plain, rtol=1e-4, atol=1e-4)
    shutil.rmtree(prepared, ignore_errors=True)  # the cached config directory of this temporary file


# ---- stored_kernels.linear and prefill -----------------------------------------------------------------------
@needs_kernels
def test_stored_linear_takes_the_int8_dot_for_its_parts():
    """A weight in parts (a merged QKV): with dot "int8" the Q8_0 and Q4_1 parts equal the int8 reference
    and the F16 part stays the float32 matmul on its dequantized rows; "exact" keeps every part exact."""
    k = 256
    names, ns = ["Q8_0", "F16", "Q4_1"], [12, 8, 21]
    f16 = (torch.randn(ns[1], k, generator=torch.Generator().manual_seed(1)) * 0.05).half()
    data = [
        f16.view(torch.uint8) if nm == "F16" else quantized_rows(nm, n, k, seed=n) for nm, n in zip(names, ns)
    ]
    parts = [StoredPart(TYPE_IDS[nm], d, n, k) for nm, d, n in zip(names, data, ns)]
    w = StoredWeight(parts)
    x = _activations(37, k, seed=9)
    bias = torch.randn(sum(ns), generator=torch.Generator().manual_seed(2))
    dense = torch.cat([p.dequantize() for p in parts]).double()
    exact = (x.double() @ dense.T + bias.double()).numpy()
    y_exact = stored_kernels.linear(x, w, bias).double().numpy()
    assert np.allclose(y_exact, exact, rtol=1e-4, atol=1e-4)
    w.dot = "int8"
    got = stored_kernels.linear(x, w, bias).double().numpy()
    off = 0
    for nm, p in zip(names, parts):
        sl = slice(off, off + p.n)
        if nm == "F16":
            assert np.allclose(got[:, sl], exact[:, sl], rtol=1e-4, atol=1e-4)
        else:
            want, mag = reference_int8_linear(nm, x.numpy(), p.data.numpy(), bias[sl].numpy())
            _assert_within(got[:, sl], want, mag, k, nm)
            assert not np.array_equal(got[:, sl], exact[:, sl])
        off += p.n


@needs_kernels
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_prefill_int8_is_close_to_exact(name, tmp_path):
    """One token of two prompts (48 rows of prefill): its log-probabilities come from the prefill's logits,
    which with --stored-dot int8 differ from the exact path's but stay close."""
    from helpers import random_prompt
    from test_gguf_stored import SPECS, write_tiny_gguf

    from minisgl.core import SamplingParams

    gguf_path, _ = write_tiny_gguf(name, str(tmp_path))
    vocab = SPECS[name][3]["vocab_size"]
    prompts = [random_prompt(n, vocab, seed=n) for n in (41, 7)]
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=20)
    top = {}
    for dot in ("exact", "int8"):
        kw = tiny_llm_kwargs(weights_format="stored", attn="cpu", stored_dot=dot)
        with make_llm(gguf_path, **kw) as llm:
            engine = llm.scheduler.engine
            assert engine.model.model.layers[0].mlp.gate_up_proj.weight.dot == dot
            top[dot] = [dict(out["top_logprobs"][0]) for out in llm.generate(prompts, sp)]
            prepared = engine.model_dir
    shutil.rmtree(prepared, ignore_errors=True)
    for a, b in zip(top["exact"], top["int8"]):
        shared = sorted(a.keys() & b.keys())
        assert len(shared) >= 15, "the two paths' most likely tokens are mostly the same"
        la, lb = np.array([a[t] for t in shared]), np.array([b[t] for t in shared])
        # as in the decode step: ~1% of logits of about 10, so tenths of a log-probability at most (every
        # projection of the llama model takes the int8 dot where its K-quants do, AVX-512 VNNI)
        assert np.abs(la - lb).max() < 0.4 and np.corrcoef(la, lb)[0, 1] > 0.99, (la, lb)
        assert np.abs(la - lb).max() > 0, "the int8 dot changed nothing: the exact path ran"
