"""Random JSON bodies against the running service: only 2xx/4xx answers (never a 500, never a reset
connection), every process alive afterwards and a normal request still served.

The bodies mix the real fields of each endpoint with hostile values: integers beyond 64 bits, NaN and
infinities, lone surrogates, deep nesting, wrong types, and random extra fields.
"""

from __future__ import annotations

import json

import httpx
import pytest
from test_server import Service
from test_server_lifecycle import _tiny_model_with_a_real_tokenizer

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CONTEXT = 128
ARGS = ["--dtype", "float32", "--num-pages", "2048", "--max-seq-len-override", str(CONTEXT)]
ARGS += ["--max-sequences-per-request", "8"]
ACCEPTED = {200, 400, 404, 413, 422, 429}  # 404: a model name this server does not serve

FIELDS = {  # each endpoint's fields (the last ones: OpenAI fields this server refuses or ignores)
    "/v1/chat/completions": [
        "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
        "stop", "stop_token_ids", "seed", "stream", "stream_options", "ignore_eos", "logprobs",
        "top_logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
        "user", "tools", "tool_choice", "response_format",
    ],
    "/v1/completions": [
        "prompt", "model", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "stop_token_ids",
        "seed", "stream", "stream_options", "ignore_eos", "logprobs", "echo", "best_of", "suffix",
        "frequency_penalty", "presence_penalty", "logit_bias",
    ],
    "/generate": ["text", "input_ids", "sampling_params", "stream", "max_tokens", "max_new_tokens"],
}  # fmt: skip

huge_ints = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, 2**70, -(2**63) - 1, -(2**31) - 1])
small_ints = st.integers(min_value=-3, max_value=6)
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, 2.0]))
surrogates = st.sampled_from(["\ud800", "a\udfffb", "\udc00\ud800"])
plain = st.text(max_size=12)
texts = st.one_of(plain, plain, plain, surrogates)  # a lone surrogate in about one string of 4
scalars = st.one_of(st.none(), st.booleans(), small_ints, huge_ints, floats, texts)


def _nested(depth: int) -> st.SearchStrategy:
    return st.integers(1, depth).map(lambda d: json.loads("[" * d + "1" + "]" * d))


values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(["role", "content", "type", "text", "5"]), inner, max_size=3),
    ),
    max_leaves=8,
)
hostile = st.one_of(values, _nested(40))
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "robot"]), "content": st.one_of(texts, values)}
)
PLAUSIBLE = {  # values that are often valid, so the fuzzing also reaches the workers
    "messages": st.lists(message, min_size=1, max_size=3),
    "prompt": st.one_of(texts, st.lists(st.integers(-2, 2**33), max_size=4), st.lists(texts, max_size=3)),
    "text": texts,
    "input_ids": st.lists(st.one_of(st.integers(0, 60000), huge_ints), max_size=4),
    "max_tokens": st.integers(0, 4),
    "max_completion_tokens": st.integers(-1, 4),
    "max_new_tokens": st.integers(-1, 4),
    "n": st.integers(0, 3),
    "stop": st.one_of(texts, st.lists(st.one_of(texts, st.integers(-1, 2**40)), max_size=3)),
    "stop_token_ids": st.lists(st.one_of(small_ints, huge_ints), max_size=3),
    "logit_bias": st.dictionaries(st.one_of(st.sampled_from(["1", "49151", "49152", "x", ""]), texts), floats, max_size=3),
    "sampling_params": st.dictionaries(
        st.sampled_from(["max_new_tokens", "temperature", "top_k", "seed", "stop", "n", "logit_bias"]), values, max_size=4
    ),
    "stream": st.booleans(),
    "logprobs": st.one_of(st.booleans(), small_ints),
    "top_logprobs": small_ints,
    "model": st.text(max_size=8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "ignore_eos": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "user": st.text(max_size=8),
    "best_of": st.just(1),
    "echo": st.just(False),
}  # fmt: skip
PROMPT_FIELD = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(FIELDS)))
    names = draw(st.lists(st.sampled_from(FIELDS[path]), unique=True, max_size=6))
    prompt = PROMPT_FIELD.get(path) or draw(st.sampled_from(["text", "input_ids"]))
    names = [prompt, *(n for n in names if n not in (prompt, "text", "input_ids"))]
    body = {}
    for n in names:  # mostly plausible values, so that many requests reach the workers
        plausible = n in PLAUSIBLE and draw(st.integers(0, 5)) > 0
        body[n] = draw(PLAUSIBLE[n] if plausible else hostile)
    if draw(st.integers(0, 3)) == 0:  # a random extra field
        body[draw(st.text(max_size=8))] = draw(hostile)
    if not any(n in PLAUSIBLE and isinstance(body.get(n), int) for n in ("max_tokens", "max_new_tokens")):
        body.setdefault("max_tokens", 2)  # keep each request short
    raw = json.dumps(body).encode()  # lone surrogates become \\udxxx escapes, NaN stays NaN
    if draw(st.integers(0, 19)) == 19:  # now and then, a broken body
        raw = draw(st.sampled_from([raw[: len(raw) // 2], b"\xff" + raw, b"[" * 10_000, b"null"]))
    return path, raw


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    model = _tiny_model_with_a_real_tokenizer(str(tmp_path_factory.mktemp("tiny")))
    s = Service(["--model", model, *ARGS], tmp_path_factory.mktemp("fuzz") / "server.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_random_bodies_never_get_a_500_and_never_kill_a_process(service):
    pids = sorted(p.pid for p in service.workers())
    client = httpx.Client(base_url=service.url, timeout=60, headers={"Content-Type": "application/json"})

    @settings(
        max_examples=300,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(bodies())
    def check(case: tuple[str, bytes]) -> None:
        path, raw = case
        r = client.post(path, content=raw)
        assert r.status_code in ACCEPTED, (path, raw[:300], r.status_code, r.text[:300])
        if r.status_code == 404:  # only OpenAI's answer to an unknown model
            assert r.json()["error"]["code"] == "model_not_found", r.text[:300]

    try:
        check()
    finally:
        client.close()
    ok = httpx.post(f"{service.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert service.proc.poll() is None
    assert sorted(p.pid for p in service.workers()) == pids
    assert "Traceback" not in service.log_text()
