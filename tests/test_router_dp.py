"""`python -m minisgl --dp 2`: two replicas of a tiny model behind SGLang's real router on loopback (one
service for the module). Greedy outputs through the router equal the offline LLM's; a shared-prefix
workload is computed on one replica only; streaming, `n` and abort-on-disconnect pass through the router; a
replica killed with SIGKILL is taken out and requests keep succeeding; SIGTERM stops everything."""

from __future__ import annotations

import json
import re
import signal
import time

import httpx
import psutil
import pytest
import torch
from helpers import make_llm, metrics, random_prompt, serving
from test_server_lifecycle import _tiny_model_with_a_real_tokenizer

pytest.importorskip("sglang_router")

CONTEXT = 256
ARGS = ["--dtype", "float32", "--num-pages", "2048", "--max-seq-len-override", str(CONTEXT)]
ARGS += ["--served-model-name", "tiny"]
PROMPTS = [random_prompt(5 + 7 * i, 49152, seed=i) for i in range(4)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return _tiny_model_with_a_real_tokenizer(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def dp(model, tmp_path_factory):
    with serving(["--model", model, "--dp", "2", *ARGS], tmp_path_factory.mktemp("dp") / "dp.log") as s:
        s.replicas = [f"http://127.0.0.1:{s.port + 1 + i}" for i in range(2)]  # type: ignore[attr-defined]
        # the router answers before the launcher has seen it ready and logged so: wait for that line
        deadline = time.monotonic() + 120
        while "through the router" not in s.log_text() and time.monotonic() < deadline:
            assert s.proc.poll() is None, s.log_text()[-3000:]
            time.sleep(0.3)
        yield s


@pytest.fixture(scope="module")
def offline(model) -> list[dict]:
    """The independent path: the offline LLM in this process, greedy."""
    from minisgl.core import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    kwargs = {"dtype": torch.float32, "num_page_override": 2048, "max_seq_len_override": CONTEXT}
    with make_llm(model, show_progress=False, **kwargs) as llm:
        return llm.generate(PROMPTS, [params] * len(PROMPTS))


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def generate_ids(url: str, prompt: list[int]) -> list[int]:
    sp = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = post(url, "/generate", {"input_ids": prompt, "sampling_params": sp})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_startup_logs_both_replicas_and_the_router(dp):
    log = dp.log_text()
    assert "Started replica-0" in log and "Started replica-1" in log
    assert "policy cache_aware" in log and "through the router" in log
    workers = httpx.get(f"{dp.url}/workers", timeout=30).json()["workers"]
    assert sorted(w["url"] for w in workers) == dp.replicas


def test_greedy_through_the_router_equals_the_offline_llm(dp, offline):
    expected = [r["token_ids"] for r in offline]
    assert [generate_ids(dp.url, p) for p in PROMPTS] == expected
    for replica in dp.replicas:  # each replica alone is a normal server
        assert generate_ids(replica, PROMPTS[0]) == expected[0]


def prompt_tokens(url: str) -> tuple[float, float]:
    m = metrics(url)
    return m.get("minisgl_scheduler_prompt_tokens", 0.0), m.get("minisgl_cached_prompt_tokens", 0.0)


def test_a_shared_prefix_is_computed_on_one_replica_only(dp):
    before = [prompt_tokens(r) for r in dp.replicas]
    prefix = "You are a careful assistant. Answer in one short sentence, and name your source. " * 3
    usages = []
    for i in range(6):
        body = {"text": f"{prefix}Question {i}: what is {i} + {i}?", "sampling_params": {"max_new_tokens": 2}}
        r = post(dp.url, "/generate", body)
        assert r.status_code == 200, r.text
        usages.append(r.json()["meta_info"])
    total = sum(u["prompt_tokens"] for u in usages)
    # every request after the first found the prefix cached: they all went to the same replica
    assert all(u["cached_tokens"] >= usages[0]["prompt_tokens"] - 12 for u in usages[1:]), usages
    deadline = time.monotonic() + 60
    while True:  # each scheduler reports its counters when it goes idle
        deltas = [prompt_tokens(r)[0] - b[0] for r, b in zip(dp.replicas, before)]
        if sum(deltas) >= total or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert sorted(deltas) == [0, total], deltas


def test_streaming_and_n_through_the_router(dp):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2}
    with httpx.stream(
        "POST", f"{dp.url}/v1/chat/completions", json=dict(body, stream=True), timeout=120
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    finished = {c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]}
    assert finished == {0, 1}
    comp = post(dp.url, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3, "n": 3}).json()
    assert sorted(c["index"] for c in comp["choices"]) == [0, 1, 2]
    assert comp["usage"]["completion_tokens"] == 9


def test_a_client_that_disconnects_is_aborted_on_its_replica(dp):
    aborted = lambda: len(re.findall(r"Aborting request \d+", dp.log_text()))
    before = aborted()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": CONTEXT - 8, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{dp.url}/v1/completions", json=body, timeout=120) as r:
        next(r.iter_lines())  # the stream is open: the replica is generating; then hang up
    deadline = time.monotonic() + 60
    while aborted() == before and time.monotonic() < deadline:
        time.sleep(0.3)
    assert aborted() > before


