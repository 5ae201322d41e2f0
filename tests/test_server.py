"""The OpenAI-compatible service, end to end: a real `python -m minisgl` subprocess on a free port (the
default model, float32), driven by the official openai client and httpx.

One server is shared by the whole module; the last test kills a worker to check that the service goes down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import torch
from helpers import Service, metrics, serving, wait_idle

from minisgl.core import InvalidRequest, SamplingParams
from minisgl.models.resolve import resolve_model_path
from minisgl.utils.hf import load_tokenizer

openai = pytest.importorskip("openai")

CONTEXT = 512
SERVER_ARGS = ["--dtype", "float32", "--num-pages", "8192", "--max-seq-len-override", str(CONTEXT)]
SERVER_ARGS += ["--served-model-name", "SmolLM2-135M-Instruct,m"]  # the tests' requests name model "m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CONCURRENT_PROMPTS = [f"Write one sentence about the number {i}." for i in range(16)]


def aborting(service: Service) -> int:
    """How many requests the API server aborted because their client went away (from its log)."""
    return len(re.findall(r"Aborting request \d+", service.log_text()))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(SERVER_ARGS, tmp_path_factory.mktemp("server") / "server.log") as service:
        yield service


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def reference(tokenizer):
    """Greedy outputs of the offline LLM (an independent path: no processes, no ZMQ) for the prompts used here."""
    chat = [
        tokenizer.encode(
            tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
    ]
    chat += [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for p in CONCURRENT_PROMPTS
    ]
    with offline_llm() as llm:
        outs = llm.generate(chat, SamplingParams(temperature=0.0, max_tokens=24))
    return {"question": outs[0], "concurrent": outs[1:], "question_ids": chat[0]}


@contextlib.contextmanager
def offline_llm():
    """The offline LLM with the service's model and context length."""
    from minisgl.llm import LLM

    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the service is loading on the other core
    llm = None
    try:
        llm = LLM(
            model_path=None,
            dtype=torch.float32,
            num_page_override=4096,
            max_seq_len_override=CONTEXT,
            show_progress=False,
        )
        yield llm
    finally:
        if llm is not None:
            llm.shutdown()
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def sse_events(lines) -> list:
    """The JSON payloads of an SSE stream, and a final "[DONE]"."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ---- the API ------------------------------------------------------------------------------------------
def test_models_health_and_metrics_endpoints_answer(server):
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert models["data"][0]["max_model_len"] == CONTEXT
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "minisgl_time_to_first_token_seconds_bucket",
        "minisgl_inter_token_latency_seconds_bucket",
        "minisgl_prompt_tokens_total",
        "minisgl_generation_tokens_total",
        "minisgl_requests_total",
        "minisgl_num_requests_running",
        "minisgl_num_requests_waiting",
        "minisgl_kv_usage_ratio",
        "minisgl_prefix_cache_hit_rate",
    ):
        assert name in text, name


def test_greedy_chat_equals_offline_llm_generate(client, reference, tokenizer):
    r = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=24, temperature=0)
    ref = reference["question"]
    assert r.choices[0].message.content == ref["text"]
    assert "Paris" in ref["text"]
    assert r.choices[0].finish_reason == ref["finish_reason"]
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion" and r.id
    # usage, counted independently: the chat template's tokens and the offline path's generated tokens
    assert r.usage.prompt_tokens == len(chat_ids(tokenizer, QUESTION)) == len(reference["question_ids"])
    assert r.usage.completion_tokens == len(ref["token_ids"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_native_generate_with_token_ids_returns_the_offline_tokens(server, reference):
    r = httpx.post(
        f"{server.url}/generate",
        timeout=120,
        json={
            "input_ids": reference["question_ids"],
            "sampling_params": {"max_new_tokens": 24, "temperature": 0},
        },
    ).json()
    assert r["output_ids"] == reference["question"]["token_ids"]
    assert r["text"] == reference["question"]["text"]
    assert r["meta_info"]["prompt_tokens"] == len(reference["question_ids"])


def test_native_generate_without_max_new_tokens_stops_at_128_or_at_the_context(server):
    """As SGLang's /generate: no max_new_tokens means at most 128 new tokens; a prompt too long for 128
    more runs up to the context (512 here) instead of being refused."""

    def new_tokens(ids: list[int]) -> int:
        body = {"input_ids": ids, "sampling_params": {"temperature": 0, "ignore_eos": True}}
        r = httpx.post(f"{server.url}/generate", timeout=300, json=body)
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["completion_tokens"] == len(r.json()["output_ids"])
        return meta["completion_tokens"]

    assert new_tokens(list(range(100, 120))) == 128
    assert new_tokens(list(range(100, 100 + CONTEXT - 40))) == 40


def test_completion_without_max_tokens_stops_at_16_or_at_the_context(server):
    """As OpenAI's completions (and vLLM's, SGLang's): no max_tokens means at most 16 tokens; a prompt
    too long for 16 more runs up to the context instead of being refused."""

    def new_tokens(ids: list[int]) -> int:
        body = {"model": "m", "prompt": ids, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", timeout=300, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        return r.json()["usage"]["completion_tokens"]

    assert new_tokens(list(range(100, 120))) == 16
    assert new_tokens(list(range(100, 100 + CONTEXT - 5))) == 5


def test_streamed_chat_deltas_concatenate_to_the_non_streamed_text(server, client):
    kwargs = {
        "model": "m",
        "messages": [{"role": "user", "content": "Name three colors."}],
        "max_tokens": 20,
        "temperature": 0,
    }
    full = client.chat.completions.create(**kwargs)
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        timeout=120,
        json=dict(kwargs, stream=True, stream_options={"include_usage": True}),
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][:-1] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == full.choices[0].finish_reason
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == full.choices[0].message.content
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": full.usage.prompt_tokens,
        "completion_tokens": full.usage.completion_tokens,
        "total_tokens": full.usage.total_tokens,
        # the same prompt again: all of it but the token a match leaves to compute is in the prefix cache
        "prompt_tokens_details": {"cached_tokens": full.usage.prompt_tokens - 1},
    }
    assert len([c for c in chunks if c["choices"][0]["delta"].get("content")]) > 3  # really streamed


def test_streamed_completion_with_the_openai_client_matches_non_streamed(client):
    kwargs = {"model": "m", "prompt": "The three primary colors are", "max_tokens": 16, "temperature": 0}
    full = client.completions.create(**kwargs)
    parts = [c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(parts) == full.choices[0].text and len(parts) > 3
    assert full.object == "text_completion"


def test_sixteen_concurrent_requests_are_correct_and_batched_together(server, client, reference):
    def ask(prompt: str) -> str:
        r = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0
        )
        return r.choices[0].message.content

    with ThreadPoolExecutor(16) as ex:
        texts = list(ex.map(ask, CONCURRENT_PROMPTS))
    assert texts == [o["text"] for o in reference["concurrent"]]
    m = metrics(server.url)
    assert m["minisgl_max_batch_size"] > 1, "the scheduler never ran two requests in one step"


def test_client_disconnect_aborts_the_request_and_returns_its_kv(server):
    before, aborts_before = metrics(server.url), aborting(server)
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        timeout=120,
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
        },
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break  # hang up after a few chunks
    after = wait_idle(server.url, before["minisgl_integrity_checks"])
    assert after["minisgl_aborted_requests"] >= before["minisgl_aborted_requests"] + 1
    assert aborting(server) == aborts_before + 1
    assert after["minisgl_integrity_failures"] == 0
    assert after["minisgl_kv_used_pages"] == after["minisgl_kv_cached_pages"], "pages held outside the cache"
    assert (
        httpx.post(
            f"{server.url}/v1/completions", timeout=60, json={"prompt": "1 + 1 =", "max_tokens": 2}
        ).status_code
        == 200
    )


def test_non_streaming_client_that_gives_up_is_aborted_too(server):
    before, aborts_before = metrics(server.url), aborting(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/completions",
            timeout=2,
            json={"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True},
        )
    after = wait_idle(server.url, before["minisgl_integrity_checks"])
    assert after["minisgl_aborted_requests"] >= before["minisgl_aborted_requests"] + 1
    assert aborting(server) == aborts_before + 1
    assert after["minisgl_kv_used_pages"] == after["minisgl_kv_cached_pages"]


GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
BAD_CHAT = [
    ("not json {", None, "invalid_json"),
    ("[1, 2]", None, "invalid_json"),
    ({"model": "m"}, "messages", None),
    ({"messages": []}, "messages", None),
    ({"messages": "hello"}, "messages", None),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", None),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", None),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "missing_required_parameter"),
    (
        {"messages": [{"role": "assistant", "content": None}]},
        "messages[0].content",
        "missing_required_parameter",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "5"}]},
        "messages[1].tool_call_id",
        "missing_required_parameter",
    ),
    (dict(GOOD, max_tokens=0), "max_tokens", None),
    (dict(GOOD, max_tokens="8"), "max_tokens", None),
    (dict(GOOD, max_completion_tokens=-1), "max_completion_tokens", None),
    (dict(GOOD, temperature=-0.5), "temperature", None),
    (dict(GOOD, temperature="hot"), "temperature", None),
    (dict(GOOD, top_p=0), "top_p", None),
    (dict(GOOD, top_p=1.5), "top_p", None),
    (dict(GOOD, n=0), "n", None),
    (dict(GOOD, n=1.5), "n", None),
    (dict(GOOD, stream="yes"), "stream", None),
    (dict(GOOD, stop=7), "stop", None),
    (dict(GOOD, max_tokens=CONTEXT), "max_tokens", None),  # prompt + max_tokens beyond the context
    (dict(GOOD, max_tokens=CONTEXT, stream=True), "max_tokens", None),
    ({"messages": [{"role": "user", "content": "x" * (9 << 20)}]}, None, "request_too_large"),
]
BAD_COMPLETION = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": {"text": "hi"}}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "hi " * (CONTEXT + 10), "max_tokens": 1}, "prompt"),  # the prompt alone is beyond the context
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
]


def _assert_openai_error(r: httpx.Response, param, code) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param, err
    if code:
        assert err["code"] == code


@pytest.mark.parametrize("body,param,code", BAD_CHAT, ids=[f"chat{i}" for i in range(len(BAD_CHAT))])
def test_bad_chat_input_gets_400_naming_the_field_and_the_service_keeps_serving(server, body, param, code):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=content,
        timeout=120,
        headers={"Content-Type": "application/json"},
    )
    _assert_openai_error(r, param, code)
    assert httpx.post(f"{server.url}/v1/chat/completions", json=GOOD, timeout=120).status_code == 200


@pytest.mark.parametrize(
    "body,param", BAD_COMPLETION, ids=[f"completion{i}" for i in range(len(BAD_COMPLETION))]
)
def test_bad_completion_input_gets_400_naming_the_field(server, body, param):
    _assert_openai_error(httpx.post(f"{server.url}/v1/completions", json=body, timeout=120), param, None)
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=120)
    assert ok.status_code == 200


# ---- the offline path and the service give the same answer ---------------------------------------------
SAME_ANSWER = [  # (SamplingParams fields, also sent as the HTTP body's fields; prompt length)
    ({"max_tokens": CONTEXT}, 10),  # prompt + max_tokens beyond the context
    ({"max_tokens": 0}, 10),
    ({"temperature": -0.5}, 10),
    ({"top_p": 1.5}, 10),
    ({"top_k": -2}, 10),
    ({"seed": 1, "stop_token_ids": [-1]}, 10),
    ({"max_tokens": 4}, CONTEXT + 5),  # the prompt alone is beyond the context
    ({"max_tokens": 4}, 0),  # a token id outside the vocabulary
]


@pytest.fixture(scope="class")
def offline():
    """The offline LLM, for one class of tests (it is freed when the class is done)."""
    with offline_llm() as llm:
        yield llm


class TestTheOfflinePathAndTheServiceAgree:
    """One set of rules: the same bad request gets the same message and field from LLM.generate and HTTP."""

    @staticmethod
    def offline_error(llm, ids, fields) -> InvalidRequest:
        with pytest.raises(InvalidRequest) as err:
            llm.generate([ids], SamplingParams(**fields))
        return err.value

    @staticmethod
    def prompt_ids(llm, length):
        return [5] * length if length else [5, llm.scheduler.vocab_size]

    @pytest.mark.parametrize("fields,length", SAME_ANSWER, ids=[f"same{i}" for i in range(len(SAME_ANSWER))])
    def test_completions_give_the_offline_message_and_field(self, server, offline, fields, length):
        ids = self.prompt_ids(offline, length)
        expected = self.offline_error(offline, ids, fields)
        body = {"prompt": ids, **fields}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        names = {"stop_token_ids": "stop"}  # the HTTP body's `stop` carries stop token ids as well
        param = names.get(expected.param, expected.param)
        _assert_openai_error(r, param, "invalid_value")
        assert r.json()["error"]["message"] == InvalidRequest.renamed(expected.message, expected.param, param)

    @pytest.mark.parametrize(
        "path,body,param",
        [
            ("/generate", {"sampling_params": {"max_new_tokens": CONTEXT}}, "max_new_tokens"),
            ("/v1/chat/completions", {"max_completion_tokens": CONTEXT}, "max_completion_tokens"),
        ],
    )
    def test_each_endpoint_names_max_tokens_its_own_way(self, server, offline, tokenizer, path, body, param):
        ids = chat_ids(tokenizer, QUESTION)
        expected = self.offline_error(offline, ids, {"max_tokens": CONTEXT})
        prompt = {"input_ids": ids} if path == "/generate" else {"messages": QUESTION}
        r = httpx.post(f"{server.url}{path}", json={**prompt, **body}, timeout=120)
        _assert_openai_error(r, param, "invalid_value")
        assert r.json()["error"]["message"] == InvalidRequest.renamed(expected.message, "max_tokens", param)
        assert f"'{param}' is {CONTEXT}" in r.json()["error"]["message"]

    @pytest.mark.parametrize("path,param", [("/generate", "input_ids"), ("/v1/chat/completions", "messages")])
    def test_each_endpoint_names_the_prompt_its_own_way(self, server, offline, path, param):
        ids = [5] * (CONTEXT + 5)
        expected = self.offline_error(offline, ids, {"max_tokens": 1})
        if path == "/generate":
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
        else:  # a chat whose template makes more than CONTEXT tokens
            body = {"messages": [{"role": "user", "content": "hi " * (CONTEXT + 5)}], "max_tokens": 1}
        r = httpx.post(f"{server.url}{path}", json=body, timeout=120)
        _assert_openai_error(r, param, "invalid_value")
        if path == "/generate":
            assert r.json()["error"]["message"] == expected.message


def test_each_of_n_choices_keeps_every_sampling_field_but_its_seed():
    """for_choice copies SamplingParams whole: a new field is never lost for n > 1."""
    import dataclasses

    from minisgl.service.openai.params import Sampling

    params = SamplingParams(0.5, 7, 0.9, 33, True, 100, [4, 5], True, 3)
    for i, choice in enumerate(Sampling(params, [], 3).for_choice(i) for i in range(3)):
        assert choice.seed == 100 + i
        assert dataclasses.replace(choice, seed=100) == params
        assert choice.stop_token_ids is not params.stop_token_ids


def test_openai_client_sees_a_bad_request_error(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=QUESTION, max_tokens=5, top_p=2.0)
    assert e.value.status_code == 400 and "top_p" in str(e.value)


def test_usage_counts_equal_the_tokenizers_counts(server, tokenizer):
    prompts = ["The quick brown fox", "Un deux trois, 一二三"]
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=120,
        json={"prompt": prompts, "max_tokens": 7, "ignore_eos": True, "temperature": 0},
    ).json()
    assert r["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(p)) for p in prompts)
    assert r["usage"]["completion_tokens"] == 2 * 7
    assert [c["index"] for c in r["choices"]] == [0, 1]
    # generated tokens, counted from the token ids themselves
    g = httpx.post(
        f"{server.url}/generate",
        timeout=120,
        json={"text": prompts[0], "sampling_params": {"max_new_tokens": 9, "temperature": 0}},
    ).json()
    assert g["meta_info"]["completion_tokens"] == len(g["output_ids"])
    assert g["meta_info"]["prompt_tokens"] == len(tokenizer.encode(prompts[0]))


def test_utf8_heavy_prompt_streams_without_replacement_characters(server):
    # emoji and CJK characters span several byte-level tokens: the stream must never show half of one
    body = {
        "model": "m",
        "prompt": "北京欢迎你！東京、서울 Ça coûte 5 €. 🎉🚀🎉🚀🎉🚀🎉🚀",
        "max_tokens": 21,
        "temperature": 0,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=dict(body, stream=True), timeout=120) as r:
        events = sse_events(r.iter_lines())
    deltas = [e["choices"][0]["text"] for e in events[:-1] if e["choices"]]
    text = "".join(deltas)
    assert all("\ufffd" not in d for d in deltas), deltas
    assert sum(ord(ch) > 0xFFFF for ch in text) >= 3, f"expected emoji in the output: {text!r}"
    full = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    assert full["choices"][0]["text"] == text
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        timeout=120,
        json={"messages": [{"role": "user", "content": body["prompt"]}], "max_tokens": 8, "temperature": 0},
    ).json()
    assert "\ufffd" not in chat["choices"][0]["message"]["content"]


def test_n3_with_a_seed_gives_three_reproducible_choices(client):
    kwargs = {
        "model": "m",
        "messages": [{"role": "user", "content": "Invent a name for a cat."}],
        "max_tokens": 12,
        "temperature": 1.0,
        "n": 3,
        "seed": 1234,
    }
    first = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    second = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    assert len(first) == 3 and first == second
    assert len(set(first)) > 1, "three samples with temperature 1 should not all be equal"
    other = [c.message.content for c in client.chat.completions.create(**dict(kwargs, seed=99)).choices]
    assert other != first


def test_stop_strings_cut_the_text_and_never_leak_even_when_streamed(server, client):
    kwargs = {
        "model": "m",
        "prompt": "The capital of France is",
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    free = client.completions.create(**kwargs).choices[0].text
    stop = free[len(free) // 3 : len(free) // 3 + 4]  # some characters in the middle, across tokens
    assert len(stop.strip()) > 0
    expected = free[: free.index(stop)]
    r = client.completions.create(**kwargs, stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = [
        c.choices[0].text for c in client.completions.create(**kwargs, stop=stop, stream=True) if c.choices
    ]
    assert "".join(streamed) == expected
    # the scheduler was told to stop: the request is not still generating
    assert wait_idle(server.url, 0)["minisgl_num_requests_running"] == 0


def test_stop_token_ids_end_the_choice(server, tokenizer):
    free = httpx.post(
        f"{server.url}/generate",
        timeout=120,
        json={
            "text": "The capital of France is",
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        },
    ).json()
    stop_id = free["output_ids"][4]
    r = httpx.post(
        f"{server.url}/generate",
        timeout=120,
        json={
            "text": "The capital of France is",
            "sampling_params": {
                "max_new_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
                "stop_token_ids": [stop_id],
            },
        },
    ).json()
    first = free["output_ids"].index(stop_id)
    assert r["output_ids"] == free["output_ids"][: first + 1]
    assert r["meta_info"]["finish_reason"]["type"] == "stop"
    assert r["text"] == tokenizer.decode(free["output_ids"][:first], skip_special_tokens=True)


def test_logprobs_are_returned_in_openai_shapes(client):
    r = client.chat.completions.create(
        model="m", messages=QUESTION, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token  # greedy picks the most likely token
    c = client.completions.create(model="m", prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == c.choices[0].text


def test_chat_without_max_tokens_runs_up_to_the_context(server, tokenizer):
    """A chat completion without max_tokens (OpenAI's default: no limit) stops where the context ends."""
    long_prompt = "word " * (CONTEXT - 60)
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        timeout=300,
        json={"messages": [{"role": "user", "content": long_prompt}], "temperature": 0, "ignore_eos": True},
    ).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["prompt_tokens"] > len(tokenizer.encode(long_prompt))  # the template's tokens too
    assert r["usage"]["completion_tokens"] == CONTEXT - r["usage"]["prompt_tokens"]


