"""Startup checks come before any model work (a busy port, an unknown registry name, an unsupported
architecture fail in seconds, naming the problem and the fix), and a stop asked for by SIGTERM or a
terminal's Ctrl-C is quiet: a log line, every process gone, exit status 0, no traceback, no leaked
semaphore reported."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest
from helpers import free_port, wait_answering

SERVER_ARGS = ["--dtype", "float32", "--num-pages", "4096", "--max-seq-len-override", "256"]
MODEL_WORK = ("Started", "Loading", "Serving", "Converting", "Engine ready")  # log lines of model work


def _new_session_with_ctrl_c() -> None:
    """Child set-up: its own process group (a terminal's Ctrl-C goes to a group), with SIGINT acted on
    even when the tests themselves run as a background job (which ignores SIGINT, and a child inherits
    that)."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Launched:
    """`python -m minisgl` (the default model) in its own process group, stdout and stderr in one file;
    unlike helpers.Service it acts on SIGINT even when the tests run as a background job."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        # the launcher's socket directory goes here, removed whatever the test did
        self.tmp_dir = tempfile.mkdtemp(prefix="minisgl-service-")
        env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=self.tmp_dir)
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "minisgl", "--port", str(self.port), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_new_session_with_ctrl_c,  # noqa: PLW1509 - no threads run here yet
            )

    def wait_ready(self, timeout: float = 300) -> None:
        wait_answering(f"{self.url}/v1/models", lambda: self.proc.poll() is None, self.output, timeout)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop_by(self, send: Callable[[int], None]) -> tuple[int, str]:
        """Send the stop (a callable of the launcher's pid); return the exit status and the whole output
        once every process of the tree (workers, multiprocessing's resource tracker) is gone."""
        tree = psutil.Process(self.proc.pid).children(recursive=True)
        assert len(tree) >= 2, tree  # the scheduler and the tokenizer worker at least
        send(self.proc.pid)
        code = self.proc.wait(30)
        # the resource tracker reports leaked semaphores when the last process holding it has exited
        _, alive = psutil.wait_procs(tree, timeout=15)
        assert not alive, f"processes left behind: {alive}"
        return code, self.output()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)


def _assert_quiet_stop(code: int, out: str, signame: str) -> None:
    assert code == 0, out[-3000:]
    assert f"{signame} received; stopping the service" in out, out[-3000:]
    assert "All processes stopped" in out
    assert "Traceback" not in out, out[-3000:]
    assert "leaked semaphore" not in out, out[-3000:]
    assert "did not stop" not in out  # every worker unwound on the launcher's SIGTERM, none was killed


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    s = Launched(SERVER_ARGS, tmp_path_factory.mktemp("service") / "server.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.kill()


def _run_cli(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "minisgl", *args], check=False, capture_output=True, text=True, timeout=timeout
    )
    return r, time.monotonic() - t0


def test_a_second_server_on_the_port_of_a_running_one_fails_at_once_naming_the_port(service):
    r, seconds = _run_cli("--port", str(service.port), *SERVER_ARGS)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert f"127.0.0.1:{service.port}" in out and "--port" in out, out
    assert not [line for line in MODEL_WORK if line in out], out  # no worker started, no model touched
    assert "Traceback" not in out, out
    assert seconds < 20, seconds  # the interpreter's and torch's imports only (loading takes longer)
    assert httpx.get(f"{service.url}/v1/models", timeout=10).status_code == 200  # the first one still serves


def test_sigterm_stops_every_process_quietly_with_status_0(service):
    code, out = service.stop_by(lambda pid: os.kill(pid, signal.SIGTERM))
    _assert_quiet_stop(code, out, "SIGTERM")


def test_ctrl_c_to_the_process_group_stops_every_process_quietly_with_status_0(tmp_path):
    s = Launched(SERVER_ARGS, tmp_path / "server.log")
    try:
        s.wait_ready()
        code, out = s.stop_by(lambda pid: os.killpg(pid, signal.SIGINT))  # as a terminal's Ctrl-C
        _assert_quiet_stop(code, out, "SIGINT")
    finally:
        s.kill()


def test_ctrl_c_while_the_workers_load_stops_every_process_quietly(tmp_path):
    s = Launched(SERVER_ARGS, tmp_path / "server.log")
    try:
        deadline = time.monotonic() + 120
        while "Started 2 worker processes" not in s.output():  # the workers now import torch and load
            assert time.monotonic() < deadline and s.proc.poll() is None, s.output()
            time.sleep(0.1)
        code, out = s.stop_by(lambda pid: os.killpg(pid, signal.SIGINT))
        assert "Serving" not in out  # it was stopped during the start, not after
        _assert_quiet_stop(code, out, "SIGINT")
    finally:
        s.kill()


@pytest.mark.parametrize(
    "args,flag,names",
    [
        (["--attn", "flash"], "--attn", ["auto", "cpu", "torch"]),
        (["--attn", "torch,flash"], "--attn", ["auto", "cpu", "torch"]),
        (["--cache-type", "lru"], "--cache-type", ["naive", "radix"]),
        (["--cache", "lru"], "--cache", ["naive", "radix"]),
    ],
)
def test_an_unknown_backend_name_fails_before_any_model_work_naming_the_known_ones(args, flag, names):
    r, _ = _run_cli("--port", str(free_port()), *args, timeout=60)
    assert r.returncode == 2, r.stderr
    error = r.stderr.strip().splitlines()[-1]  # argparse's style: usage, then one line naming the flag
    assert flag in error and all(n in error for n in names), error
    assert not [line for line in MODEL_WORK if line in r.stderr], r.stderr
    assert "Traceback" not in r.stderr


def test_an_unsupported_architecture_fails_before_a_worker_starts(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    r, _ = _run_cli("--model", str(model), "--port", str(free_port()), timeout=60)
    assert r.returncode == 2, r.stderr
    assert "GPTNeoXForCausalLM" in r.stderr and "LlamaForCausalLM" in r.stderr, r.stderr
    assert not [line for line in MODEL_WORK if line in r.stderr], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("kwargs,names", [({"attn": "flash"}, "torch"), ({"cache_type": "lru"}, "radix")])
def test_the_offline_llm_refuses_an_unknown_backend_name_before_loading(kwargs, names):
    from minisgl.llm import LLM

    t0 = time.monotonic()
    with pytest.raises(ValueError, match=names):
        LLM(show_progress=False, **kwargs)
    assert time.monotonic() - t0 < 5  # refused by the options, no model was built


def test_a_free_port_lies_below_the_ephemeral_range_with_its_span_free():
    """Ports handed to servers that clients poll before they bind: never one the kernel could give a client
    as its source port (checked against the kernel's own range), and all `span` of them bindable."""
    import socket

    from minisgl.utils.net import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = free_port(3)
        assert 10000 <= port and port + 3 <= low
        for p in range(port, port + 3):
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))
