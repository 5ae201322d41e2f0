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
