"""Draft-model speculation (--speculative draft): a small model proposes, the target verifies.

Greedy output equals Hugging Face's greedy continuation of the target token for token (a draft equal to the
target, whose every proposal is accepted, counted by hand; a draft that agrees about half the time; a
random draft of another architecture that is nearly always wrong), batched with requests that propose
nothing, chunked, prefix-cached, page sizes 1 and 16. Neither the target's pool nor the draft's keeps a
page it should not hold, counted by hand while running and after. A sampled run's tokens follow the
target's distribution (chi-square against Hugging Face), seeded (the draft draws with the target's noise)
and unseeded (drawn from the draft's q, checked by speculative sampling), whose proposals are kept as
often as sum min(p, q) says, more than the draft's argmax; seeded and penalised requests give their
plain-path tokens. A draft with another vocabulary is refused; one with the target's tokenizer and
padded embeddings runs."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    TinySpec,
    assert_all_kv_free,
    assert_tokens_equal_hf,
    build_tiny_model,
    make_llm,
    random_prompt,
    tiny_llm_kwargs,
)
from test_speculative import _chi_bound, _pooled_chi_square, always_propose

from minisgl.core import SamplingParams
from minisgl.scheduler import SchedulerConfig
from minisgl.scheduler import draft as draft_module
from minisgl.scheduler.prefill import pages_for
from minisgl.scheduler.speculative import SpecState
from minisgl.utils.options import OptionError, build

TARGET = "llama"  # vocabulary of 733 tokens
VOCAB = 733
# a random Qwen3 with the target's vocabulary: its proposals are nearly always rejected
OTHER = TinySpec(
    "qwen3_733",
    "Qwen3ForCausalLM",
    {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "tie_word_embeddings": True,
    },
    seed=9,
)


@pytest.fixture(scope="module")
def drafts(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    """Draft directories: `near` is the target with every weight moved by 5% of its spread (it agrees
    with the target's argmax about half the time), `other` a random model of another architecture."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("drafts")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[TARGET], dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.05)
    model.save_pretrained(str(root / "near"), safe_serialization=True)
    return {"near": str(root / "near"), "other": build_tiny_model(OTHER, str(root / "other"))}


def _draft_llm(target_dir: str, draft_dir: str, **kw):
    spec = {"speculative": "draft", "speculative_draft_model": draft_dir, "speculative_max_batch": 32}
    return make_llm(target_dir, **{**tiny_llm_kwargs(), **spec, **kw})


def assert_draft_pages_free(llm) -> None:
    proposer = llm.scheduler.proposer
    assert proposer.num_free_pages() == proposer.num_pages, (
        f"the draft's pool has {proposer.num_pages - proposer.num_free_pages()} pages still taken"
    )


def _proposals_by_hand(max_tokens: int, k: int) -> int:
    """Proposals of a lone greedy request whose every proposal is accepted: after the prefill's token,
    each verify step proposes min(k, room) and yields that many tokens plus one (room: the tokens the
    request may still produce beyond the step's own)."""
    out, proposed = 1, 0
    while out < max_tokens:
        n = min(k, max_tokens - out - 1)
        proposed += n
        out += n + 1
    return proposed


def test_a_draft_equal_to_the_target_has_every_proposal_accepted(tiny_model_dirs, hf_reference):
    ref = hf_reference(TARGET)
    target = tiny_model_dirs[TARGET]
    with _draft_llm(target, target, num_speculative_tokens=4) as llm:
        always_propose(llm)
        for i, n in enumerate([30, 17, 9, 2]):
            prompt = random_prompt(20 + i, VOCAB, 40 + i)
            before = llm.stats()
            out = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0]
            after = llm.stats()
            assert_tokens_equal_hf(out["token_ids"], ref, prompt, what=f"prompt {i}")
            proposed = after["spec_proposed_tokens"] - before["spec_proposed_tokens"]
            accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            assert proposed == accepted == _proposals_by_hand(n, 4), (n, proposed, accepted)
        assert_all_kv_free(llm)
        assert_draft_pages_free(llm)


