"""Batched sampling (kernel.sample): its torch reference against the exact filtered distribution, the Triton
kernel (under TRITON_INTERPRET=1 without CUDA) against the reference token for token, seeded noise that
depends on (seed, position) alone, the decode graph's sampling graph against eager sampling, and min_p
through the API's parameter mapping.

Distribution tests draw many tokens as many rows of one logit vector (seeded rows at distinct positions,
unseeded rows at distinct row indices) and compare the frequencies with the softmax distribution tempered,
cut by min-p, top-k and top-p (renormalised after each, in that order) by hand, with a chi-square bound
at a fixed seed; each also checks that a plausible mistake in the filter is rejected."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import TINY_SPECS, make_llm, random_prompt, tiny_llm_kwargs
from test_sampler import chi_square_bound

from minisgl.core import InvalidRequest, Req, SamplingParams
from minisgl.engine.sampler import Sampler, SamplingInfo, rows_of
from minisgl.kernel import SamplingRows
from minisgl.kernel import reference as ref

if not torch.cuda.is_available():  # must be set before Triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cpu")
LOGITS = torch.tensor([2.0, 1.6, 1.1, 0.7, 0.2, -0.3, -0.9, -1.5, -2.4, -4.0])
VOCAB = LOGITS.numel()
DRAWS = 40_000


def expected_probs(t: float, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """By hand, as vLLM orders it: softmax(logits / t); keep p >= min_p * max p; keep the top_k most likely;
    keep the smallest head of what is left whose renormalised mass reaches top_p; renormalise."""
    p = torch.softmax(LOGITS.double() / t, dim=0).tolist()
    order = sorted(range(VOCAB), key=lambda i: -p[i])
    kept = [i for i in order if p[i] >= min_p * p[order[0]]]
    if top_k > 0:
        kept = kept[:top_k]
    total, head, mass = sum(p[i] for i in kept), [], 0.0
    for i in kept:
        if mass >= top_p * total - 1e-12:
            break
        head.append(i)
        mass += p[i]
    q = torch.zeros(VOCAB, dtype=torch.float64)
    for i in head:
        q[i] = p[i]
    return q / q.sum()


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of the draws against probs; a draw outside probs' support fails at once."""
    counts = torch.bincount(tokens.long(), minlength=VOCAB).double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the kept set: {counts.tolist()}"
    exp = probs[support] * counts.sum()
    return float(((counts[support] - exp) ** 2 / exp).sum())