# ---- the online benchmark client ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [["--concurrency", "3"], ["--request-rate", "20", "--no-usage"]])
def test_online_benchmark_client_reports_latencies_and_throughput(server, tmp_path, mode):
    out = tmp_path / "report.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "minisgl.benchmark.online",
            "--base-url",
            f"{server.url}/v1",
            "--num-requests",
            "6",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--warmup",
            "0",
            "--output-json",
            str(out),
            *mode,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["completed"] == 6 and rep["failed"] == 0
    assert rep["model"] == "SmolLM2-135M-Instruct"  # asked from /v1/models
    if "--no-usage" in mode:
        assert rep["tokens_counted_by"] == "content chunks" and 0 < rep["output_tokens"] <= 36
    else:
        assert rep["tokens_counted_by"] == "usage" and rep["output_tokens"] == 36
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(rep[key]) == {"mean", "p50", "p90", "p99"}
        assert 0 < rep[key]["p50"] <= rep[key]["p90"] <= rep[key]["p99"]
    assert rep["e2e_ms"]["p50"] >= rep["ttft_ms"]["p50"]
    assert rep["output_throughput_tok_s"] > 0
    assert "TTFT" in r.stdout and "output throughput" in r.stdout


# ---- load -----------------------------------------------------------------------------------------------
def test_load_256_streams_with_random_disconnects(server):
    """256 concurrent streaming requests; a random 32 of them hang up after a random number of chunks. The
    others all get their greedy text, every page is accounted for afterwards and the service still
    answers."""
    prompts = [f"Count from {i} to {i + 5}:" for i in range(10)]
    ref = {}
    for p in prompts:  # sequential references, one request at a time
        ref[p] = httpx.post(
            f"{server.url}/generate",
            timeout=120,
            json={"text": p, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}},
        ).json()
    before, aborts_before = metrics(server.url), aborting(server)

    rng = random.Random(7)
    quitters = dict.fromkeys(rng.sample(range(256), 32))
    for i in quitters:
        quitters[i] = rng.randint(1, 4)  # chunks read before hanging up

    async def one(i: int, http: httpx.AsyncClient):
        quitter = i in quitters
        prompt = prompts[i % len(prompts)]
        body = {
            "text": prompt,
            "stream": True,
            "sampling_params": {
                "max_new_tokens": 200 if quitter else 8,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        ids, text = [], ""
        async with http.stream("POST", f"{server.url}/generate", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                ids += event["output_ids"]
                text += event["text"]
                if quitter and len(ids) >= quitters[i]:
                    return None  # hang up mid-stream
        return prompt, ids, text

    async def run_all():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            return await asyncio.gather(*(one(i, http) for i in range(256)))

    t0 = time.monotonic()
    results = asyncio.run(run_all())
    elapsed = time.monotonic() - t0
    finished = [r for r in results if r is not None]
    assert len(finished) == 256 - 32
    for prompt, ids, text in finished:
        assert ids == ref[prompt]["output_ids"], prompt
        assert text == ref[prompt]["text"]
    after = wait_idle(server.url, before["minisgl_integrity_checks"], timeout=120)
    assert aborting(server) - aborts_before == 32  # the API server aborted exactly the quitters
    assert after["minisgl_aborted_requests"] - before["minisgl_aborted_requests"] >= 32
    assert after["minisgl_integrity_failures"] == 0
    assert after["minisgl_kv_used_pages"] == after["minisgl_kv_cached_pages"]
    assert after["minisgl_max_batch_size"] >= 100, "the load should have been batched"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "2 + 2 =", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200
    print(f"256 streams in {elapsed:.1f} s")


# ---- last: a dead worker takes the service down ----------------------------------------------------------
def test_a_worker_that_dies_takes_the_service_down_with_a_clear_message(server):
    workers = server.workers()
    pid = int(re.search(r"minisgl-scheduler-0 \(pid (\d+)\)", server.log_text()).group(1))
    psutil.Process(pid).kill()
    assert server.proc.wait(30) != 0
    log = server.log_text()
    assert re.search(r"worker process minisgl-scheduler-0 \(pid \d+\) exited with code -9", log), log[-2000:]
    assert "shutting the service down" in log
    _gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"orphans left: {alive}"
