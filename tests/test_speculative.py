"""Speculative decoding (--speculative ngram): the output equals the target model's without speculation.

Greedy: token for token Hugging Face's greedy continuation, on tiny random models (batched, chunked,
prefix-cached, page sizes 1 and 16) and the default model. Sampled: the rejection scheme's tokens follow
the target's processed distribution, for guessed and for drawn proposals (speculative_sample: kept as
often as sum min(p, q)) on a fixed logit vector, and end to end at the first and a later speculated
position (chi-square against probabilities computed with Hugging Face). No KV page or cache
node is left behind after many rejected proposals."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import (
    HFReference,
    assert_all_kv_free,
    assert_tokens_equal_hf,
    make_llm,
    metrics,
    random_prompt,
    serving,
    tiny_llm_kwargs,
    wait_idle,
)
from test_sampler import DRAWS, LOGITS, assert_matches, expected_probs, make_info

from minisgl.core import Req, SamplingParams
from minisgl.engine.sampler import Sampler
from minisgl.scheduler import SchedulerConfig
from minisgl.scheduler.speculative import IDLE_REST, NgramProposer, SpecState, StepCosts
from minisgl.utils.options import OptionError, build

DEVICE = torch.device("cpu")


def always_propose(llm) -> None:
    """Every request proposes its k (from its acceptance), whatever the step timings say: the tests that
    need verify steps to happen do not depend on how busy the machine is."""
    llm.scheduler.step_costs.best_k = lambda hits, n, max_k: max_k


# ---- the n-gram proposer ---------------------------------------------------------------------------
def _propose(tokens: list[int], k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    req = Req(uid=0, token_ids=tokens, sampling_params=SamplingParams())
    req.spec = SpecState()
    return NgramProposer(min_n, max_n).propose([req], [k])[0]


def test_ngram_proposes_what_followed_the_latest_longest_match():
    # "7 8" occurred twice before the end; the latest (followed by 4 5) wins over the first (followed by 1)
    assert _propose([7, 8, 1, 2, 7, 8, 4, 5, 6, 7, 8], 3) == [4, 5, 6]
    # the 3-gram "3 7 8" is preferred over the more recent 2-gram "7 8"
    assert _propose([3, 7, 8, 9, 9, 7, 8, 4, 3, 7, 8], 2) == [9, 9]


def test_ngram_continues_a_loop_past_the_known_tokens():
    assert _propose([1, 2, 3, 1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]


def test_ngram_proposes_nothing_without_a_match_or_below_min_n():
    assert _propose([1, 2, 3, 4, 5], 4) == []
    assert _propose([5, 6, 1, 2, 6], 3, min_n=2) == []  # only a 1-gram (6) matches


def test_the_index_grows_with_the_tokens():
    req = Req(uid=0, token_ids=[1, 2, 3, 4], sampling_params=SamplingParams())
    req.spec = SpecState()
    proposer = NgramProposer(1, 2)
    assert proposer.propose([req], [3]) == [[]]
    req.token_ids += [9, 1, 2]
    assert proposer.propose([req], [3]) == [[3, 4, 9]]


def test_k_is_the_one_of_the_most_expected_tokens_per_second():
    costs = StepCosts()
    assert costs.best_k([0.9], 1, 8) is None  # no decode step timed yet: decode first
    for rows, ms in [(1, 6), (2, 6.6), (3, 8), (4, 12), (5, 13), (6, 14), (7, 24), (8, 25), (9, 26)]:
        costs.add(rows, ms / 1000)
    # one request, by hand: expected tokens 1 + h + ... + h^k over the step's milliseconds
    assert costs.best_k([0.7], 1, 8) == 2  # 2.19 / 8 beats 1.7 / 6.6, 2.53 / 12, 2.94 / 14, ...
    assert costs.best_k([0.97], 1, 8) == 5  # 5.71 / 14 beats 3.91 / 12, 2.91 / 8 and 7.99 / 26
    # 10 and 11 rows not timed: on the line through 8 and 9 rows (27 and 28 ms), not assumed cheap
    assert costs.best_k([0.97], 1, 10) == 5
    assert costs.best_k([0.0], 1, 8) == 0  # nothing is ever accepted: a decode step
    # two requests (a decode step: 2 rows, 6.6 ms), one of which may propose: 2 + h + ... over 2 + k rows
    assert costs.best_k([0.8], 2, 6) == 1  # 2.8 / 8 beats 2 / 6.6, 3.44 / 12, 4.36 / 14
    assert costs.best_k([0.3], 2, 6) == 0  # 2.3 / 8 does not beat 2 / 6.6
    costs.add(3, 0.0)  # timings are exponential averages: one fast 3-row step moves it to 6.4 ms
    assert costs.best_k([0.3], 2, 6) == 1


def test_untimed_row_counts_cost_what_the_timed_ones_around_them_say():
    costs = StepCosts()
    assert costs.cost(3) is None
    costs.add(1, 0.010)
    assert costs.cost(3) == pytest.approx(0.015)  # one count timed: a quarter of it per extra row
    costs.add(5, 0.018)
    assert costs.cost(3) == pytest.approx(0.014)  # between 1 and 5 rows
    assert costs.cost(9) == pytest.approx(0.026)  # on the line through 1 and 5 rows
    costs.add(7, 0.015)
    assert costs.cost(6) == pytest.approx(0.0165)
    assert costs.cost(9) == pytest.approx(0.015)  # the line through 5 and 7 falls: flat instead
    # a decode step of 0.84 ms and a verify step of 2 rows of 12.5 ms (no graphs for it): 3 and more rows
    # are not tried as if they were cheap
    slow = StepCosts()
    slow.add(1, 0.00084)
    slow.add(2, 0.0125)
    assert slow.best_k([0.9], 1, 8) == 0


def test_a_request_that_is_paused_rests_then_tries_again():
    state = SpecState(hit=0.0)
    state.pause()
    rested = 0
    while not state.ready():
        rested += 1
    assert rested > 0 and state.hit > 0


def test_options_refuse_bad_values_naming_them():
    with pytest.raises(OptionError, match="speculative"):
        build(SchedulerConfig, {"speculative": "medusa"})
    with pytest.raises(OptionError, match="speculative_ngram_min"):
        build(
            SchedulerConfig, {"speculative": "ngram", "speculative_ngram_min": 5, "speculative_ngram_max": 2}
        )
    for k in (0, 17):
        with pytest.raises(OptionError, match="num_speculative_tokens"):
            build(SchedulerConfig, {"speculative": "ngram", "num_speculative_tokens": k})


# ---- the rejection scheme on a fixed logit vector -------------------------------------------------
def draws(params: SamplingParams, n: int = DRAWS, seed: int = 0) -> torch.Tensor:
    """n independent draws of the sampler from the same logits (unseeded rows)."""
    torch.manual_seed(seed)
    return Sampler(DEVICE).sample(LOGITS[None, :].repeat(n, 1), make_info([params] * n))


@pytest.mark.parametrize("draft", [0, 3, 9])  # likely, middling, outside top-k / top-p
@pytest.mark.parametrize(
    "kw", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5}, {"temperature": 1.3, "top_p": 0.8}]
)
def test_keeping_a_proposal_when_the_draw_equals_it_is_the_rejection_scheme(kw, draft):
    """A verify row keeps proposal d exactly when its draw is d: kept with probability p(d), and a
    rejected row's token is distributed as p without d, renormalised (by hand: expected_probs)."""
    tokens = draws(SamplingParams(**kw))
    probs = expected_probs(kw["temperature"], kw.get("top_k", -1), kw.get("top_p", 1.0))
    kept = tokens == draft
    p = float(probs[draft])
    assert abs(float(kept.double().mean()) - p) <= 4 * math.sqrt(p * (1 - p) / DRAWS)
    residual = probs.clone()
    residual[draft] = 0.0
    assert_matches(tokens[~kept], residual / residual.sum())