def assert_matches(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    df = int((probs > 0).sum()) - 1
    if df == 0:
        assert (tokens == int(probs.argmax())).all()
        return
    stat = chi_square(tokens, probs)
    assert stat < chi_square_bound(df), f"chi-square {stat:.1f} >= {chi_square_bound(df):.1f} (df {df})"


def rejected(tokens: torch.Tensor, wrong: torch.Tensor) -> bool:
    """Whether the draws refute a wrong distribution: a token outside its support, or a far chi-square."""
    counts = torch.bincount(tokens.long(), minlength=VOCAB)
    if counts[wrong == 0].sum() > 0:
        return True
    return chi_square(tokens, wrong) > 10 * chi_square_bound(VOCAB - 1)


def draw(params: SamplingParams, n: int = DRAWS, fused: bool = True, seed: int = 0) -> torch.Tensor:
    """n draws from LOGITS, one per row: with a seed, the rows sit at positions 0..n-1 of that seed's
    stream; without, they are n rows of one step."""
    torch.manual_seed(seed)
    reqs = [Req(uid=i, token_ids=[0], sampling_params=params) for i in range(n)]
    info = SamplingInfo.build(reqs, list(range(n)), VOCAB, DEVICE)
    return Sampler(DEVICE, fused=fused).sample(LOGITS[None, :].expand(n, VOCAB), info)


CASES = {  # name -> (SamplingParams fields, a plausible wrong filter's expected_probs arguments)
    "temperature": ({"temperature": 0.7}, {"t": 1.0}),
    "min_p": ({"temperature": 1.0, "min_p": 0.2}, {"t": 1.0, "min_p": 0.1}),
    "top_k": ({"temperature": 0.8, "top_k": 4}, {"t": 0.8, "top_k": 5}),  # off by one
    "top_p": ({"temperature": 1.0, "top_p": 0.6}, {"t": 1.0}),
    # top-p over what top-k kept, renormalised; the wrong one takes top-p over the whole distribution
    "top_k_top_p": ({"temperature": 1.5, "top_k": 5, "top_p": 0.7}, {"t": 1.5, "top_p": 0.7}),
    "min_p_top_p": ({"temperature": 1.2, "min_p": 0.15, "top_p": 0.9}, {"t": 1.2, "top_p": 0.9}),
    "all": ({"temperature": 0.9, "min_p": 0.05, "top_k": 6, "top_p": 0.9}, {"t": 0.9, "top_k": 6}),
}


def _expected(fields: dict) -> torch.Tensor:
    f = dict(fields)
    return expected_probs(f.pop("temperature"), **f)


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_frequencies_match_the_filtered_distribution(case, seeded):
    fields, wrong = CASES[case]
    tokens = draw(SamplingParams(**fields, seed=1234 if seeded else None), seed=sorted(CASES).index(case))
    assert_matches(tokens, _expected(fields))
    assert rejected(tokens, expected_probs(**wrong))


def test_min_p_one_keeps_only_the_most_likely_token():
    assert (draw(SamplingParams(temperature=1.0, min_p=1.0), n=200) == 0).all()


def test_noise_is_exponential():
    """The hashed noise E is Exp(1): its mean, its variance and P(E < x) at small x (the draws' winners
    have small E) match; a seed's stream differs from another seed's and from the step seed's."""
    k0, k1 = ref.noise_keys(torch.tensor([5, 6]), torch.tensor([3, 3]), torch.tensor([0]))
    e = ref.exponential_noise(k0, k1, 200_000).double()
    for row in e:
        assert abs(row.mean() - 1) < 0.01 and abs(row.var() - 1) < 0.03
        for x in (1e-4, 1e-2, 0.5):
            want = 1 - torch.exp(torch.tensor(-x)).item()
            assert abs((row < x).double().mean().item() - want) < 5 * (want / row.numel()) ** 0.5 + 1e-6
    assert not torch.equal(e[0], e[1])


# ---- seeds -------------------------------------------------------------------------------------------------
def _batch_tokens(params: list[SamplingParams], positions: list[int], logits: torch.Tensor, fused=True):
    reqs = [Req(uid=i, token_ids=[0], sampling_params=p) for i, p in enumerate(params)]
    return Sampler(DEVICE, fused=fused).sample(logits, SamplingInfo.build(reqs, positions, VOCAB, DEVICE))


def test_a_seed_and_position_give_one_token_whatever_the_batch_and_its_order():
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    a = SamplingParams(temperature=1.0, top_p=0.9, seed=77)
    b = SamplingParams(temperature=0.8, min_p=0.1, top_k=5, seed=-3)
    other = [SamplingParams(temperature=1.3), SamplingParams(), SamplingParams(temperature=0.5, seed=2)]
    for pos in range(30):
        alone_a = _batch_tokens([a], [pos], logits[:1])
        alone_b = _batch_tokens([b], [pos], logits[1:2])
        mixed = _batch_tokens(other[:2] + [b, a] + other[2:], [9, 4, pos, pos, 1], logits[[2, 3, 1, 0, 4]])
        assert int(mixed[3]) == int(alone_a[0]) and int(mixed[2]) == int(alone_b[0])
    seqs = {s: [int(_batch_tokens([SamplingParams(temperature=1.0, seed=s)], [p], logits[:1])[0]) for p in
                range(40)] for s in (1, 2)}  # fmt: skip
    assert seqs[1] != seqs[2] and len(set(seqs[1])) > 1


def test_unseeded_rows_follow_torch_manual_seed():
    torch.manual_seed(3)
    logits = torch.randn(64, VOCAB)
    params = [SamplingParams(temperature=1.0)] * 64
    runs = []
    for seed in (11, 11, 12):
        torch.manual_seed(seed)
        runs.append(_batch_tokens(params, [5] * 64, logits).tolist())
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert len(set(runs[0])) > 3  # rows of one step draw independently, not one token for all


# ---- the Triton kernel against the reference --------------------------------------------------------------
# the filters rows set, in turn: (top-k, top-p, min-p); every 6th row greedy, every other row seeded
FILTERS = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (0, 1, 1), (1, 1, 1)]