def _prompts() -> list[list[int]]:
    """Prompts longer than the tests' prefill chunk (16), some of which repeat themselves."""
    out = []
    for seed in range(6):
        base = random_prompt(9 + seed, VOCAB, seed)
        out.append(base * 3 if seed % 2 else random_prompt(18 + 3 * seed, VOCAB, 100 + seed))
    return out


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_with_a_draft_equals_hf_batched_chunked_and_cached(
    tiny_model_dirs, hf_reference, drafts, page_size
):
    """Six prompts in one batch, chunked by 16 tokens (the draft extends over them in chunks too); two of
    them may produce only 1 and 2 tokens, so they share verify steps without proposing. A second run
    finds the prompts in the prefix cache (the draft recomputes them: it keeps no cache)."""
    ref = hf_reference(TARGET)
    prompts = _prompts()
    lengths = [40, 1, 40, 2, 40, 40]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    kw = tiny_llm_kwargs(page_size=page_size, max_prefill_length=16)
    with _draft_llm(tiny_model_dirs[TARGET], drafts["near"], num_speculative_tokens=5, **kw) as llm:
        always_propose(llm)
        for run in range(2):
            outs = llm.generate(prompts, params)
            for i, (prompt, out, n) in enumerate(zip(prompts, outs, lengths)):
                assert len(out["token_ids"]) == n
                assert_tokens_equal_hf(out["token_ids"], ref, prompt, what=f"run {run} prompt {i}")
            assert_all_kv_free(llm)
            assert_draft_pages_free(llm)
        stats = llm.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"], stats
    assert stats["cached_prompt_tokens"] > 0, stats


def _assert_pages_by_hand(llm) -> None:
    """While running: each request holds the draft pages of the positions its draft K/V covers (its last
    proposals' included); every other page of the draft's pool is free."""
    sched, proposer = llm.scheduler, llm.scheduler.proposer
    held = 0
    for req in sched.reqs.values():
        seq = req.spec.proposer.get("draft") if req.spec is not None else None
        if seq is None:
            continue
        assert len(seq.pages) == pages_for(seq.cached, sched.page_size)
        held += len(seq.pages)
    assert proposer.num_free_pages() + held == proposer.num_pages


