"""Prompt log-probabilities (`SamplingParams(prompt_logprobs=k)`): every prompt token's log-probability
given the tokens before it, and the top k there, equal Hugging Face's float32 log_softmax within 1e-4, on a
tiny model and on the default model; batched, chunked, with a cached prefix present, from a start position,
with `max_tokens=0`."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_all_kv_free, make_llm, random_prompt, tiny_llm_kwargs

from minisgl.core import InvalidRequest, SamplingParams

TOL = 1e-4
TOP = 5


def hf_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len, vocab] float32 log_softmax of the logits at each position (row p predicts token p + 1)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def assert_equal_hf(out: dict, prompt: list[int], ref: torch.Tensor, k: int, start: int = 0) -> None:
    first = max(start, 1)
    lps, tops = out["prompt_logprobs"], out.get("prompt_top_logprobs")
    assert len(lps) == len(prompt) and lps[:first] == [None] * first
    expected = ref[torch.arange(first - 1, len(prompt) - 1), torch.tensor(prompt[first:])]
    assert torch.allclose(torch.tensor(lps[first:]), expected, atol=TOL, rtol=0)
    ranks = out["prompt_logprob_ranks"]
    assert ranks[:first] == [None] * first
    for p in range(first, len(prompt)):  # the rank: 1 + the tokens more likely, but for float32 near-ties
        above = int((ref[p - 1] > expected[p - first] + TOL).sum())
        level = int((ref[p - 1] >= expected[p - first] - TOL).sum())
        assert above + 1 <= ranks[p] <= level, (p, ranks[p], above, level)
    if k == 0:
        assert tops is None
        return
    assert tops[:first] == [None] * first
    for p in range(first, len(prompt)):
        vals, ids = ref[p - 1].topk(k)
        got_ids = [t for t, _ in tops[p]]
        got_vals = torch.tensor([v for _, v in tops[p]])
        assert torch.allclose(got_vals, vals, atol=TOL, rtol=0)  # the ranks' values, most likely first
        # the same tokens, but for exact float32 near-ties of neighbours, which may swap
        close = (vals[:-1] - vals[1:]).abs() < TOL
        if got_ids != ids.tolist():
            assert close.any(), (p, got_ids, ids.tolist())


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs, hf_reference):
    return tiny_model_dirs["llama"], hf_reference("llama").model


def test_prompt_logprobs_equal_hf_batched_chunked_and_with_a_cached_prefix(tiny):
    path, model = tiny
    shared = random_prompt(40, 733, seed=1)
    prompts = [shared + random_prompt(9, 733, seed=2), random_prompt(57, 733, seed=3), shared[:13]]
    refs = [hf_logprobs(model, p) for p in prompts]
    # chunks of 16 tokens, pages of 4: every prompt is split, prefixes are cacheable
    with make_llm(path, **tiny_llm_kwargs(max_prefill_length=16, page_size=4)) as llm:
        llm.generate([shared], SamplingParams(max_tokens=1))  # the shared prefix is now cached
        outs = llm.generate(prompts, SamplingParams(max_tokens=3, prompt_logprobs=TOP))
        for out, prompt, ref in zip(outs, prompts, refs):
            assert_equal_hf(out, prompt, ref, TOP)
            assert len(out["token_ids"]) == 3
        # the positions asked for are computed, not taken from the cache: from position 30 on, the first
        # 28 positions (7 pages) may come from it
        before = llm.stats()["cached_prompt_tokens"]
        out = llm.generate(
            [prompts[0]], SamplingParams(max_tokens=0, prompt_logprobs=0, prompt_logprobs_start=30)
        )[0]
        assert llm.stats()["cached_prompt_tokens"] - before == 28
        assert_equal_hf(out, prompts[0], refs[0], 0, start=30)
        assert out["token_ids"] == [] and out["finish_reason"] == "length"
        assert_all_kv_free(llm)


def test_prompt_logprobs_on_the_default_model_equal_hf_for_text_and_ids(default_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    with make_llm(default_model_dir, **tiny_llm_kwargs(max_prefill_length=32)) as llm:
        text = "The capital of France is Paris, and the capital of Italy is Rome."
        ids = llm.tokenizer.encode("Question: what is two plus two?\nAnswer: four")
        outs = llm.generate([text, ids], SamplingParams(max_tokens=0, prompt_logprobs=2))
        assert_equal_hf(
            outs[0], llm.tokenizer.encode(text), hf_logprobs(model, llm.tokenizer.encode(text)), 2
        )
        assert_equal_hf(outs[1], ids, hf_logprobs(model, ids), 2)


def test_bad_prompt_logprobs_are_refused_naming_the_field(tiny):
    path, _ = tiny
    with make_llm(path, **tiny_llm_kwargs()) as llm:
        for params, field in [
            (SamplingParams(prompt_logprobs=21), "prompt_logprobs"),
            (SamplingParams(prompt_logprobs=1, prompt_logprobs_start=5), "prompt_logprobs_start"),
            (SamplingParams(max_tokens=0), "max_tokens"),  # 0 only with prompt log-probabilities
        ]:
            with pytest.raises(InvalidRequest) as e:
                llm.generate([[1, 2, 3]], params)
            assert e.value.param == field