def _random_rows(s: int, vocab: int, seed: int) -> SamplingRows:
    """Every combination of filters, greedy rows, seeded and unseeded rows; random values."""
    g = torch.Generator().manual_seed(seed)
    on = torch.tensor([FILTERS[i % len(FILTERS)] for i in range(s)], dtype=torch.bool).T
    temp = torch.where(torch.arange(s) % 6 == 5, 0.0, torch.rand(s, generator=g) * 1.5 + 0.2)
    top_k = torch.where(on[0], torch.randint(1, vocab // 4, (s,), generator=g), vocab)
    top_p = torch.where(on[1], torch.rand(s, generator=g) * 0.95 + 0.05, 1.0)
    min_p = torch.where(on[2], torch.rand(s, generator=g) * 0.3, 0.0)
    seeds = torch.randint(-(2**62), 2**62, (s,), generator=g)
    seeded = torch.arange(s) % 2 == 0
    counter = torch.where(seeded, torch.randint(0, 4096, (s,), generator=g), ref.UNSEEDED + torch.arange(s))
    floats, ints = torch.stack([temp, top_p, min_p]), torch.stack([top_k, seeds, counter])
    return rows_of(floats.float(), ints, torch.tensor([987654321]))


def _kernels():
    return pytest.importorskip("minisgl.kernel.triton")


@pytest.mark.parametrize("kind", ["distinct", "ties", "masked"])
def test_kernel_equals_reference_token_for_token(kind):
    """Distinct logits; many exact ties (half-precision logits: a threshold keeps a tie group whole); and
    -inf tokens (a grammar mask), which are never drawn."""
    ops = _kernels()
    s, vocab = 14, 300
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(s, vocab, generator=g) * 2
    if kind == "ties":
        logits = (logits * 2).round() / 2
    if kind == "masked":
        logits = logits.masked_fill(torch.rand(s, vocab, generator=g) < 0.7, float("-inf"))
    rows = _random_rows(s, vocab, seed=2)
    want = ref.sample(logits, rows)
    got = ops.sample(logits, rows, chunk=128)  # each row over 3 programs, the last one partly filled
    assert got.tolist() == want.tolist()
    if kind == "masked":
        assert torch.isfinite(logits.gather(1, got.long()[:, None])).all()
    greedy = rows.temperature == 0
    assert got[greedy].tolist() == logits[greedy].argmax(-1).tolist()


@pytest.mark.parametrize("has_top_k,has_top_p", [(False, False), (True, False), (False, True)])
def test_kernel_skips_the_searches_no_row_needs(has_top_k, has_top_p):
    """A batch where no row sets top-k (or top-p) launches no search for it; with neither, the draw takes
    the row's max and min-p floor from the stats itself. Min-p, greedy, seeded and unseeded rows, against
    the reference token for token."""
    ops = _kernels()
    s, vocab = 28, 300
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(s, vocab, generator=g) * 0.5  # flat: min-p 0.5-0.9 drops most of each row
    rows = _random_rows(s, vocab, seed=4)
    rows = rows._replace(
        top_k=rows.top_k if has_top_k else torch.full_like(rows.top_k, vocab),
        top_p=rows.top_p if has_top_p else torch.ones_like(rows.top_p),
        min_p=torch.where(rows.min_p > 0, torch.rand(s, generator=g) * 0.4 + 0.5, 0.0),
        has_top_k=has_top_k,
        has_top_p=has_top_p,
    )
    want = ref.sample(logits, rows)
    unfloored = ref.sample(logits, rows._replace(min_p=torch.zeros_like(rows.min_p)))
    assert (want != unfloored).any() and (rows.temperature == 0).any()  # min-p decides some draws
    got = ops.sample(logits, rows, chunk=128)
    assert got.tolist() == want.tolist()
    greedy = rows.temperature == 0
    assert got[greedy].tolist() == logits[greedy].argmax(-1).tolist()


@pytest.mark.parametrize("rounds", [2, 4])
def test_top_p_rounds_and_their_fallback(rounds, monkeypatch):
    """Top-p through the rounds (a candidate accepted once the mass above it is below top_p) and through
    the bisection for rows they leave unresolved: a tiny nucleus of a flat row (top_p 0.01) mostly falls
    back, a wide one (0.99) resolves at its first candidate.
    Peaked, flat and tied rows, with and without top-k, against the reference token for token."""
    ops = _kernels()
    monkeypatch.setattr(ops.sampling, "_ROUNDS", rounds)
    s, vocab = 20, 300
    g = torch.Generator().manual_seed(rounds)
    scale = torch.tensor([0.2, 1.0, 4.0, 2.0])[torch.arange(s) % 4][:, None]
    logits = torch.randn(s, vocab, generator=g) * scale
    logits[3::4] = (logits[3::4] * 2).round() / 2  # ties
    floats = torch.stack(
        [
            torch.full((s,), 0.8),
            torch.tensor([0.01, 0.3, 0.9, 0.99, 1.0])[torch.arange(s) % 5],
            torch.zeros(s),
        ]
    )
    top_k = torch.where(torch.arange(s) % 3 == 0, 50, vocab)
    seeds, counter = torch.arange(s) * 7919, torch.where(torch.arange(s) % 2 == 0, 5, ref.UNSEEDED)
    rows = rows_of(floats, torch.stack([top_k, seeds, counter]), torch.tensor([11]))
    got = ops.sample(logits, rows, chunk=128)
    assert got.tolist() == ref.sample(logits, rows).tolist()


def test_kernel_draws_follow_the_filtered_distribution():
    """Draws through the kernel equal the reference's draws (whose frequencies the tests
    above check), and never leave the kept set."""
    ops = _kernels()
    fields = {"temperature": 0.9, "min_p": 0.05, "top_k": 6, "top_p": 0.9}
    n = 32
    reqs = [Req(uid=i, token_ids=[0], sampling_params=SamplingParams(**fields, seed=5)) for i in range(n)]
    info = SamplingInfo.build(reqs, list(range(n)), VOCAB, DEVICE)
    rows = info.rows._replace(step_seed=torch.tensor([1]))
    logits = LOGITS[None, :].expand(n, VOCAB).contiguous()
    got = ops.sample(logits, rows)
    assert got.tolist() == ref.sample(logits, rows).tolist()
    assert (_expected(fields)[got.long()] > 0).all()


# ---- through the engine: the decode graph's sampling graph against eager sampling ------------------------
def test_sampling_graph_equals_eager_sampling(tiny_model_dirs):
    """Seeded requests (and greedy ones beside them) give the same tokens when the decode graphs' sampling
    graphs sample them (sampler fused, emulated graphs) as when the torch reference samples after the graph."""
    vocab = TINY_SPECS["qwen3"].config_kwargs["vocab_size"]
    prompts = [random_prompt(n, vocab, seed=300 + n) for n in (5, 12, 21)]
    params = [
        SamplingParams(temperature=0.9, top_p=0.8, max_tokens=12, ignore_eos=True, seed=4),
        SamplingParams(temperature=1.2, min_p=0.05, top_k=20, max_tokens=12, ignore_eos=True, seed=5),
        SamplingParams(max_tokens=12, ignore_eos=True),
    ]
    outs = {}
    for sampler in ("fused", "torch"):
        kwargs = tiny_llm_kwargs(cuda_graph_max_bs=4, sampler=sampler)
        with make_llm(tiny_model_dirs["qwen3"], **kwargs) as llm:
            outs[sampler] = [o["token_ids"] for o in llm.generate(prompts, params)]
            runner = llm.scheduler.engine.graph_runner
            assert (runner.sample_replays > 0) == (sampler == "fused")
    assert outs["fused"] == outs["torch"]


# ---- min_p as a request field --------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), "0.1"])
def test_min_p_out_of_range_is_rejected_naming_it(value):
    with pytest.raises(InvalidRequest, match="min_p"):
        SamplingParams(min_p=value).validate()


def test_min_p_maps_from_the_request_body():
    from minisgl.service.openai.errors import APIError, FieldNames
    from minisgl.service.openai.params import sampling
    from minisgl.service.openai.protocol import SamplingBody, parse

    names = FieldNames("prompt")
    body = parse(SamplingBody, {"min_p": 0.25, "temperature": 0.5})
    assert sampling(body, 4, names, False, 0).params.min_p == 0.25
    assert sampling(parse(SamplingBody, {}), 4, names, False, 0).params.min_p == 0.0
    with pytest.raises(APIError) as e:
        sampling(parse(SamplingBody, {"min_p": 2.0}), 4, names, False, 0)
    assert e.value.param == "min_p"


def test_min_p_travels_through_the_message_serializer():
    from minisgl.message import TokenizeMsg
    from minisgl.message.serialize import dumps, loads

    back = loads(dumps(TokenizeMsg(uid=1, sampling_params=SamplingParams(min_p=0.3), text="hi")))
    assert back.sampling_params.min_p == 0.3
