"""No request can stop the service: each class of hostile request gets a 4xx naming the field, then a normal
request still succeeds and every process of the service is still the one that started.

The service runs a tiny random Llama with the default model's tokenizer (fast to start), a context of 256,
4 request slots, at most 16 sequences per request and 8 waiting sequences.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from helpers import Service, serving
from test_server_lifecycle import _tiny_model_with_a_real_tokenizer

CONTEXT = 256
VOCAB = 49152
ARGS = ["--dtype", "float32", "--num-pages", "4096", "--max-seq-len-override", str(CONTEXT)]
ARGS += ["--max-running-req", "4", "--max-sequences-per-request", "16", "--max-waiting-requests", "8"]
ARGS += ["--request-timeout", "5"]
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    model = _tiny_model_with_a_real_tokenizer(str(tmp_path_factory.mktemp("tiny")))
    with serving(["--model", model, *ARGS], tmp_path_factory.mktemp("bounds") / "server.log") as s:
        s.pids = sorted(p.pid for p in s.workers())  # type: ignore[attr-defined]
        yield s


def post(service: Service, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{service.url}{path}", content=content, headers=headers, timeout=120)


def assert_refused(r: httpx.Response, param: str | None, code: str | None = None, status: int = 400) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


def assert_still_serving(service: Service) -> None:
    """A normal request succeeds and no process of the service died or was replaced."""
    r = post(service, "/v1/completions", COMPLETION)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert service.proc.poll() is None
    assert sorted(p.pid for p in service.workers()) == service.pids  # type: ignore[attr-defined]


HUGE = [2**63, 2**70, -(2**63) - 1]
INTEGER_FIELDS = [
    ("/v1/completions", COMPLETION, "max_tokens"),
    ("/v1/completions", COMPLETION, "top_k"),
    ("/v1/completions", COMPLETION, "seed"),
    ("/v1/completions", COMPLETION, "n"),
    ("/v1/completions", COMPLETION, "logprobs"),
    ("/v1/chat/completions", dict(CHAT, logprobs=True), "top_logprobs"),
    ("/v1/chat/completions", CHAT, "max_completion_tokens"),
]


@pytest.mark.parametrize("value", HUGE)
@pytest.mark.parametrize("path,base,field", INTEGER_FIELDS)
def test_an_integer_beyond_64_bits_is_a_400_naming_its_field(service, path, base, field, value):
    assert_refused(post(service, path, dict(base, **{field: value})), field, "invalid_value")
    assert_still_serving(service)


@pytest.mark.parametrize(
    "body,param",
    [
        (dict(COMPLETION, prompt=[1, 2**40]), "prompt"),  # beyond int32: once a tokenizer-worker crash
        (dict(COMPLETION, prompt=[1, 2**63 - 1]), "prompt"),
        (dict(COMPLETION, prompt=[[1], [-(2**40)]]), "prompt"),
        (dict(COMPLETION, prompt=[1, VOCAB]), "prompt"),
        (dict(COMPLETION, stop=[2**40]), "stop"),
        (dict(COMPLETION, stop_token_ids=[VOCAB]), "stop"),
        (dict(COMPLETION, stop_token_ids=[2**64]), "stop_token_ids"),
        (dict(COMPLETION, top_k=2**63 - 1, temperature=1.0), None),  # fine: no limit (once a scheduler crash)
    ],
)
def test_token_ids_are_checked_against_the_vocabulary_before_any_narrowing(service, body, param):
    r = post(service, "/v1/completions", body)
    if param is None:
        assert r.status_code == 200, r.text
    else:
        assert_refused(r, param)
    assert_still_serving(service)


def test_generate_bounds_its_ids_and_its_sampling_params_too(service):
    assert_refused(post(service, "/generate", {"input_ids": [2**70]}), "input_ids")
    assert_refused(post(service, "/generate", {"input_ids": [3, 2**40]}), "input_ids")
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2**70}}
    assert_refused(post(service, "/generate", body), "max_new_tokens")
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "seed": -(2**70)}}
    assert_refused(post(service, "/generate", body), "seed")
    assert_still_serving(service)


@pytest.mark.parametrize("depth", [33, 5_000, 200_000])
def test_deep_json_nesting_is_a_400_not_a_500(service, depth):
    raw = b'{"prompt": "hi", "extra": ' + b"[" * depth + b"]" * depth + b"}"
    r = post(service, "/v1/completions", raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_json" and "nests deeper than 32" in err["message"]
    assert err["param"] in ("extra", None)  # named where the parser got that far
    assert_still_serving(service)


@pytest.mark.parametrize(
    "path,raw,param",
    [
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
        ("/v1/completions", b'{"prompt": "\\udfff", "max_tokens": 1}', "prompt"),
        ("/v1/completions", b'{"prompt": "hi", "stop": ["\\udc00"], "max_tokens": 1}', "stop"),
        ("/v1/completions", b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 1}', None),  # encoded surrogate
    ],
)
def test_strings_that_are_not_valid_utf8_are_a_400(service, path, raw, param):
    assert_refused(post(service, path, raw), param)
    assert_still_serving(service)


def test_a_surrogate_pair_is_a_valid_character(service):
    raw = b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 1}'
    assert post(service, "/v1/completions", raw).status_code == 200


def test_a_prompt_beyond_the_byte_bound_is_refused_before_it_is_tokenized(service):
    t = time.perf_counter()
    r = post(service, "/v1/completions", {"prompt": "ab " * (1 << 20), "max_tokens": 1})
    assert_refused(r, "prompt", "context_length_exceeded")
    assert time.perf_counter() - t < 10
    many = {"messages": [{"role": "user", "content": "hi"}] * (CONTEXT + 1), "max_tokens": 1}
    assert_refused(post(service, "/v1/chat/completions", many), "messages", "context_length_exceeded")
    long = {"messages": [{"role": "user", "content": "x" * (CONTEXT * 32 + 1)}], "max_tokens": 1}
    assert_refused(post(service, "/v1/chat/completions", long), "messages", "context_length_exceeded")
    assert_still_serving(service)


def test_sequences_per_request_are_capped_naming_n_or_the_prompt(service):
    assert_refused(post(service, "/v1/completions", dict(COMPLETION, prompt=["a", "b", "c"], n=6)), "n")
    assert_refused(post(service, "/v1/completions", dict(COMPLETION, prompt=["a"] * 17)), "prompt")
    assert_refused(post(service, "/generate", {"text": ["a"] * 17}), "text")
    assert_refused(post(service, "/v1/chat/completions", dict(CHAT, n=17)), "n")
    assert_still_serving(service)


def test_too_many_waiting_sequences_get_a_429_with_retry_after(service):
    # 16 sequences, 4 can run: 12 would wait, more than --max-waiting-requests 8
    r = post(service, "/v1/completions", dict(COMPLETION, prompt=["a", "b"], n=8))
    assert_refused(r, None, "rate_limit_exceeded", status=429)
    assert r.headers["Retry-After"] == "1"
    assert r.json()["error"]["type"] == "requests"
    r = post(service, "/v1/completions", dict(COMPLETION, prompt=["a", "b"], n=6))  # 8 would wait: fine
    assert r.status_code == 200 and len(r.json()["choices"]) == 12
    assert_still_serving(service)


def test_generate_honours_a_top_level_max_tokens(service):
    r = post(service, "/generate", {"text": "hi", "max_tokens": 3, "sampling_params": {"ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    "path,field,value",
    [
        ("/v1/completions", "best_of", 2),
        ("/v1/completions", "suffix", "end"),
        ("/v1/chat/completions", "functions", [{"name": "f"}]),
        ("/v1/chat/completions", "function_call", "auto"),
        ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
        ("/v1/chat/completions", "audio", {"voice": "alloy"}),
        ("/v1/chat/completions", "modalities", ["text", "audio"]),
        ("/v1/chat/completions", "min_tokens", 3),
    ],
)
def test_an_unimplemented_field_that_asks_for_something_is_a_400_naming_it(service, path, field, value):
    base = CHAT if "chat" in path else COMPLETION
    assert_refused(post(service, path, dict(base, **{field: value})), field, "unsupported_parameter")


@pytest.mark.parametrize(
    "path,fields",
    [
        ("/v1/completions", {"best_of": 1, "suffix": None, "echo": False, "user": "u"}),
        ("/v1/chat/completions", {"user": "u", "metadata": {"k": "v"}, "store": False, "tools": []}),
        ("/v1/chat/completions", {"tool_choice": "none", "response_format": {"type": "text"}}),
    ],
)
def test_fields_that_ask_for_nothing_are_accepted(service, path, fields):
    base = CHAT if "chat" in path else COMPLETION
    assert post(service, path, dict(base, **fields)).status_code == 200


def test_logit_bias_is_applied_and_its_keys_and_size_are_checked(service):
    token = 1234
    body = dict(COMPLETION, max_tokens=4, temperature=0, ignore_eos=True, logit_bias={str(token): 100})
    r = post(service, "/generate", {"text": "hi", "sampling_params": body})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == [token] * 4
    for bias in ({"abc": 1}, {"-5": 1}, {"1" * 11: 1}, {str(i): 1 for i in range(301)}):
        assert_refused(post(service, "/v1/completions", dict(COMPLETION, logit_bias=bias)), "logit_bias")
    assert_refused(
        post(service, "/v1/completions", dict(COMPLETION, logit_bias={str(VOCAB): 1})), "logit_bias"
    )
    assert_refused(post(service, "/v1/completions", dict(COMPLETION, logit_bias={"5": 101})), "logit_bias")
    assert_still_serving(service)


@pytest.mark.parametrize(
    "field,value",
    [
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1),
    ],
)
def test_penalties_are_read_and_checked(service, field, value):
    assert_refused(
        post(service, "/v1/completions", dict(COMPLETION, **{field: value})), field, "invalid_value"
    )


def test_penalties_change_a_greedy_output(service):
    """A repeating greedy output changes under a repetition or frequency penalty: the fields reach the sampler."""
    base = {"prompt": "hi", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = post(service, "/v1/completions", base).json()["choices"][0]["text"]
    for field, value in (("frequency_penalty", 2.0), ("presence_penalty", 2.0), ("repetition_penalty", 5.0)):
        r = post(service, "/v1/completions", dict(base, **{field: value}))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] != plain, field


def test_stop_strings_are_bounded(service):
    assert_refused(post(service, "/v1/completions", dict(COMPLETION, stop=["x"] * 17)), "stop")
    assert_refused(post(service, "/v1/completions", dict(COMPLETION, stop=["x" * 257])), "stop")
    assert_still_serving(service)


# ---- the workers, without a service ---------------------------------------------------------------------
class _FailingTokenizer:
    """Decodes token t as chr(97 + t % 26); token 666 raises."""

    def get_vocab(self):
        return {}  # no byte-level pieces: a token's bytes are its text

    def convert_ids_to_tokens(self, token_id):
        return self.decode([token_id])

    def decode(self, ids, skip_special_tokens=True):
        if 666 in ids:
            raise RuntimeError("cannot decode 666")
        return "".join(chr(97 + t % 26) for t in ids)


def test_a_detokenizer_failure_ends_only_its_request_and_aborts_it():
    from minisgl.message import DetokenizeMsg, DetokenizeStartMsg
    from minisgl.tokenizer import DetokenizeManager

    mgr = DetokenizeManager(_FailingTokenizer())
    for uid in (1, 2):
        mgr.start(DetokenizeStartMsg(uid, prompt_len=1, prompt_tail=[0]))
    replies, stopped = mgr.feed([DetokenizeMsg(1, 666), DetokenizeMsg(2, 1)])
    assert replies[0].finished and replies[0].finish_reason == "error" and "666" in replies[0].error
    assert stopped == [1]  # the scheduler is told to stop generating for it
    assert replies[1].text == "b" and not replies[1].finished
    replies, _ = mgr.feed([DetokenizeMsg(1, 3), DetokenizeMsg(2, 2, finished=True, finish_reason="length")])
    assert [r.uid for r in replies] == [2] and replies[0].text == "c"  # request 1's late tokens are dropped


def test_the_prompt_tokenizer_turns_every_failure_into_that_requests_error(monkeypatch):
    from minisgl.core import SamplingParams
    from minisgl.message import TokenizeMsg
    from minisgl.service.tokenizer_worker import PromptTokenizer

    class Sent:
        def __init__(self):
            self.items = []

        def put(self, obj):
            self.items.append(obj)

    pt = PromptTokenizer.__new__(PromptTokenizer)
    pt.vocab_size, pt._last = 100, None
    pt.send_backend, pt.send_detokenizer = Sent(), Sent()
    pt.mgr = type("M", (), {"tokenize": staticmethod(lambda msg: msg.input_ids)})()
    for ids, param in (([5, 2**40], "prompt"), ([5, 100], "prompt"), ([], "prompt")):
        pt.handle(TokenizeMsg(7, SamplingParams(), input_ids=ids))
        batch = pt.send_detokenizer.items.pop()
        assert len(batch) == 1
        error = batch.row(0)
        assert error.uid == 7 and error.finish_reason == "error" and error.error_param == param
    pt.handle(TokenizeMsg(8, SamplingParams(stop_token_ids=[100]), input_ids=[5]))
    assert pt.send_detokenizer.items.pop().row(0).error_param == "stop_token_ids"
    assert not pt.send_backend.items  # nothing reached the scheduler
    pt.handle(TokenizeMsg(9, SamplingParams(), input_ids=[5, 99]))
    assert pt.send_backend.items[0].input_ids.tolist() == [5, 99]


def test_a_half_sent_body_is_a_408_after_the_request_timeout_and_others_are_served_meanwhile(service):
    port = int(service.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: 1000\r\n\r\n".encode() + b'{"prompt": "hi"')  # and no more
        t0 = time.monotonic()
        assert_still_serving(service)  # the half-sent request holds nothing up
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    waited = time.monotonic() - t0
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.split()[1] == b"408", answer
    assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert 4 < waited < 30  # --request-timeout 5, counted from the headers
    assert_still_serving(service)


@pytest.mark.parametrize("after_a_request", [False, True])
def test_headers_never_finished_close_the_connection_after_the_request_timeout(service, after_a_request):
    """A slow client that sends half its headers (on a new connection, or on a kept-alive one after a
    response) is cut off after --request-timeout; other requests are served meanwhile."""
    port = int(service.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        if after_a_request:
            body = json.dumps(COMPLETION).encode()
            head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            head += f"Content-Length: {len(body)}\r\n\r\n"
            sock.sendall(head.encode() + body)
            answer = b""
            while not answer.rstrip().endswith(b"}"):
                answer += sock.recv(65536)
            assert answer.split()[1] == b"200", answer
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and no more
        t0 = time.monotonic()
        assert_still_serving(service)
        while sock.recv(65536):  # until the server closes the connection
            pass
    assert time.monotonic() - t0 < 30  # --request-timeout 5 (a keep-alive timeout would not apply here)
    assert_still_serving(service)
