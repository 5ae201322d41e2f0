"""The sampler: greedy, temperature, top-k, top-p per request in one batch, and reproducible seeds.

Distribution tests draw many tokens from a fixed logit vector and compare the frequencies with the
softmax distribution (tempered, truncated and renormalised by hand) by a chi-square test at a fixed seed;
each also checks that a plausible mistake (ignoring the temperature, or the truncation) is rejected."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    TINY_SPECS,
    assert_all_kv_free,
    assert_tokens_equal_hf,
    make_llm,
    random_prompt,
    tiny_llm_kwargs,
)

from minisgl.core import Req, SamplingParams
from minisgl.engine.sampler import Sampler, SamplingInfo

DEVICE = torch.device("cpu")
LOGITS = torch.tensor([2.0, 1.6, 1.1, 0.7, 0.2, -0.3, -0.9, -1.5, -2.4, -4.0])
VOCAB = LOGITS.numel()
DRAWS = 40_000


def make_info(params: list[SamplingParams], positions: list[int] | None = None) -> SamplingInfo:
    reqs = [Req(uid=i, token_ids=[0, 1, 2], sampling_params=p) for i, p in enumerate(params)]
    positions = positions if positions is not None else [3] * len(reqs)
    return SamplingInfo.build(reqs, positions, VOCAB, DEVICE)


def draw(params: SamplingParams, n: int = DRAWS, seed: int = 0) -> torch.Tensor:
    """n independent draws: one batch of n rows with the same logits and the same (unseeded) params."""
    torch.manual_seed(seed)
    logits = LOGITS[None, :].repeat(n, 1)
    return Sampler(DEVICE).sample(logits, make_info([params] * n))


def expected_probs(temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """By hand: softmax(logits / T), keep the top k, then the smallest head of the sorted distribution whose
    mass reaches top_p (renormalised after top-k), renormalise."""
    p = torch.softmax(LOGITS.double() / temperature, dim=0)
    order = p.argsort(descending=True)
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    kept_mass, total = 0.0, float(p[order[: top_k if top_k > 0 else VOCAB]].sum())
    for rank, tok in enumerate(order.tolist()):
        if top_k > 0 and rank >= top_k:
            break
        if kept_mass >= top_p * total - 1e-12:
            break
        keep[tok] = True
        kept_mass += float(p[tok])
    q = torch.where(keep, p, torch.zeros_like(p))
    return q / q.sum()


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens.long(), minlength=VOCAB).double()
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts[~support]}"
    exp = probs[support] * n
    return float(((counts[support] - exp) ** 2 / exp).sum())


def chi_square_bound(df: int, z: float = 4.0) -> float:
    """Upper quantile of chi-square(df) at about p = 3e-5 (Wilson-Hilferty): a correct sampler passes at
    a fixed seed with a wide margin, a wrong distribution over DRAWS draws lands far above it."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_matches(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    df = int((probs > 0).sum()) - 1
    if df == 0:  # a single token survives the truncation: every draw is that token
        assert (tokens == int(probs.argmax())).all()
        return
    stat = chi_square(tokens, probs)
    assert stat < chi_square_bound(df), f"chi-square {stat:.1f} >= {chi_square_bound(df):.1f} (df {df})"


# ---- distributions on a fixed logit vector ---------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_frequencies_match_softmax(temperature):
    tokens = draw(SamplingParams(temperature=temperature))
    assert_matches(tokens, expected_probs(temperature))
    # power: the untempered softmax is rejected (T=1 is compared with a sharper distribution instead)
    wrong = expected_probs(1.0 if temperature != 1.0 else 0.7)
    assert chi_square(tokens, wrong) > 10 * chi_square_bound(VOCAB - 1)


@pytest.mark.parametrize("top_p", [0.2, 0.5, 0.7, 0.9])
def test_top_p_frequencies_match_truncated_softmax(top_p):
    tokens = draw(SamplingParams(temperature=1.0, top_p=top_p), seed=1)
    probs = expected_probs(1.0, top_p=top_p)
    assert_matches(tokens, probs)
    # power: the untruncated softmax is rejected
    assert chi_square(tokens, expected_probs(1.0)) > 10 * chi_square_bound(VOCAB - 1)


