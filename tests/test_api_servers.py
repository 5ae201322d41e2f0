"""Several API server processes on one port (--api-server-count): each connection lands in one of them,
each owns its requests' uids, the detokenizer sends every reply to its owner, /metrics sums over them, and
a SIGTERM drains every one of them.

References: the offline `LLM.generate` for the text, a hand count of the requests sent for the metrics,
and /get_server_info's `api_server_index` on a connection for which server holds it."""

from __future__ import annotations

import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import httpx
import psutil
import pytest
from helpers import Service, metrics, serving, wait_idle
from test_stream_path import CONTEXT, MAX_TOKENS, PROMPTS, offline, tokenizer  # noqa: F401 - fixtures

pytest.importorskip("openai")

K = 2
SERVERS = ["--dtype", "float32", "--num-pages", "4096", "--api-server-count", str(K), "--num-tokenizer", "2"]
ARGS = [*SERVERS, "--max-seq-len-override", str(CONTEXT)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(ARGS, tmp_path_factory.mktemp("api-servers") / "server.log") as service:
        yield service


def _client_of(url: str, index: int, tries: int = 400) -> httpx.Client:
    """A client whose one connection API server `index` holds (a new connection goes to whichever server
    accepts it first; the server that holds it says which it is). To be used at once: a connection left
    idle for 5 s is closed, and the next request would go out on a new one."""
    for _ in range(tries):
        client = httpx.Client(timeout=300, limits=httpx.Limits(max_connections=1))
        if client.get(f"{url}/get_server_info").json()["api_server_index"] == index:
            return client
        client.close()
    raise AssertionError(f"API server {index} held none of {tries} new connections")


def _stream(client: httpx.Client, url: str, body: dict) -> list[str]:
    with client.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def _text(events: list[str]) -> str:
    assert events[-1] == "[DONE]"
    return "".join(c["delta"].get("content") or "" for e in events[:-1] for c in json.loads(e)["choices"])


def _requests_total(url: str) -> float:
    return sum(v for k, v in metrics(url).items() if k.startswith("minisgl_requests_total"))


def test_every_api_server_answers_on_the_one_port(server):
    for index in range(K):
        with closing(_client_of(server.url, index)) as client:
            info = client.get(f"{server.url}/get_server_info").json()
            assert (info["api_server_index"], info["api_server_count"]) == (index, K)


def test_requests_in_every_server_equal_the_offline_text_and_metrics_sum_over_servers(server, offline):  # noqa: F811
    per_server = len(PROMPTS) // K
    # every prompt through every server, streamed and not: one client per (server, j), each running its
    # requests one after another on its one connection
    jobs = [(index, PROMPTS[j::per_server]) for index in range(K) for j in range(per_server)]
    before = _requests_total(server.url)

    def run(index: int, prompts: list[str]) -> list[tuple[str, bool, str]]:
        out = []
        with closing(_client_of(server.url, index)) as client:
            for p in prompts:
                body = {
                    "messages": [{"role": "user", "content": p}],
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                }
                out.append((p, True, _text(_stream(client, server.url, body))))
                r = client.post(f"{server.url}/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                out.append((p, False, r.json()["choices"][0]["message"]["content"]))
        return out

    with ThreadPoolExecutor(len(jobs)) as ex:
        results = [r for rs in ex.map(lambda job: run(*job), jobs) for r in rs]
    for prompt, stream, text in results:
        assert text == offline[prompt]["text"].rstrip("\ufffd"), (prompt, stream)
    assert len(results) == 2 * K * len(PROMPTS)
    assert _requests_total(server.url) - before == len(results)  # both servers' counts, summed


def test_a_client_leaving_either_server_aborts_its_request_and_frees_the_kv(server):
    checks = metrics(server.url).get("minisgl_integrity_checks", 0)
    body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 200}
    body |= {"stream": True, "ignore_eos": True}

    def leave(index: int) -> None:
        client = _client_of(server.url, index)
        with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # gone after the first chunk
        client.close()

    with ThreadPoolExecutor(2 * K) as ex:
        list(ex.map(leave, [i for i in range(K) for _ in range(2)]))
    m = wait_idle(server.url, checks, timeout=120)
    assert m["minisgl_kv_used_pages"] == m["minisgl_kv_cached_pages"]  # only the prefix cache holds pages
    assert m["minisgl_integrity_failures"] == 0


def test_sigterm_lets_every_servers_streams_end_with_done_and_exits_0(tmp_path):
    args = [*SERVERS, "--max-seq-len-override", "2048", "--shutdown-timeout", "2"]
    s = Service(args, tmp_path / "server.log")
    try:
        s.wait_ready()
        body = {"messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 800}
        body |= {"ignore_eos": True}  # all four fit the 4096-page pool together
        events: dict[int, list[str]] = {}
        started = threading.Barrier(2 * K + 1)

        def run(i: int, index: int) -> None:
            client = _client_of(s.url, index)
            with client.stream("POST", f"{s.url}/v1/chat/completions", json={**body, "stream": True}) as r:
                got: list[str] = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got.append(line[6:])
                        if len(got) == 1:
                            started.wait(120)
                events[i] = got

        servers = [index for index in range(K) for _ in range(2)]  # two streams in each
        threads = [threading.Thread(target=run, args=(i, index)) for i, index in enumerate(servers)]
        for t in threads:
            t.start()
        started.wait(120)  # every stream has its first chunk
        workers = s.workers()  # the other API server among them
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert s.proc.wait(60) == 0
        log = s.log_text()
        for i in range(len(servers)):  # ended as an abort, properly
            assert events[i][-1] == "[DONE]", events[i][-3:]
            last = json.loads(events[i][-2])["choices"][0]
            assert last["finish_reason"] == "abort", (len(events[i]), last, log[-6000:])
        assert "Traceback" not in log
        assert log.count("Ending 2 requests still running after 2 s") == K, log[-3000:]
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"processes left behind: {alive}"
    finally:
        s.stop()