def test_flush_cache_through_the_router_reaches_every_replica(dp):
    flushes = lambda: [metrics(r).get("minisgl_cache_flushes", 0.0) for r in dp.replicas]
    before = flushes()
    r = httpx.post(f"{dp.url}/flush_cache", timeout=120)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    while any(a <= b for a, b in zip(flushes(), before)) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert all(a == b + 1 for a, b in zip(flushes(), before)), (before, flushes())
    assert [metrics(r)["minisgl_kv_cached_pages"] for r in dp.replicas] == [0, 0]


def test_a_killed_replica_is_taken_out_and_sigterm_stops_everything(dp):
    launcher = psutil.Process(dp.proc.pid)
    everyone = launcher.children(recursive=True)
    victim = next(p for p in launcher.children() if f"{dp.port + 1}" in p.cmdline())
    victim.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the launcher sees it die and removes it from the router
        workers = httpx.get(f"{dp.url}/workers", timeout=30).json()["workers"]
        if [w["url"] for w in workers] == [dp.replicas[1]]:
            break
        time.sleep(0.3)
    assert [w["url"] for w in workers] == [dp.replicas[1]]
    for p in PROMPTS:
        assert len(generate_ids(dp.url, p)) == MAX_TOKENS
    assert dp.proc.poll() is None
    dp.proc.send_signal(signal.SIGTERM)
    assert dp.proc.wait(60) == 0
    psutil.wait_procs(everyone, timeout=30)
    assert [p.pid for p in everyone if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []


def test_a_replica_gets_the_options_given_but_its_own_port_and_the_resolved_model(model):
    from minisgl.service.args import parse_args
    from minisgl.service.dp import replica_argv

    argv = ["--model", model, "--dp", "2", "--port", "3000", "--host", "0.0.0.0", "--page-size", "4"]
    argv += ["--overlap", "off", "--no-shell", "--router-args", "--policy round_robin", "--api-key", "k"]
    args = parse_args(argv)
    cmd = replica_argv(argv, args, 3002)
    assert cmd[1:3] == ["-m", "minisgl"]
    replica = parse_args(cmd[3:])
    assert (replica.dp_size, replica.port, replica.host, replica.router_args) == (1, 3002, "127.0.0.1", "")
    assert (replica.page_size, replica.api_key, replica.model_path) == (4, "k", model)
    assert replica.overlap is False and replica.served_model_name == args.served_model_name


def test_a_port_that_echoes_the_request_is_not_ready_and_one_that_answers_is():
    """While a replica starts, a health check can connect to itself (the kernel may hand it the replica's
    port as its source) and read its own request back: that is "not ready", never a crash."""
    import http.server
    import socket
    import threading

    from minisgl.service.dp import _answers

    with socket.create_server(("127.0.0.1", 0)) as echo:

        def serve() -> None:
            conn, _ = echo.accept()
            with conn:
                conn.sendall(conn.recv(4096))  # the request, read back as its answer

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        assert _answers(f"http://127.0.0.1:{echo.getsockname()[1]}/health") is False
        t.join(5)

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    with http.server.HTTPServer(("127.0.0.1", 0), Ok) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert _answers(url + "/health") is True and _answers(url + "/other") is False
        server.shutdown()


@pytest.mark.gpu
def test_dp_on_a_gpu_host_gives_each_replica_its_own_gpu(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    with serving(["--dp", "2"], tmp_path / "dp.log") as s:
        log = s.log_text()
        assert "replica-0" in log and "CUDA_VISIBLE_DEVICES=0" in log and "CUDA_VISIBLE_DEVICES=1" in log
        body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4}}
        assert post(s.url, "/generate", body).status_code == 200


def test_an_api_key_is_checked_by_the_router_and_by_each_replica(model, tmp_path):
    """--api-key with --dp: a client needs the key at the router; the router passes it on to the replicas,
    which want it too."""
    from openai import AuthenticationError, OpenAI

    argv = ["--model", model, "--dp", "2", "--api-key", "sk-dp", *ARGS]
    with serving(argv, tmp_path / "dp.log", ready_path="/health") as s:
        replicas = [f"http://127.0.0.1:{s.port + 1 + i}" for i in range(2)]
        deadline = time.monotonic() + 120
        while "through the router" not in s.log_text() and time.monotonic() < deadline:
            assert s.proc.poll() is None, s.log_text()[-3000:]
            time.sleep(0.3)
        good = OpenAI(base_url=f"{s.url}/v1", api_key="sk-dp")
        for _ in range(4):  # both replicas get some of them
            out = good.completions.create(model="tiny", prompt="hi", max_tokens=2)
            assert out.usage.completion_tokens == 2
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"{s.url}/v1", api_key="wrong").completions.create(
                model="tiny", prompt="hi", max_tokens=2
            )
        for url in replicas:
            assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=30).status_code == 401