# a near draft swaps two pairs of neighbouring tokens of the target's logits, a far one reverses them: the
# processing (temperature, top-k, top-p) commutes with the permutation, so q by hand is p permuted
NEAR, FAR = [1, 0, 2, 3, 5, 4, 6, 7, 8, 9], list(range(9, -1, -1))


@pytest.mark.parametrize("perm", [NEAR, FAR], ids=["near", "far"])
@pytest.mark.parametrize(
    "kw", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5}, {"temperature": 1.3, "top_p": 0.8}]
)
def test_proposals_drawn_from_the_draft_are_checked_by_speculative_sampling(kw, perm):
    """Rows whose proposal d was drawn from the draft's q (as the draft processes its logits) keep d with
    probability sum min(p, q), a rejected row's token follows max(p - q, 0) renormalised, and every
    row's token follows p (p, q by hand: expected_probs)."""
    params = SamplingParams(**kw)
    p = expected_probs(kw["temperature"], kw.get("top_k", -1), kw.get("top_p", 1.0))
    q_hand = p[perm]
    info = make_info([params] * DRAWS)
    q = Sampler(DEVICE).probs(LOGITS[perm][None, :].repeat(DRAWS, 1), info)
    assert torch.allclose(q, q_hand.float().expand_as(q), atol=1e-6)
    proposals = torch.multinomial(q, 1, generator=torch.Generator().manual_seed(1))[:, 0]
    at = torch.arange(DRAWS)
    torch.manual_seed(2)
    tokens = Sampler(DEVICE).sample(LOGITS[None, :].repeat(DRAWS, 1), info, (at, proposals, q))
    kept = tokens == proposals
    rate = float(torch.minimum(p, q_hand).sum())
    assert abs(float(kept.double().mean()) - rate) <= 4 * math.sqrt(max(rate * (1 - rate), 1e-9) / DRAWS)
    if rate < 1 - 1e-9:
        residual = (p - q_hand).clamp_min(0)
        assert_matches(tokens[~kept], residual / residual.sum())
    assert_matches(tokens, p)


