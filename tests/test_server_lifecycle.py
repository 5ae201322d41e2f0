"""The service's processes: TP=2 and N tokenizers + 1 detokenizer, SIGTERM stops every process, bad
arguments and a bad model fail fast with a clear message, and the offline path never imports the service's
dependencies."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from test_server import Service, metrics, wait_idle

openai = pytest.importorskip("openai")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _tiny_model_with_a_real_tokenizer(out_dir: str) -> str:
    """A seeded random Llama small enough to start fast, with 4 heads (TP=2 divides them) and the default
    model's tokenizer (so the service can tokenize, apply the chat template and detokenize)."""
    import os
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from minisgl.utils.hf import resolve_model_path

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


def test_tp2_with_separate_tokenizers_equals_the_offline_path_and_sigterm_stops_every_process(tmp_path):
    """TP=2 (rank 0 forwards every message to rank 1) with 2 tokenizers + 1 detokenizer: 1 + 5 processes."""
    import torch

    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    model = _tiny_model_with_a_real_tokenizer(str(tmp_path / "tiny"))
    service = Service(
        [
            "--model",
            model,
            "--tp",
            "2",
            "--num-tokenizer",
            "2",
            "--dtype",
            "float32",
            "--num-pages",
            "4096",
            "--max-seq-len-override",
            "256",
        ],
        tmp_path / "server.log",
    )
    try:
        prompts = [[5 + i, 7 + 2 * i, 11, 13 + i] for i in range(12)]
        params = [SamplingParams(temperature=0.0, max_tokens=10 + i, ignore_eos=True) for i in range(12)]
        llm = LLM(
            model_path=model,
            dtype=torch.float32,
            num_page_override=4096,
            max_seq_len_override=256,
            show_progress=False,
        )
        ref = llm.generate(prompts, params)  # TP=1, one process, no messages: the independent path
        llm.shutdown()

        service.wait_ready()
        assert "Started 5 worker processes" in service.log_text()  # 2 schedulers, 2 tokenizers, 1 detokenizer
        workers = service.workers()

        def generate(i: int) -> dict:
            return httpx.post(
                f"{service.url}/generate",
                timeout=120,
                json={
                    "input_ids": prompts[i],
                    "sampling_params": {"max_new_tokens": 10 + i, "temperature": 0, "ignore_eos": True},
                },
            ).json()

        with ThreadPoolExecutor(12) as ex:  # batched, and spread over both tokenizers
            outs = list(ex.map(generate, range(12)))
        assert [o["output_ids"] for o in outs] == [r["token_ids"] for r in ref]
        assert [o["text"] for o in outs] == [r["text"] for r in ref]

        # a stop string is found by the detokenizer process, which tells the scheduler to stop
        text = ref[11]["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        cut = httpx.post(
            f"{service.url}/v1/completions",
            timeout=120,
            json={
                "prompt": prompts[11],
                "max_tokens": 21,
                "temperature": 0,
                "ignore_eos": True,
                "stop": stop,
            },
        ).json()
        assert cut["choices"][0]["text"] == text[: text.index(stop)]
        assert cut["choices"][0]["finish_reason"] == "stop"
        chat = httpx.post(
            f"{service.url}/v1/chat/completions",
            timeout=120,
            json={"messages": QUESTION, "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        ).json()
        assert chat["usage"]["completion_tokens"] == 5

        # a disconnect: the abort travels through a tokenizer to rank 0, which forwards it to rank 1
        before = metrics(service.url)
        with httpx.stream(
            "POST",
            f"{service.url}/generate",
            timeout=60,
            json={
                "input_ids": [5, 6, 7],
                "stream": True,
                "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
            },
        ) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 4:
                    break
        after = wait_idle(service.url, before["minisgl_integrity_checks"])
        # (the stop-string request above may be counted here too: its abort can land after `before`)
        assert after["minisgl_aborted_requests"] >= before["minisgl_aborted_requests"] + 1
        assert "Aborting request" in service.log_text()
        assert after["minisgl_kv_used_pages"] == after["minisgl_kv_cached_pages"]
        assert after["minisgl_integrity_failures"] == 0

        t0 = time.monotonic()
        service.proc.send_signal(signal.SIGTERM)
        assert service.proc.wait(20) in (0, 143)
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"processes left behind: {alive}"
        assert time.monotonic() - t0 < 15
        assert "All processes stopped" in service.log_text()
        time.sleep(1)  # multiprocessing's resource tracker reports when the launcher has exited
        assert "leaked" not in service.log_text()  # the workers unwound (e.g. tqdm's lock was released)
        assert "did not stop" not in service.log_text()  # ... on the SIGTERM, none needed a SIGKILL
    finally:
        service.stop()


def _run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minisgl", *args], check=False, capture_output=True, text=True, timeout=timeout
    )


def test_a_model_path_that_does_not_exist_fails_fast_with_a_clear_message(tmp_path):
    r = _run_cli("--model", str(tmp_path / "no-such-model"), "--port", "1")
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
import signal, sys, tempfile, threading
from minisgl.service.zmq_queue import ZmqPullQueue
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as the service's workers do
queue = ZmqPullQueue(f"ipc://{tempfile.mkdtemp()}/q", create=True, decoder=bytes)
# the SIGTERM lands on another thread (as it may on ZMQ's or a tokenizer pool's): the main thread's wait
# is not interrupted, and only returning to Python runs the handler
threading.Timer(0.3, lambda: signal.pthread_kill(threading.get_ident(), signal.SIGTERM)).start()
queue.get()
"""


def test_a_worker_waiting_for_messages_acts_on_a_sigterm_taken_by_another_thread():
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", _BLOCKED_IN_GET], check=False, capture_output=True, timeout=15)
    assert r.returncode == 143, r.stderr
    assert time.monotonic() - t0 < 10  # within a second of the signal, plus the interpreter's start