@pytest.mark.parametrize("page_size", [1, 16])
def test_many_rejected_draft_proposals_leak_no_page(
    tiny_model_dirs, hf_reference, drafts, page_size, monkeypatch
):
    """A random draft of another architecture, 7 proposals every step, small pools: nearly every proposal
    is rejected, the pages are counted by hand after every step, and everything is free at the end."""
    monkeypatch.setattr(SpecState, "update", lambda self, proposed, accepted: None)  # never rests
    ref = hf_reference(TARGET)
    prompts = [random_prompt(20 + i, VOCAB, 300 + i) for i in range(8)]
    kw = tiny_llm_kwargs(page_size=page_size, num_page_override=2048 // page_size)
    with _draft_llm(tiny_model_dirs[TARGET], drafts["other"], num_speculative_tokens=7, **kw) as llm:
        always_propose(llm)
        sched = llm.scheduler
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        for i, p in enumerate(prompts):
            sched.add_request(i, p, params)
        outs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        while sched.has_work:
            for res in sched.step():
                outs[res.uid].append(res.token_id)
            _assert_pages_by_hand(llm)
        stats = llm.stats()
        assert_all_kv_free(llm)
        assert_draft_pages_free(llm)
        assert sched.flush_cache() is not None
        assert sched.num_free_pages() == sched.num_total_pages
    assert stats["spec_proposed_tokens"] >= 8 * 7 * 5
    assert stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"] / 10, stats
    for i, prompt in enumerate(prompts):
        assert_tokens_equal_hf(outs[i], ref, prompt, what=f"prompt {i}")


def test_a_draft_request_aborted_or_retracted_gives_its_draft_pages_back(tiny_model_dirs, drafts):
    """Abort one request mid-run and retract another: neither keeps a draft page."""
    with _draft_llm(tiny_model_dirs[TARGET], drafts["near"], num_speculative_tokens=4) as llm:
        always_propose(llm)
        sched = llm.scheduler
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        for i in range(3):
            sched.add_request(i, random_prompt(30, VOCAB, 500 + i), params)
        while not all(r.spec is not None and "draft" in r.spec.proposer for r in sched.reqs.values()):
            sched.step()
        sched._drain()
        assert llm.scheduler.proposer.num_free_pages() < llm.scheduler.proposer.num_pages
        sched.abort_request(0)
        sched.retraction.retract(sched.reqs[1])
        _assert_pages_by_hand(llm)
        assert "draft" not in sched.reqs[1].spec.proposer
        while sched.has_work:
            sched.step()
        assert_all_kv_free(llm)
        assert_draft_pages_free(llm)


def _hf_probs(model, seqs: list[list[int]], temperature: float) -> torch.Tensor:
    """A Hugging Face model's distribution of the token after each of `seqs` at `temperature`, float64."""
    logits = model(input_ids=torch.tensor(seqs)).logits[:, -1].double()
    return torch.softmax(logits / temperature, dim=-1)


@torch.no_grad()
@pytest.mark.parametrize("seeded", [True, False])  # the draft draws with the target's noise / from its q
def test_sampled_tokens_with_a_draft_follow_the_target(tiny_model_dirs, hf_reference, drafts, seeded):
    """Sampled requests (temperature 0.5) of 4 tokens each: the second token is the first one a verify
    step checks, the third one the second. The second follows the exact marginal
    sum_t1 p(t1) p(t2 | t1), the third among the draws whose first token is the most likely one
    sum_t2 p(t2 | a) p(t3 | a, t2), p from Hugging Face; the draft differs from the target, so proposals
    are accepted and rejected many times."""
    model = hf_reference(TARGET).model
    prompt = random_prompt(12, VOCAB, 7)
    temperature = 0.5

    def probs(seqs: list[list[int]]) -> torch.Tensor:
        return _hf_probs(model, seqs, temperature)

    p1 = probs([prompt])[0]
    p2 = probs([prompt + [t] for t in range(VOCAB)])  # [t1, t2]
    a = int(p1.argmax())
    p3 = probs([prompt + [a, t] for t in range(VOCAB)])  # [t2, t3]
    marg2, marg3 = p1 @ p2, p2[a] @ p3

    n = 3000
    kw = tiny_llm_kwargs(max_running_req=64)
    with _draft_llm(
        tiny_model_dirs[TARGET], drafts["near"], num_speculative_tokens=3, speculative_max_batch=64, **kw
    ) as llm:
        always_propose(llm)
        params = [
            SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True, seed=i if seeded else None)
            for i in range(n)
        ]
        outs = llm.generate([prompt] * n, params)
        stats = llm.stats()
        assert_all_kv_free(llm)
        assert_draft_pages_free(llm)
    toks = torch.tensor([o["token_ids"] for o in outs])
    accepted, proposed = stats["spec_accepted_tokens"], stats["spec_proposed_tokens"]
    assert accepted > 100 and proposed - accepted > 100, (
        accepted,
        proposed,
    )  # both branches of the scheme, many times
    stat, df = _pooled_chi_square(torch.bincount(toks[:, 1], minlength=VOCAB).double(), marg2)
    assert stat < _chi_bound(df), f"second token: chi-square {stat:.1f} (df {df})"
    c3 = torch.bincount(toks[toks[:, 0] == a, 2], minlength=VOCAB).double()
    stat, df = _pooled_chi_square(c3, marg3)
    assert stat < _chi_bound(df), f"third token: chi-square {stat:.1f} (df {df})"


