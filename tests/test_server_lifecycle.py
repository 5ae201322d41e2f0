"""The service's processes: TP=2 and N tokenizers + 1 detokenizer, SIGTERM stops every process, bad
arguments and a bad model fail fast with a clear message, and the offline path never imports the service's
dependencies."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from helpers import Service, free_port, make_llm, metrics, serving, wait_idle

openai = pytest.importorskip("openai")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _tiny_model_with_a_real_tokenizer(out_dir: str) -> str:
    """A seeded random Llama small enough to start fast, with 4 heads (TP=2 divides them) and the default
    model's tokenizer (so the service can tokenize, apply the chat template and detokenize)."""
    import os
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from minisgl.models.resolve import resolve_model_path

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.15,
        rms_norm_eps=1e-6,
        architectures=["LlamaForCausalLM"],
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    src = resolve_model_path(None)
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(src, name), out_dir)
    return out_dir


# ---- one TP=2 service with 2 tokenizers + 1 detokenizer, shared by the tests below ---------------------
# rank 0 forwards every message to rank 1; the launcher runs 1 + 5 processes
PROMPTS = [[5 + i, 7 + 2 * i, 11, 13 + i] for i in range(12)]
MAX_TOKENS = [10 + i for i in range(12)]
CONTEXT = 256


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return _tiny_model_with_a_real_tokenizer(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def offline(model) -> list[dict]:
    """The independent path: TP=1 in this process, no messages, greedy."""
    import torch

    from minisgl.core import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    with make_llm(
        model,
        dtype=torch.float32,
        num_page_override=4096,
        max_seq_len_override=CONTEXT,
        show_progress=False,
    ) as llm:
        return llm.generate(PROMPTS, params)


@pytest.fixture(scope="module")
def tp2(model, tmp_path_factory) -> Iterator[Service]:
    args = ["--model", model, "--tp", "2", "--num-tokenizer", "2", "--dtype", "float32"]
    args += ["--num-pages", "4096", "--max-seq-len-override", str(CONTEXT)]
    with serving(args, tmp_path_factory.mktemp("tp2") / "server.log") as service:
        yield service


def _generate(service: Service, i: int) -> dict:
    body = {
        "input_ids": PROMPTS[i],
        "sampling_params": {"max_new_tokens": MAX_TOKENS[i], "temperature": 0, "ignore_eos": True},
    }
    return httpx.post(f"{service.url}/generate", timeout=120, json=body).json()


def test_tp2_with_two_tokenizers_starts_two_schedulers_two_tokenizers_and_a_detokenizer(tp2):
    assert "Started 5 worker processes" in tp2.log_text()
    for name in ("scheduler-0", "scheduler-1", "tokenizer-0", "tokenizer-1", "detokenizer"):
        assert f"{name} is ready" in tp2.log_text(), name


def test_tp2_concurrent_requests_equal_the_offline_tp1_tokens_and_text(tp2, offline):
    with ThreadPoolExecutor(len(PROMPTS)) as ex:  # batched, and spread over both tokenizers
        outs = list(ex.map(lambda i: _generate(tp2, i), range(len(PROMPTS))))
    assert [o["output_ids"] for o in outs] == [r["token_ids"] for r in offline]
    assert [o["text"] for o in outs] == [r["text"] for r in offline]


def test_tp2_a_stop_string_found_by_the_detokenizer_cuts_the_completion(tp2, offline):
    """The detokenizer process finds the stop string and tells the scheduler to stop."""
    text = offline[11]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    body = {"prompt": PROMPTS[11], "max_tokens": 21, "temperature": 0, "ignore_eos": True, "stop": stop}
    cut = httpx.post(f"{tp2.url}/v1/completions", timeout=120, json=body).json()
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_tp2_a_chat_is_templated_by_a_tokenizer_worker_and_generates_max_tokens(tp2, model):
    from minisgl.utils.hf import load_tokenizer

    body = {"messages": QUESTION, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    chat = httpx.post(f"{tp2.url}/v1/chat/completions", timeout=120, json=body).json()
    assert chat["usage"]["completion_tokens"] == 5
    tokenizer = load_tokenizer(model)
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert chat["usage"]["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))


def test_tp2_a_client_disconnect_aborts_on_both_ranks_and_frees_the_kv(tp2):
    """The abort travels through a tokenizer to rank 0, which forwards it to rank 1."""
    before = metrics(tp2.url)
    body = {
        "input_ids": [5, 6, 7],
        "stream": True,
        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
    }
    with httpx.stream("POST", f"{tp2.url}/generate", timeout=60, json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                break
    after = wait_idle(tp2.url, before["minisgl_integrity_checks"])
    # (an earlier stop-string request may be counted here too: its abort can land after `before`)
    assert after["minisgl_aborted_requests"] >= before["minisgl_aborted_requests"] + 1
    assert "Aborting request" in tp2.log_text()
    assert after["minisgl_kv_used_pages"] == after["minisgl_kv_cached_pages"]
    assert after["minisgl_integrity_failures"] == 0


def test_tp2_sigterm_stops_every_process_within_seconds_quietly_and_removes_its_sockets(tp2):
    """Runs last of the TP=2 tests: it stops the shared service."""
    workers = tp2.workers()
    assert tp2.socket_dirs(), "the launcher's socket directory is where this test looks for it"
    t0 = time.monotonic()
    tp2.proc.send_signal(signal.SIGTERM)
    assert tp2.proc.wait(20) in (0, 143)
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"processes left behind: {alive}"
    assert time.monotonic() - t0 < 15
    assert "All processes stopped" in tp2.log_text()
    time.sleep(1)  # multiprocessing's resource tracker reports when the launcher has exited
    assert "leaked" not in tp2.log_text()  # the workers unwound (e.g. tqdm's lock was released)
    assert "did not stop" not in tp2.log_text()  # ... on the SIGTERM, none needed a SIGKILL
    assert tp2.socket_dirs() == []  # the launcher removed its ZMQ sockets and their directory


# ---- the command line ---------------------------------------------------------------------------------
def _run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minisgl", *args], check=False, capture_output=True, text=True, timeout=timeout
    )


def test_a_model_path_that_does_not_exist_fails_fast_with_a_clear_message(tmp_path):
    # a free port: the port is checked first, and a privileged one would fail there for a non-root user
    r = _run_cli("--model", str(tmp_path / "no-such-model"), "--port", str(free_port()))
    assert r.returncode == 2
    assert re.search(r"does not exist", r.stderr), r.stderr
    assert "Started" not in r.stderr  # no worker was spawned


@pytest.mark.parametrize(
    "args,message",
    [
        (["--port", "0"], "--port"),
        (["--tp", "0"], "--tp"),
        (["--num-tokenizer", "-1"], "--num-tokenizer"),
        (["--page-size", "0"], "--page-size"),
        (["--dtype", "float8"], "--dtype"),
    ],
)
def test_bad_command_line_arguments_are_refused_by_name(args, message):
    r = _run_cli(*args, timeout=60)
    assert r.returncode != 0 and message in r.stderr, r.stderr


def test_help_lists_the_documented_options():
    out = _run_cli("--help", timeout=60).stdout
    for option in (
        "--model",
        "--port",
        "--host",
        "--dtype",
        "--tp",
        "--attn",
        "--cache",
        "--page-size",
        "--max-prefill-length",
        "--num-pages",
        "--max-seq-len-override",
        "--max-running-requests",
        "--num-tokenizer",
        "--cuda-graph-max-bs",
        "--cuda-graph-max-prefill",
        "--load-format",
        "--shell",
    ):
        assert option in out, option


def test_the_offline_path_never_imports_the_service_dependencies():
    code = (
        "import sys; import minisgl.llm, minisgl.engine, minisgl.scheduler, minisgl.scheduler.scheduler; "
        "print([m for m in ('zmq', 'fastapi', 'uvicorn', 'prometheus_client', 'starlette', 'prompt_toolkit') "
        "if m in sys.modules])"
    )
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


_BLOCKED_IN_GET = """
import shutil, signal, sys, tempfile, threading
from minisgl.service.zmq_queue import ZmqPullQueue
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as the service's workers do
ipc_dir = tempfile.mkdtemp(prefix="minisgl-test-")
queue = ZmqPullQueue(f"ipc://{ipc_dir}/q", create=True, decoder=bytes)
# the SIGTERM lands on another thread (as it may on ZMQ's or a tokenizer pool's): the main thread's wait
# is not interrupted, and only returning to Python runs the handler
threading.Timer(0.3, lambda: signal.pthread_kill(threading.get_ident(), signal.SIGTERM)).start()
try:
    queue.get()
finally:
    shutil.rmtree(ipc_dir)
"""


def test_a_worker_waiting_for_messages_acts_on_a_sigterm_taken_by_another_thread():
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", _BLOCKED_IN_GET], check=False, capture_output=True, timeout=15)
    assert r.returncode == 143, r.stderr
    assert time.monotonic() - t0 < 10  # within a second of the signal, plus the interpreter's start
