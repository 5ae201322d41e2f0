"""A replica as SGLang's router sees it: the probes it calls (server and model info, load, the readiness
generation), the request id header it passes on, and the metrics gateways scrape, on one real service of a
tiny model."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from helpers import TINY_SPECS, build_tiny_model, make_llm, serving, tiny_llm_kwargs
from test_server_lifecycle import _tiny_model_with_a_real_tokenizer

from minisgl.core import SamplingParams

CONTEXT = 256
PAGES = 2048
ARGS = ["--dtype", "float32", "--num-pages", str(PAGES), "--max-seq-len-override", str(CONTEXT)]
ARGS += ["--max-running-req", "4", "--served-model-name", "tiny"]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    model = _tiny_model_with_a_real_tokenizer(str(tmp_path_factory.mktemp("tiny")))
    with serving(["--model", model, *ARGS], tmp_path_factory.mktemp("worker") / "server.log") as s:
        s.model = model  # type: ignore[attr-defined]
        yield s


def get(service, path: str) -> httpx.Response:
    return httpx.get(f"{service.url}{path}", timeout=120)


def test_server_and_model_info(service):
    for path in ("/get_server_info", "/server_info"):
        info = get(service, path).json()
        assert info["model_path"] == service.model and info["served_model_name"] == "tiny"
        assert info["dp_size"] == 1 and info["tp_size"] == 1
        assert info["context_length"] == CONTEXT and info["max_running_requests"] == 4
    for path in ("/get_model_info", "/model_info"):
        info = get(service, path).json()
        assert info["model_path"] == info["tokenizer_path"] == service.model
        assert info["is_generation"] is True and info["max_context_length"] == CONTEXT


def generated(metrics_text: str) -> float:
    return float(re.search(r"^minisgl_generation_tokens_total (\S+)$", metrics_text, re.MULTILINE)[1])


def test_health_generate_runs_one_token(service):
    before = get(service, "/metrics").text
    r = get(service, "/health_generate")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert generated(get(service, "/metrics").text) == generated(before) + 1


def test_load_is_idle(service):
    (load,) = get(service, "/get_load").json()
    assert load["dp_rank"] == 0 and load["num_reqs"] == 0 and load["num_waiting_reqs"] == 0


def test_request_id_is_echoed(service):
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}
    r = httpx.post(f"{service.url}/generate", json=body, headers={"X-Request-Id": "abc-1"}, timeout=120)
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-1"
    assert "x-request-id" not in httpx.get(f"{service.url}/health", timeout=30).headers


def test_router_fields_are_accepted(service):
    """The fields SGLang's router adds to each body it forwards (it fills in its defaults) are accepted."""
    gen = {"text": "hi", "model": None, "sampling_params": {"max_new_tokens": 2}, "stream": False}
    gen |= {"return_text_in_logprobs": False, "log_metrics": True, "return_hidden_states": False}
    gen |= {"background": False, "no_logs": False, "return_bytes": False, "return_entropy": False}
    chat = {"messages": [{"role": "user", "content": "hi"}], "model": "tiny", "max_tokens": 2}
    chat |= {"logprobs": False, "stream": False, "no_stop_trim": False, "ignore_eos": False}
    chat |= {"continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True}
    chat |= {"stream_reasoning": True, "return_hidden_states": False}
    comp = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": False, "echo": False}
    comp |= {"no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True}
    for path, body in [("/generate", gen), ("/v1/chat/completions", chat), ("/v1/completions", comp)]:
        r = httpx.post(f"{service.url}{path}", json=body, timeout=120)
        assert r.status_code == 200, (path, r.text)


def gauges(service) -> dict[str, float]:
    text = get(service, "/metrics").text
    return {
        k: float(v)
        for k, v in re.findall(r"^((?:vllm|sglang|minisgl):?\w+) ([-+\d.e]+)$", text, re.MULTILINE)
    }


def test_gateway_metric_names(service):
    prompt = {"input_ids": list(range(1, 41)), "sampling_params": {"max_new_tokens": 1}}
    for _ in range(2):  # the second finds the 40-token prompt in the cache (all but its last token)
        assert httpx.post(f"{service.url}/generate", json=prompt, timeout=120).status_code == 200
    m = gauges(service)
    for ours, theirs in [
        ("minisgl_num_requests_running", ["vllm:num_requests_running", "sglang:num_running_reqs"]),
        ("minisgl_num_requests_waiting", ["vllm:num_requests_waiting", "sglang:num_queue_reqs"]),
        ("minisgl_kv_usage_ratio", ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]),
        ("minisgl_kv_usage_ratio", ["sglang:token_usage"]),
        ("minisgl_prefix_cache_hit_rate", ["sglang:cache_hit_rate", "vllm:prefix_cache_hit_rate"]),
    ]:
        for name in theirs:
            assert m[name] == m[ours], (name, m)
    assert m["sglang:max_total_num_tokens"] == PAGES  # one token per page
    assert m["sglang:num_used_tokens"] == m["minisgl_kv_used_pages"]
    assert 0 < m["sglang:cache_hit_rate"] < 1 and 0 < m["sglang:token_usage"] < 1


def cached_tokens(service, prompt: dict) -> int:
    r = httpx.post(f"{service.url}/generate", json=prompt, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["cached_tokens"]


def test_flush_cache_empties_the_prefix_cache(service):
    """The router's /flush_cache reaches this: afterwards a repeated prompt finds nothing cached."""
    prompt = {"input_ids": list(range(50, 90)), "sampling_params": {"max_new_tokens": 1}}
    cached_tokens(service, prompt)
    assert cached_tokens(service, prompt) == 39  # a hand count: all but the token that is computed
    flushes = gauges(service)["minisgl_cache_flushes"]
    for method in (httpx.post, httpx.get):  # SGLang answers both
        r = method(f"{service.url}/flush_cache", timeout=120)
        assert r.status_code == 200 and r.text.startswith("Cache flushed.")
    deadline = time.monotonic() + 60
    while (m := gauges(service))["minisgl_cache_flushes"] < flushes + 2:
        assert time.monotonic() < deadline, m  # the stats arrive after each flush
        time.sleep(0.05)
    assert m["minisgl_kv_cached_pages"] == 0 and m["minisgl_kv_used_pages"] == 0
    assert cached_tokens(service, prompt) == 0


def test_flush_cache_is_refused_while_a_request_runs(tmp_path):
    """A running request holds cached pages: the scheduler keeps the cache (SGLang's rule)."""
    model = build_tiny_model(TINY_SPECS["llama"], str(tmp_path))
    with make_llm(model, **tiny_llm_kwargs()) as llm:
        llm.generate([list(range(1, 30))], SamplingParams(max_tokens=2))
        cached = llm.stats()["kv_cached_pages"]
        assert cached > 0
        llm.add_request(7, list(range(40, 60)), SamplingParams(max_tokens=4))
        assert llm.scheduler.flush_cache() is None and llm.stats()["kv_cached_pages"] >= cached
        while llm.scheduler.has_work:
            llm.step()
        assert llm.scheduler.flush_cache() > 0 and llm.stats()["kv_cached_pages"] == 0
