"""The service's processes: N tokenizers + 1 detokenizer, SIGTERM stops every process, bad arguments and a
bad model fail fast with a clear message, and the offline path never imports the service's dependencies."""

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


def test_separate_tokenizers_and_detokenizer_serve_correctly_and_sigterm_stops_every_process(tmp_path):
    service = Service(
        [
            "--dtype",
            "float32",
            "--num-pages",
            "2048",
            "--max-seq-len-override",
            "512",
            "--num-tokenizer",
            "2",
        ],
        tmp_path / "server.log",
    )
    try:
        service.wait_ready()
        assert (
            "Started 4 worker processes" in service.log_text()
        )  # 1 scheduler + 2 tokenizers + 1 detokenizer
        workers = service.workers()
        client = openai.OpenAI(base_url=f"{service.url}/v1", api_key="none", timeout=120, max_retries=0)

        alone = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=12, temperature=0)
        assert "Paris" in alone.choices[0].message.content
        with ThreadPoolExecutor(8) as ex:  # spread over both tokenizers
            answers = list(
                ex.map(
                    lambda _: (
                        client.chat.completions.create(
                            model="m", messages=QUESTION, max_tokens=12, temperature=0
                        )
                        .choices[0]
                        .message.content
                    ),
                    range(8),
                )
            )
        assert answers == [alone.choices[0].message.content] * 8

        # a stop string is found by the detokenizer process, which tells the scheduler to stop
        text = alone.choices[0].message.content
        cut = client.chat.completions.create(
            model="m", messages=QUESTION, max_tokens=12, temperature=0, stop=["France"]
        )
        assert cut.choices[0].message.content == text[: text.index("France")]
        # a disconnect: the abort travels through a tokenizer to the scheduler
        before = metrics(service.url)
        with httpx.stream(
            "POST",
            f"{service.url}/v1/completions",
            timeout=60,
            json={"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True},
        ) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 4:
                    break
        after = wait_idle(service.url, before["minisgl_integrity_checks"])
        # (the stop-string request above may be counted here too: its abort can land after `before`)
        assert after["minisgl_aborted_requests"] >= before["minisgl_aborted_requests"] + 1
        assert "Aborting request" in service.log_text()
        assert after["minisgl_kv_used_pages"] == after["minisgl_kv_cached_pages"]

        t0 = time.monotonic()
        service.proc.send_signal(signal.SIGTERM)
        assert service.proc.wait(20) in (0, 143)
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"processes left behind: {alive}"
        assert time.monotonic() - t0 < 15
        assert "All processes stopped" in service.log_text()
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