@pytest.mark.parametrize("top_k", [2, 5])
def test_top_k_frequencies_match_truncated_softmax(top_k):
    tokens = draw(SamplingParams(temperature=0.8, top_k=top_k), seed=2)
    probs = expected_probs(0.8, top_k=top_k)
    assert int((probs > 0).sum()) == top_k
    assert_matches(tokens, probs)
    assert chi_square(tokens, expected_probs(0.8)) > 10 * chi_square_bound(VOCAB - 1)


def test_temperature_then_top_k_then_top_p():
    """Temperature applies before truncation; top-p is taken over what top-k kept."""
    tokens = draw(SamplingParams(temperature=1.5, top_k=6, top_p=0.7), seed=3)
    assert_matches(tokens, expected_probs(1.5, top_k=6, top_p=0.7))


# ---- greedy and mixed batches -----------------------------------------------------------------------
def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB) * 3
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, top_p=0.5),
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.0, top_k=3, seed=7),
    ]
    out = Sampler(DEVICE).sample(logits, make_info(params))
    argmax = logits.argmax(dim=-1)
    for row in (0, 2, 3, 5):  # temperature 0 or top-k 1: greedy whatever else is set
        assert int(out[row]) == int(argmax[row])
    assert out.dtype == torch.int32 and out.shape == (6,)


def test_all_greedy_batch_is_argmax():
    logits = torch.randn(4, VOCAB)
    out = Sampler(DEVICE).sample(logits, make_info([SamplingParams()] * 4))
    assert out.tolist() == logits.argmax(dim=-1).tolist()


def test_per_row_params_in_one_batch_follow_their_own_distribution():
    """Rows with different temperatures in one batch each follow their own distribution."""
    torch.manual_seed(5)
    n = DRAWS // 2
    params = [SamplingParams(temperature=0.5)] * n + [SamplingParams(temperature=1.0, top_p=0.7)] * n
    logits = LOGITS[None, :].repeat(2 * n, 1)
    out = Sampler(DEVICE).sample(logits, make_info(params))
    assert_matches(out[:n], expected_probs(0.5))
    assert_matches(out[n:], expected_probs(1.0, top_p=0.7))


def test_same_seed_same_token_whatever_the_batch():
    """A seeded row draws the same token at the same position, alone or beside other rows."""
    torch.manual_seed(0)
    logits = torch.randn(1, VOCAB)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [int(Sampler(DEVICE).sample(logits, make_info([seeded], [pos]))[0]) for pos in range(50)]
    others = torch.randn(3, VOCAB)
    batch_logits = torch.cat([others[:2], logits, others[2:]])
    params = [SamplingParams(temperature=1.0), SamplingParams(), seeded, SamplingParams(temperature=0.5)]
    in_batch = [
        int(Sampler(DEVICE).sample(batch_logits, make_info(params, [pos, 9, pos, 4]))[2]) for pos in range(50)
    ]
    assert alone == in_batch
    assert len(set(alone)) > 1  # the seed does not freeze the draw: positions differ


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 9])
def test_every_sampling_row_starts_16_byte_aligned_at_any_batch_size(n):
    """Triton specialises a kernel on whether each pointer is 16-byte aligned: rows of a packed [3, n]
    tensor start at n * 4 or n * 8 bytes and would compile the sampling kernels again for some batch
    sizes, at run time. Each row starts aligned, and holds the batch's values."""
    params = [SamplingParams(temperature=0.5 + i / 10, top_p=0.9, top_k=2 + i % 3, seed=i) for i in range(n)]
    info = make_info(params, list(range(10, 10 + n)))
    rows = info.rows
    for name in ("temperature", "top_p", "min_p", "top_k", "seed", "counter"):
        row = getattr(rows, name)
        assert row.shape == (n,) and row.data_ptr() % 16 == 0, name
    assert rows.temperature.tolist() == pytest.approx([0.5 + i / 10 for i in range(n)])
    assert rows.top_k.tolist() == [2 + i % 3 for i in range(n)] and rows.seed.tolist() == list(range(n))
    assert rows.counter.tolist() == list(range(10, 10 + n))  # a seeded row's counter is its position
    floats, ints = info.packed
    assert floats.shape == (3, n) and ints.shape == (3, n)


