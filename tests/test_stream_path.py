"""The per-token path of the service: one columnar message per step, the detokenizer's stream decoder and
its stream interval, the API server's coalesced SSE writes and TCP_NODELAY on every connection.

References: the Hugging Face tokenizer's decode of all the tokens at once, a hand count of the replies an
interval gives, and the offline `LLM.generate` (no processes, no ZMQ) for the service's text."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from helpers import serving

from minisgl.core import SamplingParams
from minisgl.message import DetokenizeMsg, DetokenizeStartMsg, TokenBatch
from minisgl.models.resolve import resolve_model_path
from minisgl.tokenizer import DetokenizeManager
from minisgl.utils.hf import load_tokenizer

openai = pytest.importorskip("openai")

UTF8_HEAVY = "Grüße aus 北京！🎉🚀 Ça va? 日本語のテキスト, emoji 👩‍👩‍👧 and ∑ ∫ ≠ math."
CODE = "def f(x):\n    return {'a': [x, x ** 2]}  # done\n\n\tprint(f(3))\n"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


def _run(tok, ids: list[int], interval: int, python_only: bool = False, stop=(), tail=()):
    """Feed `ids` one step each through a DetokenizeManager; returns its replies."""
    mgr = DetokenizeManager(tok, stream_interval=interval)
    if python_only:
        mgr.rust = None  # the fallback: the window decoded in Python
    mgr.start(DetokenizeStartMsg(1, prompt_len=len(tail), prompt_tail=list(tail), stop=list(stop)))
    replies = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        out, _ = mgr.feed_batch(TokenBatch.of([DetokenizeMsg(1, t, last, "length" if last else None)]))
        replies += out.replies()
        if replies and replies[-1].finished:
            break
    return replies


@pytest.mark.parametrize("interval", [1, 4])
@pytest.mark.parametrize("python_only", [False, True])
@pytest.mark.parametrize("text", [UTF8_HEAVY, CODE, "plain words " * 20])
def test_streamed_text_equals_the_decode_of_all_tokens(tokenizer, interval, python_only, text):
    ids = tokenizer.encode(text)
    replies = _run(tokenizer, ids, interval, python_only)
    assert "".join(r.text for r in replies) == tokenizer.decode(ids, skip_special_tokens=True)
    assert [t for r in replies for t in r.token_ids] == ids
    assert len(replies) == 1 + math.ceil((len(ids) - 1) / interval)  # the first, every N-th, the last
    assert all("\ufffd" not in r.text for r in replies)  # no character was ever shown broken
    assert replies[-1].completion_tokens == len(ids) and replies[0].prompt_tokens == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_tokens_stream_as_their_whole_decode(tokenizer, seed):
    """Arbitrary token sequences (byte fragments, special tokens): the streamed text is the decode of all
    of them, less a character the end of the output cut off."""
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(300)]
    expected = tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
    for python_only in (False, True):
        replies = _run(tokenizer, ids, 3, python_only)
        assert "".join(r.text for r in replies) == expected


@pytest.mark.parametrize("interval", [1, 4])
def test_a_stop_string_inside_a_token_is_cut_and_never_shown(tokenizer, interval):
    text = "The capital of Italy is Rome, and the capital of Spain is Madrid."
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([t]) for t in ids]
    k = next(i for i, p in enumerate(pieces) if len(p.strip()) >= 5 and i > 3)  # a long token mid-text
    start = len(tokenizer.decode(ids[:k])) + 2
    stop = text[start : start + 2]  # two characters from the middle of that token
    replies = _run(tokenizer, ids, interval, stop=[stop])
    shown = "".join(r.text for r in replies)
    assert shown == text[: text.index(stop)]
    assert replies[-1].finished and replies[-1].finish_reason == "stop"


def test_prompt_context_keeps_the_first_words_space(tokenizer):
    prompt = tokenizer.encode("Say hi:")
    ids = tokenizer.encode("Say hi: hello there, friend")[len(prompt) :]
    expected = tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)) :]
    for python_only in (False, True):
        replies = _run(tokenizer, ids, 1, python_only, tail=prompt)
        assert "".join(r.text for r in replies) == expected


# ---- the service -------------------------------------------------------------------------------------
CONTEXT = 256
PROMPTS = [
    "Translate to Chinese and Japanese: good morning, my friend.",
    "Write three emoji and explain each.",
    "Schreibe einen Satz über Grüße und Straßen.",
    "List five French words with accents.",
] + [f"Write one sentence about the number {i}." for i in range(8)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--dtype", "float32", "--num-pages", "4096", "--max-seq-len-override", str(CONTEXT)]
    args += ["--stream-interval", "4"]
    with serving(args, tmp_path_factory.mktemp("stream") / "server.log") as service:
        yield service


@pytest.fixture(scope="module")
def offline(tokenizer):
    """The offline LLM's greedy text for each prompt (chat template applied as the service does)."""
    from minisgl.llm import LLM

    ids = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for p in PROMPTS
    ]
    threads = torch.get_num_threads()
    llm = LLM(
        model_path=None,
        dtype=torch.float32,
        num_page_override=2048,
        max_seq_len_override=CONTEXT,
        show_progress=False,
    )
    try:
        outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    finally:
        llm.shutdown()
        torch.set_num_threads(threads)
    return {p: o for p, o in zip(PROMPTS, outs)}


