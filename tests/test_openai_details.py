"""The OpenAI behaviours clients rely on: the API key, model names and aliases, error objects on every error
status, `cached_tokens` from the prefix cache, and the real bytes of logprob tokens.

One service for the module (the default model, pages of 4 tokens, two served names, the key from
MINISGL_API_KEY); the error handlers and the key comparison are also driven in-process.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import uuid

import httpx
import pytest
from helpers import serving
from starlette.testclient import TestClient
from test_server import chat_ids, sse_events
from transformers.convert_slow_tokenizer import bytes_to_unicode

from minisgl.message import DetokenizeMsg, DetokenizeStartMsg, UserReply, dumps, loads
from minisgl.models.resolve import resolve_model_path
from minisgl.service.args import ServerArgs, parse_args
from minisgl.service.openai import auth
from minisgl.service.openai.errors import SERVER_ERROR, FieldNames
from minisgl.service.openai.render import Renderer
from minisgl.service.openai.routes import create_app
from minisgl.service.openai.routing import ChoiceState
from minisgl.service.openai.server import Job, OpenAIServer
from minisgl.tokenizer.detokenize import DetokenizeManager, TokenBytes
from minisgl.utils.hf import load_tokenizer

openai = pytest.importorskip("openai")

KEY = "sk-minisgl-test-0123456789"
PAGE = 4  # tokens per KV page: the radix cache shares whole pages only
NAMES = ["SmolLM2-135M-Instruct", "alias-b"]
BODY_LIMIT = 64 << 10
ARGS = ["--dtype", "float32", "--num-pages", "2048", "--max-seq-len-override", "512"]
ARGS += ["--page-size", str(PAGE), "--served-model-name", ",".join(NAMES)]
ARGS += ["--max-request-bytes", str(BODY_LIMIT)]
AUTH = {"Authorization": f"Bearer {KEY}"}
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # /v1/models needs the key here: readiness is /health
    log = tmp_path_factory.mktemp("details") / "server.log"
    with serving(ARGS, log, env={"MINISGL_API_KEY": KEY}, ready_path="/health") as service:
        yield service


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=300, max_retries=0)


def assert_error_object(r: httpx.Response, status: int, code, kind: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == kind and err["code"] == code
    return err


# ---- the API key ------------------------------------------------------------------------------------------
def test_the_env_var_is_the_api_keys_default_and_the_flag_overrides_it(monkeypatch):
    monkeypatch.setenv("MINISGL_API_KEY", "from-env")
    assert ServerArgs().api_key == "from-env"
    assert parse_args(["--api-key", "from-flag"]).api_key == "from-flag"
    monkeypatch.delenv("MINISGL_API_KEY")
    assert ServerArgs().api_key == ""  # no key: no check


ROUTES = ["GET /v1/models", "GET /v1/models/alias-b", "POST /v1/chat/completions", "POST /v1/completions"]
ROUTES += ["POST /generate", "GET /metrics", "GET /no/such/route"]


@pytest.mark.parametrize("route", ROUTES)
def test_every_endpoint_but_health_refuses_a_missing_or_wrong_key_as_openai_does(server, route):
    method, path = route.split()
    body = {"model": NAMES[0], "messages": HELLO, "prompt": "hi", "text": "hi", "max_tokens": 1}
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
        {"Authorization": "Basic x"},
    ):
        r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=60)
        err = assert_error_object(r, 401, "invalid_api_key")
        assert KEY not in err["message"]
        assert "API key" in err["message"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}  # probes carry no key


def test_openai_client_with_the_right_key_works_and_a_wrong_key_raises_authentication_error(server, client):
    r = client.chat.completions.create(model=NAMES[0], messages=HELLO, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.chat.completions.create(model=NAMES[0], messages=HELLO, max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_the_key_is_compared_in_constant_time(monkeypatch):
    compared: list[tuple[bytes, bytes]] = []

    def compare_digest(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return a == b

    monkeypatch.setattr(auth.hmac, "compare_digest", compare_digest)
    c = TestClient(create_app(ServerArgs(api_key="k1")))
    assert c.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
    assert compared == [(b"k2", b"k1"), (b"k1", b"k1")]


@pytest.mark.parametrize("key_from", ["flag", "env"])
def test_the_online_benchmark_client_sends_the_key(server, tmp_path, key_from):
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "minisgl.benchmark.online", "--base-url", f"{server.url}/v1"]
    cmd += ["--num-requests", "2", "--max-tokens", "2", "--warmup", "0", "--output-json", str(out)]
    env = dict(os.environ, MINISGL_API_KEY=KEY) if key_from == "env" else dict(os.environ)
    if key_from == "flag":
        env.pop("MINISGL_API_KEY", None)
        cmd += ["--api-key", KEY]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["completed"] == 2 and rep["model"] == NAMES[0]  # /v1/models answered with the key


# ---- model names ------------------------------------------------------------------------------------------
def test_models_lists_every_served_name_first_the_reported_one_and_serves_each_card(http):
    listed = http.get("/v1/models").json()
    assert [card["id"] for card in listed["data"]] == NAMES
    for name in NAMES:
        card = http.get(f"/v1/models/{name}").json()
        assert card["id"] == name and card["object"] == "model" and card["max_model_len"] == 512


def test_an_unknown_model_is_openais_404_and_an_alias_or_no_model_is_served(http, client):
    expected = "The model `gpt-4o` does not exist or you do not have access to it."
    for path, body in [
        ("/v1/chat/completions", {"model": "gpt-4o", "messages": HELLO, "max_tokens": 1}),
        ("/v1/completions", {"model": "gpt-4o", "prompt": "hi", "max_tokens": 1}),
    ]:
        assert assert_error_object(http.post(path, json=body), 404, "model_not_found")["message"] == expected
    assert assert_error_object(http.get("/v1/models/gpt-4o"), 404, "model_not_found")["message"] == expected
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    # an alias is served and the reply reports the first name; an absent model is allowed, as before
    r = http.post("/v1/chat/completions", json={"model": "alias-b", "messages": HELLO, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == NAMES[0]
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == NAMES[0]


# ---- error objects on every status ------------------------------------------------------------------------
def test_unknown_routes_wrong_methods_and_big_bodies_answer_openai_error_objects(http):
    err = assert_error_object(http.get("/v1/no-such-thing"), 404, None)
    assert err["message"] == "Invalid URL (GET /v1/no-such-thing)"
    r = http.get("/v1/chat/completions")
    assert_error_object(r, 405, None)
    assert r.headers["allow"] == "POST"
    big = {"model": NAMES[0], "prompt": "x" * BODY_LIMIT, "max_tokens": 1}
    r = http.post("/v1/completions", json=big)
    assert r.status_code in (400, 413) and r.json()["error"]["code"] == "request_too_large"
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_framework_validation_and_unexpected_exceptions_answer_error_objects_and_the_app_keeps_serving():
    app = create_app(ServerArgs())

    @app.get("/typed/{n}")
    async def typed(n: int) -> dict:
        return {"n": n}

    @app.get("/bug")
    async def bug() -> dict:
        raise RuntimeError("an unexpected failure")

    c = TestClient(app, raise_server_exceptions=False, base_url="http://localhost")  # a loopback Host
    err = assert_error_object(c.get("/typed/abc"), 400, "invalid_value")
    assert err["param"] == "n"
    for _ in range(2):  # a failure leaves the app serving
        assert_error_object(c.get("/bug"), 500, None, kind="server_error")
        assert c.get("/typed/3").json() == {"n": 3}
    assert c.get("/health").json() == {"status": "ok"}


def test_an_exception_while_streaming_ends_the_stream_with_a_server_error_event():
    class BrokenRenderer(Renderer):
        def stream_delta(self, c, reply, offset):
            raise RuntimeError("a renderer bug")

    class OneChoice:  # a Generation whose one choice has answered
        done, closed = True, False

        def close(self) -> None:
            self.closed = True

    server = OpenAIServer(ServerArgs(), 512, lambda: True)
    job = Job(BrokenRenderer("m", "r"), [], [0], True, FieldNames("prompt"))
    gen = OneChoice()
    first = (ChoiceState(0, 0, 0), UserReply(0, text="hi"))

    async def collect() -> list[bytes]:
        return [chunk async for chunk in server._stream(gen, job, first)]

    chunks = asyncio.run(collect())
    assert sse_events(chunks[-1].decode().splitlines()) == [
        {"error": {"message": SERVER_ERROR, "type": "server_error", "param": None, "code": None}}
    ]
    assert gen.closed  # whatever failed, the request's choices are aborted


# ---- cached_tokens ----------------------------------------------------------------------------------------
def cached_after_one_request(prompt_len: int) -> int:
    """Hand count: a finished request leaves its prompt's whole pages in the radix cache, and a match keeps
    at least one token to compute, so the same prompt again finds its first (len - 1) // page pages."""
    return (prompt_len - 1) // PAGE * PAGE


