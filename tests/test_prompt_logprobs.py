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


# ---- through the service: OpenAI's echo, vLLM's prompt_logprobs, SGLang's input_token_logprobs ------------
TEXTS = ["The capital of France is Paris. The capital of Italy is", "Question: what is 2 + 2?\nAnswer: 4"]


@pytest.fixture(scope="module")
def hf_default(thinking_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(thinking_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(thinking_model)


@pytest.fixture(scope="module")
def http(shared_service):
    import httpx

    with httpx.Client(base_url=shared_service.url, timeout=300) as c:
        yield c


def completion(http, **body) -> dict:
    r = http.post("/v1/completions", json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_gives_every_prompt_token_its_hf_logprob_batched_with_a_cached_prefix(http, hf_default):
    model, tok = hf_default
    ids = [tok.encode(t) for t in TEXTS]
    completion(http, prompt=ids[0][:20], max_tokens=1)  # a prefix of the first prompt is cached now
    # what lm-evaluation-harness sends for loglikelihood: token ids, echo, logprobs 1, max_tokens 1
    body = completion(http, prompt=ids, echo=True, logprobs=1, max_tokens=1)
    for choice, prompt in zip(sorted(body["choices"], key=lambda c: c["index"]), ids):
        ref = hf_logprobs(model, prompt)
        lps = choice["logprobs"]
        n = len(prompt)
        assert len(lps["tokens"]) == n + 1 and lps["tokens"][:n] == [tok.decode([t]) for t in prompt]
        assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None  # as OpenAI's
        expected = ref[torch.arange(n - 1), torch.tensor(prompt[1:])]
        assert torch.allclose(torch.tensor(lps["token_logprobs"][1:n]), expected, atol=TOL, rtol=0)
        tops = [max(d.values()) for d in lps["top_logprobs"][1:n]]  # lm-eval's is_greedy reads these
        assert torch.allclose(torch.tensor(tops), ref[: n - 1].max(-1).values, atol=TOL, rtol=0)
        assert choice["text"].startswith(tok.decode(prompt)) and lps["text_offset"][0] == 0


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_top_logprobs(shared_service, hf_default):
    import openai

    model, tok = hf_default
    client = openai.OpenAI(base_url=f"{shared_service.url}/v1", api_key="none", max_retries=0)
    r = client.completions.create(model="m", prompt=TEXTS[1], echo=True, logprobs=2, max_tokens=0)
    c = r.choices[0]
    prompt = tok.encode(TEXTS[1])
    ref = hf_logprobs(model, prompt)
    assert c.text == TEXTS[1] and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == len(prompt)
    for p in range(1, len(prompt)):
        vals, top_ids = ref[p - 1].topk(2)
        got = c.logprobs.top_logprobs[p]
        assert list(got) == [tok.decode([t]) for t in top_ids.tolist()] or (vals[0] - vals[1]).abs() < TOL
        assert torch.allclose(torch.tensor(sorted(got.values(), reverse=True)), vals, atol=TOL, rtol=0)
    streamed = client.completions.create(model="m", prompt=TEXTS[1], echo=True, max_tokens=2, stream=True)
    assert next(iter(streamed)).choices[0].text.startswith(TEXTS[1])  # the prompt comes first


def test_vllm_prompt_logprobs_hold_the_prompt_token_with_its_rank_and_the_top_k(http, hf_default):
    model, tok = hf_default
    prompt = tok.encode(TEXTS[0])
    ref = hf_logprobs(model, prompt)
    entries = completion(http, prompt=TEXTS[0], prompt_logprobs=3, max_tokens=1)["choices"][0][
        "prompt_logprobs"
    ]
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        mine = entries[p][str(prompt[p])]
        lp = ref[p - 1, prompt[p]]
        assert abs(mine["logprob"] - float(lp)) < TOL and mine["decoded_token"] == tok.decode([prompt[p]])
        assert int((ref[p - 1] > lp + TOL).sum()) + 1 <= mine["rank"] <= int((ref[p - 1] >= lp - TOL).sum())
        ranked = sorted((e for t, e in entries[p].items() if e["rank"] <= 3), key=lambda e: e["rank"])
        assert torch.allclose(
            torch.tensor([e["logprob"] for e in ranked[:3]]), ref[p - 1].topk(3).values, atol=TOL
        )


def test_sglang_input_token_logprobs_from_a_start_position(http, hf_default):
    model, tok = hf_default
    prompt = tok.encode(TEXTS[0])
    ref = hf_logprobs(model, prompt)
    body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 3, "top_logprobs_num": 1}
    body["sampling_params"] = {"max_new_tokens": 2, "temperature": 0}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    tokens = meta["input_token_logprobs"]
    assert [t[1] for t in tokens] == prompt[3:] and all(t[2] is None for t in tokens)  # no text unless asked
    expected = ref[torch.arange(2, len(prompt) - 1), torch.tensor(prompt[3:])]
    assert torch.allclose(torch.tensor([t[0] for t in tokens]), expected, atol=TOL, rtol=0)
    assert len(meta["output_token_logprobs"]) == 2 and len(meta["input_top_logprobs"]) == len(prompt) - 3


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "a b", "echo": True, "logprobs": 6}, "logprobs"),
        ({"prompt": "a b", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "a b", "max_tokens": 0}, "max_tokens"),  # nothing to return
    ],
)
def test_bad_prompt_logprob_requests_are_400_naming_the_field(http, body, param):
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