def _chat(url: str, prompt: str, stream: bool, stop: str | None = None) -> str:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
    }
    if stop is not None:
        body["stop"] = [stop]
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        for choice in json.loads(e)["choices"]:
            text += choice["delta"].get("content") or ""
    return text


def test_streams_with_an_interval_equal_the_whole_text_and_the_offline_text(server, offline, tokenizer):
    """Many concurrent requests, streamed (4 tokens a chunk) and not, UTF-8 split across tokens, and stop
    strings cut from the middle of a token: every text equals the offline LLM's."""
    jobs = []
    for p in PROMPTS:
        o = offline[p]
        # the offline text is the tokenizer's decode of all the tokens; a character the end of the output
        # cut off shows there as U+FFFD, and the service drops it (documented)
        whole = o["text"].rstrip("\ufffd")
        jobs += [(p, True, None, whole), (p, False, None, whole)]
        pieces = [tokenizer.decode([t]) for t in o["token_ids"]]
        k = next((i for i, s in enumerate(pieces) if len(s.strip()) >= 4 and i > 1), None)
        if k is not None:  # a stop string of two characters from inside token k
            start = len(tokenizer.decode(o["token_ids"][:k], skip_special_tokens=True)) + 2
            stop = o["text"][start : start + 2]
            expected = o["text"][: o["text"].index(stop)]
            jobs += [(p, True, stop, expected), (p, False, stop, expected)]
    with ThreadPoolExecutor(len(jobs)) as ex:
        texts = list(ex.map(lambda j: _chat(server.url, j[0], j[1], j[2]), jobs))
    for (p, stream, stop, expected), text in zip(jobs, texts):
        assert text == expected, (p, stream, stop)


def test_a_stream_interval_sends_the_first_token_alone_then_every_n(server):
    body = {"text": "Count: one, two, three,", "stream": True}
    body["sampling_params"] = {"max_new_tokens": 13, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    # the chunks of one write may arrive together, but each carries its own tokens: 1, 4, 4, 4
    assert [len(e["output_ids"]) for e in events] == [1, 4, 4, 4]
    assert events[-1]["meta_info"]["completion_tokens"] == 13


def test_kept_alive_connections_get_tcp_nodelay():
    """The listening socket the launcher binds makes asyncio (which uvicorn serves on) set TCP_NODELAY on
    every accepted connection: without it a reply's body waited for the client's delayed ACK."""
    from minisgl.service.startup import bind_port

    async def main() -> list[int]:
        sock = bind_port("127.0.0.1", 0)
        port = sock.getsockname()[1]
        seen: list[int] = []

        class Proto(asyncio.Protocol):
            def connection_made(self, transport):
                s = transport.get_extra_info("socket")
                seen.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Proto, sock=sock)
        async with server:
            for _ in range(2):
                _, w = await asyncio.open_connection("127.0.0.1", port)
                await asyncio.sleep(0.05)
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()
            for _ in range(100):
                if len(seen) == 2:
                    break
                await asyncio.sleep(0.05)
        return seen

    assert [bool(v) for v in asyncio.run(main())] == [True, True]