def fresh_prompt_ids(length: int) -> list[int]:
    """Token ids no earlier request started with (a random first token), so nothing of them is cached."""
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(1000, 40000) for _ in range(length)]


@pytest.mark.parametrize("length", [37, 40])
def test_the_same_prompt_twice_reports_the_page_aligned_cached_prefix(http, length):
    ids = fresh_prompt_ids(length)
    body = {"model": NAMES[0], "prompt": ids, "max_tokens": 1, "temperature": 0}
    first, second = (http.post("/v1/completions", json=body).json()["usage"] for _ in range(2))
    assert first["prompt_tokens"] == second["prompt_tokens"] == length
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["prompt_tokens_details"] == {"cached_tokens": cached_after_one_request(length)}
    meta = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}).json()
    assert meta["meta_info"]["cached_tokens"] == cached_after_one_request(length)


def test_chat_usage_streamed_or_not_reports_cached_tokens(http, tokenizer):
    messages = [{"role": "user", "content": f"Tell me about the number {uuid.uuid4().int % 10**9}."}]
    length = len(chat_ids(tokenizer, messages))
    body = {"model": NAMES[0], "messages": messages, "max_tokens": 2, "temperature": 0}
    http.post("/v1/chat/completions", json=body)
    usage = http.post("/v1/chat/completions", json=body).json()["usage"]
    assert usage["prompt_tokens"] == length
    assert usage["prompt_tokens_details"]["cached_tokens"] == cached_after_one_request(length)
    stream = dict(body, stream=True, stream_options={"include_usage": True})
    with http.stream("POST", "/v1/chat/completions", json=stream) as r:
        events = sse_events(r.iter_lines())
    usage = events[-2]["usage"]
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert usage["prompt_tokens"] == length
    assert usage["prompt_tokens_details"]["cached_tokens"] == cached_after_one_request(length)