# ---- through the LLM --------------------------------------------------------------------------------
ARCH = "qwen3"


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    with make_llm(tiny_model_dirs[ARCH], **tiny_llm_kwargs()) as llm:
        yield llm


def _prompts():
    vocab = TINY_SPECS[ARCH].config_kwargs["vocab_size"]
    return [random_prompt(n, vocab, seed=200 + n) for n in (7, 19, 26)]


def test_same_seed_same_text(llm):
    prompts = _prompts()
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True, seed=42)
    first = llm.generate(prompts, seeded)
    # the same seeds again, this time beside unseeded sampled requests that change the batch
    noisy = SamplingParams(temperature=1.3, max_tokens=30, ignore_eos=True)
    second = llm.generate(prompts + prompts, [seeded] * 3 + [noisy] * 3)[:3]
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second]
    other = llm.generate(
        prompts, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True, seed=43)
    )
    assert [o["token_ids"] for o in other] != [o["token_ids"] for o in first]
    assert_all_kv_free(llm)


def test_temperature_zero_and_top_k_one_equal_greedy(llm, hf_reference):
    prompts = _prompts()
    greedy = llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    for prompt, out in zip(prompts, greedy):
        assert_tokens_equal_hf(out["token_ids"], hf_reference(ARCH), prompt, what="greedy")
    zero_t = llm.generate(
        prompts, SamplingParams(temperature=0.0, top_p=0.3, top_k=5, seed=1, max_tokens=32, ignore_eos=True)
    )
    top_k1 = llm.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=32, ignore_eos=True))
    assert [o["token_ids"] for o in zero_t] == [o["token_ids"] for o in greedy]
    assert [o["token_ids"] for o in top_k1] == [o["token_ids"] for o in greedy]
    assert_all_kv_free(llm)


def test_sampled_requests_differ_from_greedy(llm):
    """Sampling at a high temperature actually samples (guards against a sampler stuck on argmax)."""
    prompts = _prompts()
    greedy = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    hot = llm.generate(prompts, SamplingParams(temperature=2.0, max_tokens=24, ignore_eos=True, seed=3))
    assert [o["token_ids"] for o in hot] != [o["token_ids"] for o in greedy]


# ---- logit_bias and penalties against a per-row reference -------------------------------------------
def reference_logits(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams):
    """One row by hand, in vLLM's order: the bias, then the repetition penalty over every token seen
    (positive logits divided, the others multiplied), then frequency and presence over the output."""
    x = logits.clone()
    for tok, bias in (p.logit_bias or {}).items():
        x[tok] += bias
    for tok in set(prompt) | set(output):
        x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok in set(output):
        x[tok] -= p.frequency_penalty * output.count(tok) + p.presence_penalty
    return x


POOL_ROWS, POOL_LEN = 6, 24


def penalised_batch(params: list[SamplingParams], seed: int = 0):
    """Rows with random prompts and outputs, each in its own token-pool row (not in batch order); the pool
    starts full of other tokens, as rows a previous request left behind. -> (reqs, positions, pool)"""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, VOCAB, (POOL_ROWS, POOL_LEN), generator=g, dtype=torch.int32)
    reqs = []
    for i, p in enumerate(params):
        prompt_len, out_len = (
            int(torch.randint(1, 8, (), generator=g)),
            int(torch.randint(0, 9, (), generator=g)),
        )
        ids = torch.randint(0, VOCAB, (prompt_len + out_len,), generator=g).tolist()
        reqs.append(
            Req(uid=i, token_ids=ids, sampling_params=p, prompt_len=prompt_len, table_idx=POOL_ROWS - 1 - i)
        )
    return reqs, [len(r.token_ids) for r in reqs], pool