@torch.no_grad()
@pytest.mark.parametrize("graphs", [False, True])
def test_a_drawn_proposal_is_kept_with_probability_sum_min_p_q_more_often_than_the_argmax(
    tiny_model_dirs, hf_reference, drafts, monkeypatch, graphs
):
    """Unseeded sampled requests of 3 tokens propose once, after their first token t1. A proposal drawn
    from the draft's q is kept with probability sum_t1 p(t1) sum_x min(p(x | t1), q(x | t1)); the draft's
    argmax (the proposal of seeded-less requests before drawn proposals were checked) with
    sum_t1 p(t1) p(argmax q | t1), which is lower here (p, q: the target and the draft in Hugging Face).
    With graphs (emulated), the verify steps replay the verify graphs and sample drawn proposals eagerly
    (the sampling graphs only without them)."""
    from transformers import AutoModelForCausalLM

    target = hf_reference(TARGET).model
    draft = AutoModelForCausalLM.from_pretrained(drafts["near"], dtype=torch.float32)
    prompt = random_prompt(12, VOCAB, 7)
    temperature = 0.8
    p1 = _hf_probs(target, [prompt], temperature)[0]
    after = [prompt + [t] for t in range(VOCAB)]
    p2, q2 = _hf_probs(target, after, temperature), _hf_probs(draft, after, temperature)
    expected = {
        "drawn": float(p1 @ torch.minimum(p2, q2).sum(-1)),
        "argmax": float(p1 @ p2.gather(1, q2.argmax(-1, keepdim=True))[:, 0]),
    }
    n = 1500
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True)
    # with graphs, 4 requests at a time: 8 rows, inside the graphs (the decode batch sizes up to 8)
    group = 4 if graphs else n
    if graphs:
        kw = tiny_llm_kwargs(cuda_graph_max_bs=8, sampler="fused", max_running_req=8, speculative_max_batch=4)
    else:
        kw = tiny_llm_kwargs(max_running_req=64, speculative_max_batch=64)
    measured = {}
    for mode in ("drawn", "argmax"):
        if mode == "argmax":
            monkeypatch.setattr(draft_module, "draws_from_q", lambda req: False)
        with _draft_llm(tiny_model_dirs[TARGET], drafts["near"], **kw) as llm:
            always_propose(llm)
            for _ in range(0, n, group):
                llm.generate([prompt] * group, [params] * group)
            stats = llm.stats()
            assert_all_kv_free(llm)
            assert_draft_pages_free(llm)
            verify = llm.scheduler.engine.verify_graphs
            if graphs:
                assert verify.replays > 0 and (verify.sample_replays == 0) == (mode == "drawn")
        proposed, accepted = stats["spec_proposed_tokens"], stats["spec_accepted_tokens"]
        assert proposed > n / 2, stats
        measured[mode] = accepted / proposed
        e = expected[mode]
        assert abs(measured[mode] - e) <= 4 * math.sqrt(e * (1 - e) / proposed), (mode, measured[mode], e)
    print(f"acceptance measured {measured}, expected {expected} (graphs {graphs})")
    assert expected["drawn"] > expected["argmax"] + 0.1