def test_a_kept_alive_connection_serves_many_replies(server):
    """The same connection answers requests one after another (a pooled client's usual pattern)."""
    with httpx.Client(timeout=60) as c:
        for _ in range(5):
            assert c.get(f"{server.url}/health").status_code == 200
            r = c.post(
                f"{server.url}/v1/completions",
                json={"prompt": "1 + 1 =", "max_tokens": 2, "temperature": 0},
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# ---- the idle check ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_type", ["radix", "naive"])
@pytest.mark.parametrize("full", [False, True])
def test_the_idle_check_finds_a_leaked_page_and_a_locked_prefix_from_the_counts_alone(cache_type, full):
    """The service checks only the counts when idle (a GPU pool has a million pages); they still catch
    a page nobody holds and, with a prefix cache, a prefix left locked."""
    from minisgl.scheduler.cache import CacheManager

    cm = CacheManager(64, 1, cache_type)
    assert cm.check_integrity(full) is None
    pages = cm.alloc(5)
    assert "leak" in cm.check_integrity(full)  # 5 pages neither free nor cached
    if cache_type == "naive":
        cm.free(pages)
        assert cm.check_integrity(full) is None
        return
    node, _ = cm.cache.insert([1, 2, 3, 4, 5], torch.tensor(pages))
    assert cm.check_integrity(full) is None
    cm.cache.lock(node)
    assert "locked" in cm.check_integrity(full)
    cm.cache.unlock(node)
    cm.free(cm.cache.evict(5))
    assert cm.check_integrity(full) is None and cm.num_free == 64


# ---- the API server's side ------------------------------------------------------------------------------
class _Frontend:
    """What a Generation needs of the FrontendManager, without sockets."""

    def __init__(self):
        from minisgl.service.openai.metrics import Metrics

        self.metrics, self.uids, self.aborted = Metrics(1), iter(range(100)), set()

    def register(self, gen):
        return next(self.uids)

    def unregister(self, uid):
        pass

    def abort(self, uids):
        self.aborted |= set(uids)


def test_replies_a_handler_has_not_taken_join_into_one():
    from minisgl.service.openai.routing import Generation

    async def main():
        gen = Generation(_Frontend(), [0, 0])  # two choices: uids 0 and 1
        gen.push(0, "He", [1], {"prompt_tokens": 5})
        gen.push(1, "A", [7])
        gen.push(0, "llo", [2, 3])
        gen.push(0, "", [4])
        gen.push(0, "!", [5], {"finished": True, "finish_reason": "length", "completion_tokens": 5})
        items = await gen.drain()
        (c0, r0), (c1, r1) = items
        assert (r0.text, r0.token_ids, r0.finished, r0.finish_reason) == (
            "Hello!",
            [1, 2, 3, 4, 5],
            True,
            "length",
        )
        assert (c0.text, c0.completion_tokens, c0.prompt_tokens) == ("Hello!", 5, 5)
        assert (r1.text, r1.token_ids, r1.finished) == ("A", [7], False)
        # a reply already taken is not joined; an error never joins (the text before it stays shown)
        gen.push(1, "B", [8])
        gen.push(1, "", [], {"finished": True, "finish_reason": "error", "error": "boom"})
        items = await gen.drain()
        assert [(r.text, r.error) for _, r in items] == [("B", None), ("", "boom")]
        assert gen.done and c1.text == "AB"

    asyncio.run(main())