# ---- greedy end to end: equal to Hugging Face --------------------------------------------------------
def _prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat themselves (proposals accepted) and random ones (mostly rejected)."""
    out = []
    for seed in range(6):
        base = random_prompt(7 + seed, vocab, seed)
        out.append(base * 3 + base[:2] if seed % 2 == 0 else random_prompt(20 + 3 * seed, vocab, 100 + seed))
    return out


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_speculation_equals_hf_batched_chunked_and_cached(tiny_model_dirs, hf_reference, page_size):
    name = "llama"
    ref = hf_reference(name)
    prompts = _prompts(733)
    kw = tiny_llm_kwargs(page_size=page_size, max_prefill_length=16)
    spec = {"speculative": "ngram", "num_speculative_tokens": 5, "speculative_max_batch": 32}
    with make_llm(tiny_model_dirs[name], **kw, **spec) as llm:
        always_propose(llm)
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        for run in range(2):  # the second run finds the prompts (and outputs) in the prefix cache
            outs = llm.generate(prompts, params)
            for i, (prompt, out) in enumerate(zip(prompts, outs)):
                assert len(out["token_ids"]) == 40
                assert_tokens_equal_hf(out["token_ids"], ref, prompt, what=f"run {run} prompt {i}")
            assert_all_kv_free(llm)
        stats = llm.stats()
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"], stats
        assert stats["prompt_tokens"] > stats["computed_prompt_tokens"] or stats["cached_prompt_tokens"] > 0


def test_verify_steps_replay_graphs_and_equal_hf_and_the_plain_path(tiny_model_dirs, hf_reference):
    """With graphs (emulated on a CPU: a replay reads only the graphs' fixed buffers) verify steps replay
    the verify graphs, batched and padded to a captured row count: greedy output equals Hugging Face, and
    seeded sampled requests (sampled in the verify graphs' sampling graphs) give the tokens they give
    without speculation and without graphs."""
    name = "llama"
    ref = hf_reference(name)
    prompts = _prompts(733)[:4]
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    seeded = [
        SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=21 + i, top_k=40)
        for i in range(len(prompts))
    ]
    spec = {"speculative": "ngram", "num_speculative_tokens": 3, "speculative_max_batch": 4}
    with make_llm(
        tiny_model_dirs[name], **tiny_llm_kwargs(cuda_graph_max_bs=16, sampler="fused"), **spec
    ) as llm:
        always_propose(llm)
        outs = llm.generate(prompts, greedy)
        sampled = [o["token_ids"] for o in llm.generate(prompts, seeded)]
        verify = llm.scheduler.engine.verify_graphs
        assert verify.sizes == [1, 2, 4, 8, 16]  # 4 requests x (3 + 1) rows at most
        assert verify.replays > 0 and verify.sample_replays > 0
        assert llm.stats()["spec_accepted_tokens"] > 0
        assert_all_kv_free(llm)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert_tokens_equal_hf(out["token_ids"], ref, prompt, what=f"prompt {i}")
    with make_llm(tiny_model_dirs[name], **tiny_llm_kwargs(sampler="fused")) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts, seeded)] == sampled


@pytest.mark.parametrize("attn", ["torch", "cpu"])  # cpu: the one-call C decode step verifies
def test_greedy_speculation_equals_hf_one_request_at_a_time_with_stops(tiny_model_dirs, hf_reference, attn):
    """max_tokens and a stop token end a request inside a run of accepted proposals."""
    name = "qwen3"
    ref = hf_reference(name)
    with make_llm(tiny_model_dirs[name], **tiny_llm_kwargs(attn=attn), speculative="ngram") as llm:
        always_propose(llm)
        if attn == "cpu":
            assert llm.scheduler.engine.cpu_step is not None
        for i, prompt in enumerate(_prompts(ref.model.config.vocab_size)):
            expected = ref.greedy(prompt, 30)
            n = 7 + 3 * i
            out = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0]
            assert_tokens_equal_hf(out["token_ids"], ref, prompt, what=f"prompt {i}")
            assert len(out["token_ids"]) == n
            stop = expected[12]
            out = llm.generate(
                [prompt], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop])
            )
            assert out[0]["token_ids"] == expected[: expected.index(stop) + 1]
        assert_all_kv_free(llm)


def test_with_overlap_requests_that_do_not_propose_keep_their_steps_overlapped(tiny_model_dirs, hf_reference):
    """Overlap scheduling with speculation on: a step drains the step in flight only when a request may
    propose. Requests that found nothing to propose rest IDLE_REST steps, during which decode steps
    overlap; the tokens still equal Hugging Face's, and the repeating prompts still get verify steps."""
    name = "qwen3"
    ref = hf_reference(name)
    prompts = _prompts(ref.model.config.vocab_size)
    spec = {"speculative": "ngram", "speculative_ngram_min": 3, "overlap": True}
    with make_llm(tiny_model_dirs[name], **tiny_llm_kwargs(), **spec) as llm:
        always_propose(llm)
        sched = llm.scheduler
        counts = {"drains": 0, "steps": 0}
        drain, step = sched._drain, sched.step

        def counting_drain():
            drained = drain()
            counts["drains"] += drained
            return drained

        def counting_step():
            counts["steps"] += 1
            return step()

        sched._drain, sched.step = counting_drain, counting_step
        for i, prompt in enumerate(prompts):
            verify_before = sched.verifier.spec_steps
            steps_before, drains_before = counts["steps"], counts["drains"]
            out = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]
            assert_tokens_equal_hf(out["token_ids"], ref, prompt, what=f"prompt {i}")
            verifies = sched.verifier.spec_steps - verify_before
            steps, drains = counts["steps"] - steps_before, counts["drains"] - drains_before
            # a drain before each verify step, and one in IDLE_REST + 1 steps of those that proposed nothing
            assert drains <= verifies + (steps - verifies) / (IDLE_REST + 1) + 2, (i, drains, verifies, steps)
        assert sched.verifier.spec_steps > 0
        assert_all_kv_free(llm)


@pytest.mark.parametrize("page_size", [1, 16])
def test_many_rejected_proposals_leak_no_page_or_cache_node(
    tiny_model_dirs, hf_reference, page_size, monkeypatch
):
    """A proposer that is always wrong, k rows every step, a small pool: every proposal's KV slot and page
    is given back (the output is still the target's), and once the cache is flushed every page is free."""
    from minisgl.benchmark.spec_verify import FixedProposer

    monkeypatch.setattr(SpecState, "update", lambda self, proposed, accepted: None)  # never rests
    name = "llama"
    ref = hf_reference(name)
    prompts = [random_prompt(20 + i, 733, 300 + i) for i in range(8)]
    kw = tiny_llm_kwargs(page_size=page_size, num_page_override=2048 // page_size)
    spec = {"speculative": "ngram", "num_speculative_tokens": 7, "speculative_max_batch": 32}
    with make_llm(tiny_model_dirs[name], **kw, **spec) as llm:
        wrong = FixedProposer()
        wrong.k = 7
        llm.scheduler.proposer = wrong
        always_propose(llm)
        outs = llm.generate(prompts, SamplingParams(max_tokens=50, ignore_eos=True))
        stats = llm.stats()
        assert_all_kv_free(llm)
        assert llm.scheduler.flush_cache() is not None
        assert llm.scheduler.num_free_pages() == llm.scheduler.num_total_pages
        assert llm.scheduler.cache.cache.cached_pages == 0
    assert (
        stats["spec_proposed_tokens"] >= 8 * 7 * 20
        and stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"] / 10
    )
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert_tokens_equal_hf(out["token_ids"], ref, prompt, what=f"prompt {i}")


def test_default_model_repeats_text_with_speculation_as_hf(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    text = (
        "Repeat exactly: def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n\n"
        "def sub(a, b):\n    return a - b\n"
    )
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    with make_llm(
        None, dtype=torch.float32, show_progress=False, weights_format="float32", speculative="ngram"
    ) as llm:
        always_propose(llm)
        out = llm.generate([ids], SamplingParams(max_tokens=40, ignore_eos=True))[0]
        stats = llm.stats()
        assert_all_kv_free(llm)
    assert stats["spec_accepted_tokens"] >= 10, stats
    assert_tokens_equal_hf(out["token_ids"], HFReference(default_model_dir), ids, what="default model")


def test_penalties_and_seeded_sampling_with_speculation_equal_the_plain_path(tiny_model_dirs):
    """Penalised greedy rows read the proposals before them as their history (the token pool), so they
    equal the plain decode path; a seeded sampled request gives the very tokens it gives without
    speculation (its rows draw with the plain path's noise keys)."""
    name = "llama"
    prompts = _prompts(733)
    params = [
        SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=30, ignore_eos=True, frequency_penalty=0.8, presence_penalty=0.3),
        SamplingParams(max_tokens=30, ignore_eos=True, logit_bias={5: 2.0, 9: -1.0}),
    ] * 2
    seeded_params = [
        SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=11 + i, top_p=0.9)
        for i in range(len(prompts))
    ]
    outs, seeded = {}, {}
    for spec in (None, "ngram"):
        with make_llm(
            tiny_model_dirs[name], **tiny_llm_kwargs(), speculative=spec, speculative_max_batch=32
        ) as llm:
            always_propose(llm)
            outs[spec] = [o["token_ids"] for o in llm.generate(prompts, params)]
            seeded[spec] = [o["token_ids"] for o in llm.generate(prompts, seeded_params)]
            if spec:
                assert llm.stats()["spec_accepted_tokens"] > 0
            assert_all_kv_free(llm)
    assert outs["ngram"] == outs[None]
    assert seeded["ngram"] == seeded[None]


# ---- sampled end to end: the target's distribution ---------------------------------------------------
def _pooled_chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Chi-square with the bins expected below 5 pooled into one; (statistic, degrees of freedom)."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    c = torch.cat([counts[big], counts[~big].sum()[None]])
    e = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = e > 0
    return float(((c[keep] - e[keep]) ** 2 / e[keep]).sum()), int(keep.sum()) - 1


def _chi_bound(df: int, z: float = 4.0) -> float:
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@torch.no_grad()
def test_sampled_tokens_follow_the_target_at_the_first_and_later_positions(tiny_model_dirs, hf_reference):
    """A prompt that repeats itself, with two of its tokens boosted by logit_bias (the tiny model alone is
    nearly uniform), so that many requests propose the token that followed and some of them keep it. With
    4 tokens each, the second and third tokens are proposals checked in one verify step. The second token
    follows the exact marginal sum_t1 p(t1) p(t2 | t1), and the third, among the draws whose first token
    is the most likely one, sum_t2 p(t2 | a) p(t3 | a, t2). Hugging Face gives every p."""
    name = "llama"
    model = hf_reference(name).model
    vocab = model.config.vocab_size
    base = random_prompt(6, vocab, 7)
    prompt = base * 2 + base[:2]
    bias = {base[2]: 6.5, base[3]: 6.5}
    temperature = 0.9

    def probs(seqs: list[list[int]]) -> torch.Tensor:
        logits = model(input_ids=torch.tensor(seqs)).logits[:, -1].double()
        for t, b in bias.items():
            logits[:, t] += b
        return torch.softmax(logits / temperature, dim=-1)

    p1 = probs([prompt])[0]
    p2 = probs([prompt + [t] for t in range(vocab)])  # [t1, t2]
    marg2 = p1 @ p2
    a = int(p1.argmax())
    p3 = probs([prompt + [a, t] for t in range(vocab)])  # [t2, t3]
    marg3 = p2[a] @ p3

    n = 3000
    kw = tiny_llm_kwargs(max_running_req=64)
    spec = {"speculative": "ngram", "num_speculative_tokens": 3, "speculative_max_batch": 64}
    with make_llm(tiny_model_dirs[name], **kw, **spec) as llm:
        always_propose(llm)
        params = [
            SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True, seed=i, logit_bias=bias)
            for i in range(n)
        ]
        outs = llm.generate([prompt] * n, params)
        stats = llm.stats()
        assert_all_kv_free(llm)
    toks = torch.tensor([o["token_ids"] for o in outs])
    accepted, proposed = stats["spec_accepted_tokens"], stats["spec_proposed_tokens"]
    assert accepted > 50 and proposed - accepted > 50, stats  # both branches of the scheme, many times
    c2 = torch.bincount(toks[:, 1], minlength=vocab).double()
    stat, df = _pooled_chi_square(c2, marg2)
    assert stat < _chi_bound(df), f"second token: chi-square {stat:.1f} (df {df})"
    c3 = torch.bincount(toks[toks[:, 0] == a, 2], minlength=vocab).double()
    stat, df = _pooled_chi_square(c3, marg3)
    assert stat < _chi_bound(df), f"third token: chi-square {stat:.1f} (df {df})"