def test_seeded_and_penalised_requests_give_the_tokens_they_give_without_speculation(tiny_model_dirs, drafts):
    """A seeded sampled request's tokens are its draws without speculation (the draft draws with the same
    noise, so many proposals are kept); penalised and biased greedy requests are their plain-path tokens
    (the draft applies the penalties over its own copy of the history). Unseeded sampled requests, some
    penalised, share the verify steps with drawn proposals and leave the others' tokens as they are."""
    prompts = [random_prompt(15 + i, VOCAB, 700 + i) for i in range(8)]
    params = [
        SamplingParams(temperature=0.6, max_tokens=30, ignore_eos=True, seed=5 + i, top_k=50, top_p=0.95)
        for i in range(3)
    ] + [
        SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=30, ignore_eos=True, frequency_penalty=0.8, presence_penalty=0.3),
        SamplingParams(max_tokens=30, ignore_eos=True, logit_bias={5: 2.0, 9: -1.0}),
    ]
    unseeded = [
        SamplingParams(temperature=0.7, max_tokens=30, ignore_eos=True, top_k=40, repetition_penalty=1.2),
        SamplingParams(temperature=0.9, max_tokens=30, ignore_eos=True, top_p=0.9, logit_bias={5: 1.0}),
    ]
    with make_llm(tiny_model_dirs[TARGET], **tiny_llm_kwargs()) as llm:
        plain = [o["token_ids"] for o in llm.generate(prompts[:6], params)]
    with _draft_llm(tiny_model_dirs[TARGET], drafts["near"], num_speculative_tokens=4) as llm:
        always_propose(llm)
        spec = [o["token_ids"] for o in llm.generate(prompts, params + unseeded)]
        stats = llm.stats()
        assert_all_kv_free(llm)
        assert_draft_pages_free(llm)
    assert spec[:6] == plain
    assert all(len(out) == 30 and max(out) < VOCAB for out in spec[6:])
    assert stats["spec_accepted_tokens"] > stats["spec_proposed_tokens"] / 4, stats


def test_a_draft_with_another_vocabulary_is_refused(tiny_model_dirs):
    refused = pytest.raises(ValueError, match="vocabulary of 1000 tokens, the target 733")
    with refused, _draft_llm(tiny_model_dirs[TARGET], tiny_model_dirs["qwen3"]):
        pass


def test_draft_options_are_checked_naming_them():
    with pytest.raises(OptionError, match="speculative_draft_model"):
        build(SchedulerConfig, {"speculative": "draft"})
    with pytest.raises(OptionError, match="speculative_draft_model"):
        build(SchedulerConfig, {"speculative": "ngram", "speculative_draft_model": "/x"})
    with pytest.raises(OptionError, match="speculative"):
        build(SchedulerConfig, {"speculative": "draft", "speculative_draft_model": "/x", "tp_size": 2})


# ---- the GPU path -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_draft_speculation_equals_hf_with_graphs_on(tiny_model_dirs, hf_reference, drafts, page_size):
    """On CUDA (Triton attention, graphs on for both models, overlap on): the draft's decode steps replay
    its graphs, its extensions run eagerly; greedy output equals Hugging Face."""
    ref = hf_reference(TARGET)
    prompts = _prompts()
    kw = {"dtype": torch.float32, "attn": "triton", "page_size": page_size, "num_page_override": 4096}
    spec = {"num_speculative_tokens": 5, "speculative_max_batch": 32}
    with _draft_llm(tiny_model_dirs[TARGET], drafts["near"], device="cuda", **kw, **spec) as llm:
        always_propose(llm)
        outs = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            assert_tokens_equal_hf(out["token_ids"], ref, prompt, what=f"prompt {i}")
        stats = llm.stats()
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"], stats
        assert llm.scheduler.proposer.engine.graph_runner is not None
        assert_all_kv_free(llm)
        assert_draft_pages_free(llm)


