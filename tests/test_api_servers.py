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


def _clients(url: str, per_server: int, tries: int = 400) -> dict[int, list[httpx.Client]]:
    """Clients of one connection each, `per_server` held by every API server (a new connection goes to
    whichever server accepts it first; the server that holds it says which it is)."""
    held: dict[int, list[httpx.Client]] = {i: [] for i in range(K)}
    for _ in range(tries):
        if all(len(c) >= per_server for c in held.values()):
            return held
        client = httpx.Client(timeout=300, limits=httpx.Limits(max_connections=1))
        index = client.get(f"{url}/get_server_info").json()["api_server_index"]
        if len(held[index]) < per_server:
            held[index].append(client)
        else:
            client.close()
    raise AssertionError(f"after {tries} connections: {[len(c) for c in held.values()]} per server")


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
    held = _clients(server.url, per_server=1)
    for index, clients in held.items():
        info = clients[0].get(f"{server.url}/get_server_info").json()
        assert (info["api_server_index"], info["api_server_count"]) == (index, K)
        clients[0].close()


def test_requests_in_every_server_equal_the_offline_text_and_metrics_sum_over_servers(server, offline):  # noqa: F811
    held = _clients(server.url, per_server=len(PROMPTS) // K)
    jobs = []  # (client, prompt, stream): every prompt through both servers, streamed and not
    for clients in held.values():
        for j, client in enumerate(clients):
            for p in PROMPTS[j :: len(clients)]:
                jobs += [(client, p, True), (client, p, False)]
    before = _requests_total(server.url)

    def run(job) -> str:
        client, prompt, stream = job
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS, "temperature": 0}
        if stream:
            return _text(_stream(client, server.url, body))
        r = client.post(f"{server.url}/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    # one thread per client: a client's requests take its one connection in turn
    by_client: dict[int, list] = {}
    for job in jobs:
        by_client.setdefault(id(job[0]), []).append(job)
    with ThreadPoolExecutor(len(by_client)) as ex:
        results = list(ex.map(lambda js: [(j, run(j)) for j in js], by_client.values()))
    for job, text in (r for rs in results for r in rs):
        assert text == offline[job[1]]["text"].rstrip("\ufffd"), (job[1], job[2])
    assert _requests_total(server.url) - before == len(jobs)  # both servers' counts, summed
    for clients in held.values():
        for c in clients:
            c.close()


def test_a_client_leaving_either_server_aborts_its_request_and_frees_the_kv(server):
    checks = metrics(server.url).get("minisgl_integrity_checks", 0)
    held = _clients(server.url, per_server=2)
    body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 200}
    body |= {"stream": True, "ignore_eos": True}

    def leave(client: httpx.Client) -> None:
        with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # gone after the first chunk
        client.close()

    with ThreadPoolExecutor(2 * K) as ex:
        list(ex.map(leave, [c for cs in held.values() for c in cs]))
    m = wait_idle(server.url, checks, timeout=120)
    assert m["minisgl_kv_used_pages"] == m["minisgl_kv_cached_pages"]  # only the prefix cache holds pages
    assert m["minisgl_integrity_failures"] == 0


def test_sigterm_lets_every_servers_streams_end_with_done_and_exits_0(tmp_path):
    args = [*SERVERS, "--max-seq-len-override", "2048", "--shutdown-timeout", "2"]
    s = Service(args, tmp_path / "server.log")
    try:
        s.wait_ready()
        held = _clients(s.url, per_server=2)
        body = {"messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 800}
        body |= {"ignore_eos": True}  # all four fit the 4096-page pool together
        events: dict[int, list[str]] = {}
        started = threading.Barrier(2 * K + 1)

        def run(i: int, client: httpx.Client) -> None:
            with client.stream("POST", f"{s.url}/v1/chat/completions", json={**body, "stream": True}) as r:
                got: list[str] = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got.append(line[6:])
                        if len(got) == 1:
                            started.wait(120)
                events[i] = got

        clients = [c for cs in held.values() for c in cs]
        threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        started.wait(120)  # every stream has its first chunk
        workers = s.workers()  # the other API server among them
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert s.proc.wait(60) == 0
        log = s.log_text()
        for i in range(len(clients)):  # ended as an abort, properly
            assert events[i][-1] == "[DONE]", events[i][-3:]
            last = json.loads(events[i][-2])["choices"][0]
            assert last["finish_reason"] == "abort", (len(events[i]), last, log[-6000:])
        assert "Traceback" not in log
        assert log.count("Ending 2 requests still running after 2 s") == K, log[-3000:]
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"processes left behind: {alive}"
    finally:
        s.stop()