def build_penalised(params: list[SamplingParams], seed: int = 0):
    """-> (reqs, info, sampler): the rows' tokens loaded into the pool as a prefill step does."""
    reqs, positions, pool = penalised_batch(params, seed)
    info = SamplingInfo.build(reqs, positions, VOCAB, DEVICE)
    sampler = Sampler(DEVICE, pool)
    sampler.load_history(info)
    return reqs, info, sampler


def expected(logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    return torch.stack(
        [
            reference_logits(row, r.token_ids[: r.prompt_len], r.token_ids[r.prompt_len :], r.sampling_params)
            for row, r in zip(logits, reqs)
        ]
    )


PENALTY_CASES = {
    "presence": SamplingParams(presence_penalty=1.5),
    "negative_presence": SamplingParams(presence_penalty=-0.7),
    "frequency": SamplingParams(frequency_penalty=0.6),
    "repetition": SamplingParams(repetition_penalty=1.8),
    "repetition_below_one": SamplingParams(repetition_penalty=0.5),
    "logit_bias": SamplingParams(logit_bias={0: -100.0, 3: 2.5, 9: 7.0}),
    "all": SamplingParams(
        presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3, logit_bias={9: 6.0, 5: -1.0}
    ),
}


@pytest.mark.parametrize("case", sorted(PENALTY_CASES))
def test_each_penalty_and_logit_bias_equal_the_reference(case):
    params = [PENALTY_CASES[case]] * 4
    reqs, info, sampler = build_penalised(params, seed=sorted(PENALTY_CASES).index(case))
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB) * 2
    got = info.penalties.apply(logits, sampler.token_pool)
    torch.testing.assert_close(got, expected(logits, reqs), atol=1e-5, rtol=1e-5)
    assert not torch.equal(got, logits)  # the case changes something
    # greedy rows take the argmax of the processed logits
    assert sampler.sample(logits, info).tolist() == expected(logits, reqs).argmax(-1).tolist()


def test_bias_applies_before_the_repetition_penalty():
    """A bias that makes a seen token's logit positive gets it divided, not multiplied."""
    p = SamplingParams(repetition_penalty=2.0, logit_bias={4: 3.0})
    req = Req(uid=0, token_ids=[4, 4, 1], sampling_params=p, prompt_len=2, table_idx=0)
    info = SamplingInfo.build([req], [3], VOCAB, DEVICE)
    sampler = Sampler(DEVICE, torch.zeros(1, 8, dtype=torch.int32))
    sampler.load_history(info)
    logits = torch.full((1, VOCAB), -1.0)
    got = info.penalties.apply(logits, sampler.token_pool)
    assert got[0, 4] == (-1.0 + 3.0) / 2.0 and got[0, 1] == -2.0 and got[0, 0] == -1.0


def test_presence_and_frequency_count_only_generated_tokens():
    p = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)
    req = Req(uid=0, token_ids=[2, 2, 2, 7, 7, 3], sampling_params=p, prompt_len=3, table_idx=0)
    info = SamplingInfo.build([req], [6], VOCAB, DEVICE)
    sampler = Sampler(DEVICE, torch.full((1, 10), 5, dtype=torch.int32))  # 5 lies beyond the known tokens
    sampler.load_history(info)
    got = info.penalties.apply(torch.zeros(1, VOCAB), sampler.token_pool)[0]
    want = torch.zeros(VOCAB)
    want[7], want[3] = -(1.0 + 0.5 * 2), -(1.0 + 0.5)  # the prompt's 2s and the stale 5s are not counted
    assert got.tolist() == want.tolist()