@torch.no_grad()
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_drawn_proposals_follow_the_target_with_graphs_on(tiny_model_dirs, hf_reference, drafts):
    """On CUDA (Triton attention and sampling, graphs on for both models): unseeded sampled requests of 3
    tokens propose draws from the draft's q after their first token; a proposal is kept at the rate
    sum_t1 p(t1) sum_x min(p(x | t1), q(x | t1)) and the second token follows the target's marginal
    sum_t1 p(t1) p(t2 | t1) (p, q: the target and the draft in Hugging Face)."""
    from transformers import AutoModelForCausalLM

    target = hf_reference(TARGET).model
    draft = AutoModelForCausalLM.from_pretrained(drafts["near"], dtype=torch.float32)
    prompt = random_prompt(12, VOCAB, 7)
    temperature = 0.8
    p1 = _hf_probs(target, [prompt], temperature)[0]
    after = [prompt + [t] for t in range(VOCAB)]
    p2, q2 = _hf_probs(target, after, temperature), _hf_probs(draft, after, temperature)
    expected = float(p1 @ torch.minimum(p2, q2).sum(-1))
    n = 2000
    kw = {"dtype": torch.float32, "attn": "triton", "num_page_override": 4096, "max_running_req": 64}
    spec = {"num_speculative_tokens": 1, "speculative_max_batch": 64}
    with _draft_llm(tiny_model_dirs[TARGET], drafts["near"], device="cuda", **kw, **spec) as llm:
        always_propose(llm)
        params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True)
        outs = llm.generate([prompt] * n, [params] * n)
        stats = llm.stats()
        assert_all_kv_free(llm)
        assert_draft_pages_free(llm)
    proposed, accepted = stats["spec_proposed_tokens"], stats["spec_accepted_tokens"]
    assert proposed > n / 2, stats
    assert abs(accepted / proposed - expected) <= 4 * math.sqrt(expected * (1 - expected) / proposed), (
        accepted / proposed,
        expected,
    )
    toks = torch.tensor([o["token_ids"] for o in outs])
    stat, df = _pooled_chi_square(torch.bincount(toks[:, 1], minlength=VOCAB).double(), p1 @ p2)
    assert stat < _chi_bound(df), f"second token: chi-square {stat:.1f} (df {df})"


def _save_tokenizer(model_dir: str, words: int, prefix: str = "w") -> None:
    """A word-level tokenizer of `words` words and [UNK] (ids 0..words), saved beside a model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"{prefix}{i}": i for i in range(words)} | {"[UNK]": words}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(model_dir)


def test_drafts_with_the_target_tokenizer_and_padded_embeddings_run_exactly(
    tiny_model_dirs, hf_reference, tmp_path
):
    """Checkpoints of one family pad their embeddings differently: with the target's tokenizer (700 ids,
    inside both), a draft of 760 or 720 embedding rows runs. A proposal of an id the target lacks is cut
    off before it, and an id the draft lacks (the random target produces some) is fed to the draft as one
    of its own; the output stays the target's. Sampled requests without a seed (proposals drawn from the
    draft's q, cut or padded to the target's ids) get tokens of the target's vocabulary. A draft with
    another tokenizer of the same size is refused."""
    import shutil

    ref = hf_reference(TARGET)
    target = str(tmp_path / "target")
    shutil.copytree(tiny_model_dirs[TARGET], target)
    _save_tokenizer(target, 699)
    prompts = [random_prompt(20 + i, 699, 60 + i) for i in range(3)]
    for rows in (760, 720):
        spec = TinySpec(
            f"pad{rows}", "Qwen3ForCausalLM", {**OTHER.config_kwargs, "vocab_size": rows}, seed=rows
        )
        draft = build_tiny_model(spec, str(tmp_path / f"draft{rows}"))
        _save_tokenizer(draft, 699)
        with _draft_llm(target, draft, num_speculative_tokens=6) as llm:
            always_propose(llm)
            outs = llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
            assert llm.stats()["spec_proposed_tokens"] > 0
            sampled = llm.generate(prompts, SamplingParams(temperature=1.5, max_tokens=30, ignore_eos=True))
            assert all(0 <= t < VOCAB for o in sampled for t in o["token_ids"])
            assert llm.stats()["spec_accepted_tokens"] > 0
            assert_all_kv_free(llm)
            assert_draft_pages_free(llm)
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            assert_tokens_equal_hf(out["token_ids"], ref, prompt, what=f"draft of {rows} rows, prompt {i}")
    _save_tokenizer(draft, 699, prefix="v")
    with pytest.raises(ValueError, match="does not share the target's tokenizer"), _draft_llm(target, draft):
        pass