def test_n_choices_of_a_fresh_prompt_count_its_cached_tokens_once_as_its_first_choice_saw_them(http):
    ids = fresh_prompt_ids(21)
    body = {"model": NAMES[0], "prompt": ids, "max_tokens": 1, "n": 3, "temperature": 0}
    usage = http.post("/v1/completions", json=body).json()["usage"]
    assert usage["prompt_tokens"] == 21 and usage["prompt_tokens_details"]["cached_tokens"] == 0


# ---- logprob bytes ----------------------------------------------------------------------------------------
def reference_bytes(tokenizer, token_id: int) -> bytes:
    """The tokenizer's own byte-level table (transformers' GPT-2 bytes_to_unicode) applied to the piece."""
    decoder = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(decoder[c] for c in tokenizer.convert_ids_to_tokens(token_id))


def test_logprob_tokens_carry_their_real_bytes_even_inside_a_utf8_character(tokenizer):
    text = "ok 🎉 日本"
    ids = tokenizer.encode(text, add_special_tokens=False)
    mgr = DetokenizeManager(tokenizer)
    mgr.start(DetokenizeStartMsg(1, prompt_len=1, logprobs=True))
    alternatives = [(ids[0], -1.0), (ids[1], -2.0)]
    msgs = [DetokenizeMsg(1, t, i == len(ids) - 1, "length", -0.5, alternatives) for i, t in enumerate(ids)]
    replies, _ = mgr.feed(msgs)
    lps = [lp for r in replies for lp in r.logprobs]
    assert [lp.token_bytes for lp in lps] == [reference_bytes(tokenizer, t) for t in ids]
    assert b"".join(lp.token_bytes for lp in lps) == text.encode("utf-8")
    assert [lp.token for lp in lps] == [tokenizer.decode([t]) for t in ids]  # decoded alone, as OpenAI
    assert any("\ufffd" in lp.token for lp in lps), "the emoji should span several tokens"
    assert lps[0].top_bytes == [reference_bytes(tokenizer, ids[0]), reference_bytes(tokenizer, ids[1])]
    back = loads(dumps(lps[1]))  # the bytes cross the process boundary as bytes
    assert back.token_bytes == lps[1].token_bytes and back.top_bytes == lps[1].top_bytes


def test_sentencepiece_byte_pieces_and_word_marks_become_their_bytes():
    class Pieces:  # a SentencePiece-style vocabulary, by hand
        def __init__(self) -> None:
            self.pieces = {0: "<0x0A>", 1: "<0xE6>", 2: "\u2581Paris", 3: "<s>"}
            self.added_tokens_decoder = {3: "<s>"}

        def get_vocab(self) -> dict[str, int]:
            return {p: i for i, p in self.pieces.items()}

        def convert_ids_to_tokens(self, i: int) -> str:
            return self.pieces[i]

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "".join(self.pieces[i] for i in ids)

    tb = TokenBytes(Pieces())
    assert [tb(i) for i in range(4)] == [b"\n", b"\xe6", b" Paris", b"<s>"]


def test_chat_logprobs_bytes_concatenate_to_the_content_of_a_multibyte_answer(http):
    body = {
        "model": NAMES[0],
        "messages": [{"role": "user", "content": "Reply with three emoji."}],
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    content, entries = choice["message"]["content"], choice["logprobs"]["content"]
    raw = b"".join(bytes(e["bytes"]) for e in entries)
    # the text drops a character the output cut off (at most 3 bytes of it): everything else is exact
    assert raw.startswith(content.encode("utf-8")) and len(raw) - len(content.encode("utf-8")) < 4
    assert any(not _is_utf8(bytes(e["bytes"])) for e in entries), "expected a token inside a character"
    for e in entries:  # greedy: the chosen token is the first alternative, bytes and all
        assert e["top_logprobs"][0]["bytes"] == e["bytes"] and e["top_logprobs"][0]["token"] == e["token"]


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