def test_mixed_batch_equals_the_reference_row_by_row():
    """Penalised and plain rows, greedy and sampled (seeded and not), in one batch: each row's processed
    logits equal its reference, plain rows are untouched, and every row draws what it would draw from its
    reference logits with no penalties at all (the same noise: global seed and per-request seeds)."""
    params = [
        SamplingParams(presence_penalty=1.2, repetition_penalty=1.4),  # greedy, penalised
        SamplingParams(),  # greedy, plain
        SamplingParams(temperature=0.9, frequency_penalty=0.8, seed=11),  # sampled, penalised, seeded
        SamplingParams(temperature=1.1, top_p=0.8),  # sampled, plain
        SamplingParams(temperature=0.7, top_k=4, logit_bias={2: 5.0}),  # sampled, biased
    ]
    reqs, info, sampler = build_penalised(params, seed=7)
    torch.manual_seed(2)
    logits = torch.randn(len(params), VOCAB) * 2
    want = expected(logits, reqs)
    got = info.penalties.apply(logits, sampler.token_pool)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1], logits[1]) and torch.equal(got[3], logits[3])
    plain = [SamplingParams(**{**vars(p), "presence_penalty": 0.0, "frequency_penalty": 0.0}) for p in params]
    plain = [SamplingParams(**{**vars(p), "repetition_penalty": 1.0, "logit_bias": None}) for p in plain]
    plain_info = make_info(plain, [len(r.token_ids) for r in reqs])
    assert plain_info.penalties is None
    for seed in range(5):
        torch.manual_seed(seed)
        out = sampler.sample(logits, info)
        torch.manual_seed(seed)
        assert out.tolist() == Sampler(DEVICE).sample(want, plain_info).tolist()


def test_sampling_leaves_the_raw_logits_untouched():
    """The logprobs report the model's distribution: they read the logits after sampling."""
    _, info, sampler = build_penalised([PENALTY_CASES["all"], SamplingParams(temperature=1.0)])
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    sampler.sample(logits, info)
    assert torch.equal(logits, before)


def test_a_batch_without_penalties_takes_the_plain_path():
    """No penalty set: no penalty tensors at all, an all-greedy batch stays all_greedy (the decode
    graph's argmax stands), and the sampler never reads the token pool (it has none here)."""
    greedy = make_info([SamplingParams(), SamplingParams(top_k=1, temperature=1.0)])
    assert greedy.all_greedy and greedy.penalties is None
    mixed = make_info([SamplingParams(), SamplingParams(temperature=1.0)])
    assert not mixed.all_greedy and mixed.penalties is None
    Sampler(DEVICE).sample(torch.randn(2, VOCAB), mixed)
    penalised_greedy = make_info([SamplingParams(), SamplingParams(presence_penalty=0.5)])
    assert not penalised_greedy.all_greedy and penalised_greedy.greedy_mask is None


def test_logit_bias_ids_outside_the_vocabulary_never_index_the_logits():
    info = make_info([SamplingParams(logit_bias={VOCAB: 50.0, 1: 1.0})])
    _, ids, values = info.penalties.bias
    assert ids.tolist() == [1] and values.tolist() == [1.0]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", 2.5),
        ("frequency_penalty", float("nan")),
        ("presence_penalty", -2.01),
        ("presence_penalty", "1"),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("logit_bias", {"5": 1.0}),  # JSON keys are strings: the API converts them
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {True: 1.0}),
        ("logit_bias", {5: 100.5}),
        ("logit_bias", {5: None}),
        ("logit_bias", [[5, 1.0]]),
    ],
)
def test_out_of_range_penalties_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()


def test_edge_values_are_accepted():
    SamplingParams(frequency_penalty=-2, presence_penalty=2.0, repetition_penalty=1e-3).validate()
    SamplingParams(logit_bias={0: -100, 7: 100.0}).validate()


def test_penalties_round_trip_through_the_message_serializer():
    from minisgl.message import TokenizeMsg
    from minisgl.message.serialize import dumps, loads

    params = SamplingParams(
        frequency_penalty=0.5,
        presence_penalty=-1.0,
        repetition_penalty=1.2,
        logit_bias={3: -100.0, 70000: 2.5},
    )
    back = loads(dumps(TokenizeMsg(uid=1, sampling_params=params, text="hi")))
    assert back.sampling_params == params
    assert list(back.sampling_params.logit_bias) == [3, 70000]  # integer keys stay integers