# ---- the service ------------------------------------------------------------------------------------
REPEAT_TEXT = (
    "Repeat this list exactly: apples, pears, plums, cherries, grapes, lemons, limes, melons, peaches, "
    "apricots, figs, dates, kiwis, mangoes, papayas."
)


def test_service_speculates_and_reports_acceptance_in_metrics(tmp_path, default_model_dir):
    """`--speculative ngram` in the service: streamed and plain greedy replies equal the offline greedy
    ones without speculation (concurrent requests share verify steps), /metrics counts the proposals, and
    the idle-time integrity check (strict in tests) finds every page back."""
    import httpx

    messages = [[{"role": "user", "content": REPEAT_TEXT}], [{"role": "user", "content": "Count to twenty."}]]
    with make_llm(None, dtype=torch.float32, show_progress=False, weights_format="float32") as llm:
        tok = llm.tokenizer
        prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
        ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
        expected = [o["text"] for o in llm.generate(ids, SamplingParams(max_tokens=48))]
    args = ["--dtype", "float32", "--weights-format", "float32", "--num-pages", "4096"]
    args += ["--speculative", "ngram", "--num-speculative-tokens", "3", "--served-model-name", "m"]
    with serving(args, tmp_path / "server.log") as service:
        body = {"model": "m", "max_tokens": 48, "temperature": 0}
        with httpx.Client(base_url=service.url, timeout=120) as client:
            with ThreadPoolExecutor(2) as pool:
                replies = list(
                    pool.map(
                        lambda m: client.post("/v1/chat/completions", json={**body, "messages": m}).json(),
                        messages,
                    )
                )
            texts = [r["choices"][0]["message"]["content"] for r in replies]
            streamed = ""
            with client.stream(
                "POST", "/v1/chat/completions", json={**body, "messages": messages[0], "stream": True}
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        delta = json.loads(line[6:])["choices"][0]["delta"]
                        streamed += delta.get("content") or ""
        assert texts == expected
        assert streamed == expected[0]
        m = wait_idle(service.url, after_checks=0)
        assert m["minisgl_spec_proposed_tokens"] > 0 and m["minisgl_spec_accepted_tokens"] > 0, m
        assert 0 < m["minisgl_spec_acceptance_rate"] <= 1
        assert m.get("minisgl_integrity_failures", 0) == 0
        assert metrics(service.url)["minisgl_kv_used_pages"] == m["minisgl_kv_cached_pages"]


# ---- the GPU path -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_verify_steps_equal_hf_with_graphs_on(tiny_model_dirs, hf_reference, page_size):
    """On CUDA (Triton attention, decode, verify and prefill graphs on, overlap on): verify steps replay
    the verify graphs (store-then-attend plan) between decode graph replays; greedy output equals Hugging
    Face."""
    name = "llama"
    ref = hf_reference(name)
    prompts = _prompts(733)
    kw = {"dtype": torch.float32, "attn": "triton", "page_size": page_size, "num_page_override": 4096}
    spec = {"speculative": "ngram", "num_speculative_tokens": 5, "speculative_max_batch": 32}
    with make_llm(tiny_model_dirs[name], device="cuda", show_progress=False, **kw, **spec) as llm:
        always_propose(llm)
        outs = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            assert_tokens_equal_hf(out["token_ids"], ref, prompt, what=f"prompt {i}")
        assert llm.stats()["spec_accepted_tokens"] > 0
        assert llm.scheduler.engine.graph_runner is not None
        assert llm.scheduler.engine.verify_graphs.replays > 0
        assert_all_kv_free(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_sampling_in_cuda_verify_graphs_equals_the_plain_path(tiny_model_dirs):
    """On CUDA, seeded sampled requests sampled in the verify graphs' sampling graphs give the tokens they
    give without speculation."""
    prompts = _prompts(733)
    params = [
        SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=31 + i, top_p=0.9)
        for i in range(len(prompts))
    ]
    kw = {"dtype": torch.float32, "attn": "triton", "num_page_override": 4096, "show_progress": False}
    outs = {}
    for spec in (None, "ngram"):
        with make_llm(tiny_model_dirs["llama"], device="cuda", speculative=spec, **kw) as llm:
            always_propose(llm)
            outs[spec] = [o["token_ids"] for o in llm.generate(prompts, params)]
            if spec:
                assert llm.scheduler.engine.verify_graphs.sample_replays > 0
    assert outs["ngram"] == outs[None]
