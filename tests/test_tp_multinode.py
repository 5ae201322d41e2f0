"""The service over several nodes and the failures of its ranks, with real processes over gloo on
loopback: two launches of one rank each (`--nnodes 2`) give the tokens of TP=2 in one process, and node 1
stops by itself when node 0 stops; a rank killed with SIGKILL brings the service down within seconds,
naming it; a second node that never starts makes node 0 fail with a clear message."""

from __future__ import annotations

import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from helpers import Service, free_port, make_llm, serving

pytest.importorskip("openai")
from test_server_lifecycle import _tiny_model_with_a_real_tokenizer

PROMPTS = [[5 + i, 7 + 2 * i, 11, 13 + i, 40 + i] for i in range(6)]
MAX_TOKENS = [6 + i for i in range(6)]
COMMON = ["--dtype", "float32", "--num-pages", "2048", "--max-seq-len-override", "256"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return _tiny_model_with_a_real_tokenizer(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def tp2_offline(model) -> list[list[int]]:
    """TP=2 in one launch (the offline API's two ranks), greedy."""
    import torch

    from minisgl.core import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    kwargs = {"dtype": torch.float32, "num_page_override": 2048, "max_seq_len_override": 256}
    with make_llm(model, tp_size=2, show_progress=False, **kwargs) as llm:
        return [o["token_ids"] for o in llm.generate(PROMPTS, params)]


def _generate(url: str, i: int) -> list[int]:
    body = {
        "input_ids": PROMPTS[i],
        "sampling_params": {"max_new_tokens": MAX_TOKENS[i], "temperature": 0, "ignore_eos": True},
    }
    return httpx.post(f"{url}/generate", timeout=120, json=body).json()["output_ids"]


def _gone(procs: list[psutil.Process], timeout: float = 30) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


def test_two_nodes_of_one_rank_each_equal_tp2_in_one_launch_and_node1_stops_with_node0(
    model, tp2_offline, tmp_path
):
    addr = f"127.0.0.1:{free_port()}"
    multi = ["--model", model, *COMMON, "--nnodes", "2", "--dist-init-addr", addr]
    # node 1 starts first (the spellings --tp-size and --tp name the same option)
    node1 = Service([*multi, "--tp-size", "2", "--node-rank", "1"], tmp_path / "node1.log")
    try:
        with serving([*multi, "--tp", "2", "--node-rank", "0"], tmp_path / "node0.log") as node0:
            with ThreadPoolExecutor(len(PROMPTS)) as ex:  # batched
                outs = list(ex.map(lambda i: _generate(node0.url, i), range(len(PROMPTS))))
            assert outs == tp2_offline
            assert "Started 2 worker processes" in node0.log_text()  # rank 0 and the tokenizer
            node1_workers = node1.workers()
            assert len(node1_workers) >= 1
        # node 0 stopped: node 1's rank hears it and its launcher exits cleanly
        assert node1.proc.wait(60) == 0, node1.log_text()[-3000:]
        assert not _gone(node1_workers)
        log = node1.log_text()
        assert "Started 1 worker processes: minisgl-scheduler-1" in log
        assert "Rank 0 stopped the service; node 1 stops too" in log
    finally:
        node1.stop()


def test_a_rank_killed_with_sigkill_brings_the_service_down_within_seconds_naming_it(model, tmp_path):
    service = Service(["--model", model, *COMMON, "--tp", "2"], tmp_path / "server.log")
    try:
        service.wait_ready()
        assert _generate(service.url, 0)  # the ranks work
        workers = service.workers()
        pid = int(re.search(r"minisgl-scheduler-1 \(pid (\d+)\)", service.log_text()).group(1))
        t0 = time.monotonic()
        psutil.Process(pid).send_signal(signal.SIGKILL)
        assert service.proc.wait(60) == 1
        assert time.monotonic() - t0 < 30  # seconds; generous for a loaded machine
        assert not _gone(workers), "a worker outlived the launcher"
        log = service.log_text()
        assert re.search(rf"minisgl-scheduler-1 \(pid {pid}\) exited with code -9", log), log[-3000:]
        assert "All processes stopped" in log
    finally:
        service.stop()


def test_a_second_node_that_never_starts_fails_node0_with_a_clear_message(model, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    args = ["--model", model, *COMMON, "--tp", "2", "--nnodes", "2", "--node-rank", "0"]
    service = Service([*args, "--dist-init-addr", addr, "--dist-timeout", "3"], tmp_path / "server.log")
    try:
        assert service.proc.wait(180) == 1
        log = service.log_text()
        assert "not all 2 tensor-parallel ranks joined" in log, log[-3000:]
        assert "within 3 s" in log and "--node-rank" in log
        assert "All processes stopped" in log
    finally:
        service.stop()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tp", "3", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:1"], "--tp-size"),
        (["--nnodes", "2", "--tp", "2"], "--dist-init-addr"),
        (["--tp", "2", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"], "--node-rank"),
        (["--tp", "2", "--dist-init-addr", "no-port"], "--dist-init-addr"),
    ],
)
def test_a_parallel_layout_the_nodes_cannot_hold_is_refused_by_flag(args, message, capsys):
    from minisgl.service.args import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_tp_size_that_does_not_divide_the_heads_fails_before_any_worker_starts(model):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "minisgl", "--model", model, "--tp", "3", "--port", str(free_port())],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "num_attention_heads=4" in r.stderr and "--tp-size" in r.stderr
    assert "Started" not in r.stderr