# ---- penalties through the LLM ----------------------------------------------------------------------
def test_greedy_request_with_a_large_logit_bias_generates_that_token(llm):
    prompts = _prompts()
    plain = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    forced = 123
    assert all(forced not in o["token_ids"] for o in plain)  # the bias, not the model, picks it
    biased = SamplingParams(max_tokens=12, ignore_eos=True, logit_bias={forced: 100.0})
    # biased requests beside plain ones: only the biased rows change
    outs = llm.generate(
        prompts + prompts, [biased] * 3 + [SamplingParams(max_tokens=12, ignore_eos=True)] * 3
    )
    assert all(o["token_ids"] == [forced] * 12 for o in outs[:3])
    assert [o["token_ids"] for o in outs[3:]] == [o["token_ids"] for o in plain]
    assert_all_kv_free(llm)


def _hand_checked_presence(out: dict, presence: float) -> None:
    """By hand from the raw top-20 log-probabilities of each step (a log-probability is the logit up to a
    per-step constant): the chosen token maximises logprob - presence * (already generated). Exact while
    the output is shorter than 20, since then a token not yet generated is among the top 20."""
    seen: set[int] = set()
    for token, top in zip(out["token_ids"], out["top_logprobs"]):
        scores = {tok: lp - (presence if tok in seen else 0.0) for tok, lp in top}
        assert token == max(scores, key=scores.get), f"step {len(seen)}: {token} is not the penalised argmax"
        seen.add(token)


def test_strong_presence_penalty_greedy_never_repeats_a_token(llm):
    prompts = _prompts()
    n = 16
    plain = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    assert any(len(set(o["token_ids"])) < n for o in plain)  # unpenalised, the tiny model repeats itself
    params = SamplingParams(
        max_tokens=n, ignore_eos=True, presence_penalty=2.0, logprobs=True, top_logprobs=20
    )
    for _ in range(2):  # the second time the prompts come from the prefix cache
        outs = llm.generate(prompts, params)
        for o in outs:
            assert len(set(o["token_ids"])) == n, f"a token repeats: {o['token_ids']}"
            _hand_checked_presence(o, 2.0)
    assert_all_kv_free(llm)


def test_frequency_and_repetition_penalties_change_greedy_output_reproducibly(llm):
    prompts = _prompts()
    plain = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    for params in (
        SamplingParams(max_tokens=16, ignore_eos=True, frequency_penalty=2.0),
        SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=3.0),
    ):
        first = llm.generate(prompts, params)
        assert [o["token_ids"] for o in first] != [o["token_ids"] for o in plain]
        # again, with prompts from the prefix cache and beside a plain sampled request
        noisy = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
        again = llm.generate(prompts + prompts[:1], [params] * 3 + [noisy])[:3]
        assert [o["token_ids"] for o in again] == [o["token_ids"] for o in first]
    assert_all_kv_free(llm)


def test_repetition_penalty_reaches_the_prompt_also_from_the_prefix_cache(llm):
    """Biases that dwarf the tiny model's logits make them known: token a (in the prompt) at ~100, b (not
    in it) at ~60. Divided by 3, a seen token falls below an unseen one: by hand the output is b (a was
    seen in the prompt), then a (~33 beats the now seen b at ~20), then a again."""
    a, b = 40, 41
    prompt = [5, a, 7, 8, 9]
    params = SamplingParams(
        max_tokens=4, ignore_eos=True, repetition_penalty=3.0, logit_bias={a: 100.0, b: 60.0}
    )
    for _ in range(2):  # the second time the prompt's KV comes from the prefix cache
        assert llm.generate([prompt], params)[0]["token_ids"] == [b, a, a, a]
    unseen = llm.generate([[5, 7, 8, 9]], params)[0]["token_ids"]
    assert unseen == [a, b, a, a]  # a not in the prompt: ~100 first, then ~33 < ~60, then both seen


def test_logit_bias_ids_beyond_the_vocabulary_are_rejected(llm):
    vocab = TINY_SPECS[ARCH].config_kwargs["vocab_size"]
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([[1, 2, 3]], SamplingParams(logit_bias={vocab: 1.0}))


def test_a_top_k_beyond_the_vocabulary_is_no_limit_even_beyond_64_bits():
    info = make_info([SamplingParams(temperature=1.0, top_k=2**70), SamplingParams(temperature=1.0, top_k=2)])
    assert info.top_k.tolist() == [VOCAB, 2]  # a hand count: the first row keeps every token
