"""The API server alone, against a synthetic backend: how many streamed tokens a second its one process can
serve, and what each costs it, with no model and no GPU.

    python -m minisgl.benchmark.frontend --concurrency 256 --max-tokens 512 --step-ms 4 --processes 2

The real app (`create_app`, uvicorn, the service's HTTP protocol) serves on a free port; in place of the
tokenizer, detokenizer and scheduler, a backend process answers every request with one ReplyBatch per
"step" (every `--step-ms` ms: one token, " tok", for every live request, the first and last rows with
their usage), as the detokenizer does for a real model. The online benchmark client (`--processes`) drives
it. The report adds the API server's CPU seconds per token: the figure to lower, measured whatever else
the machine is doing (on a 2-core machine the client and the backend share the other core, so throughput
there is the client's, not the server's)."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any


def backend(request_addr: str, frontend_addr: str, step_ms: float, ready: Any) -> None:
    """The synthetic tokenizer+detokenizer+scheduler: tokens for every live request, one batch a step."""
    from minisgl.message import AbortMsg, ReplyBatch, StatsMsg, TokenizeMsg, UserReply, dumps, loads
    from minisgl.service.zmq_queue import ZmqPullQueue, ZmqPushQueue

    recv: ZmqPullQueue[Any] = ZmqPullQueue(request_addr, create=True, decoder=loads)
    send: ZmqPushQueue[Any] = ZmqPushQueue(frontend_addr, create=False, encoder=dumps)
    ready.set()
    live: dict[int, list[int]] = {}  # uid -> [tokens sent, max_tokens]
    stats_at = 0.0
    while True:
        for msg in recv.get_all() if live else [recv.get(), *recv.get_all()]:
            if isinstance(msg, TokenizeMsg):
                live[msg.uid] = [0, msg.sampling_params.max_tokens or 16]
            elif isinstance(msg, AbortMsg):
                live.pop(msg.uid, None)
        out = ReplyBatch()
        for uid, state in list(live.items()):
            state[0] += 1
            done = state[0] >= state[1]
            reply = UserReply(uid, " tok", [state[0]], prompt_tokens=8 if state[0] == 1 or done else 0)
            if done:
                reply.finished, reply.finish_reason, reply.completion_tokens = True, "length", state[0]
                del live[uid]
            out.add(reply)
        if len(out):
            send.put(out)
        if time.monotonic() - stats_at > 0.5:
            stats_at = time.monotonic()
            send.put(StatsMsg({"num_running": float(len(live))}))
        time.sleep(step_ms / 1000)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m minisgl.benchmark.frontend",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--num-requests", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--step-ms", type=float, default=4.0, help="the synthetic scheduler's step time")
    p.add_argument("--processes", type=int, default=2, help="client processes")
    args = p.parse_args(argv)

    import psutil
    import uvicorn

    from minisgl.service.args import ServerArgs
    from minisgl.service.http_protocol import HeaderDeadlineProtocol
    from minisgl.service.openai import create_app
    from minisgl.service.startup import bind_port

    ipc_dir = tempfile.mkdtemp(prefix="minisgl-frontend-")
    sargs = ServerArgs(model_path="synthetic", max_running_req=args.concurrency, ipc_dir=ipc_dir)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    worker = ctx.Process(
        target=backend, args=(sargs.request_addrs[0], sargs.frontend_addr, args.step_ms, ready), daemon=True
    )
    worker.start()
    ready.wait(60)
    sock = bind_port("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(sargs, 4096),
            log_level="warning",
            http=HeaderDeadlineProtocol.with_timeout(sargs.request_timeout),
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    me = psutil.Process()
    cpu0 = me.cpu_times()
    out = os.path.join(ipc_dir, "report.json")
    client = [sys.executable, "-m", "minisgl.benchmark.online", "--base-url", f"http://127.0.0.1:{port}/v1"]
    client += ["--model", "synthetic", "--num-requests", str(args.num_requests), "--warmup", "0"]
    client += ["--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens)]
    client += ["--processes", str(args.processes), "--output-json", out]
    subprocess.run(client, check=True)  # in processes of its own: this one's CPU time is the server's
    with open(out) as f:
        report = json.load(f)
    os.remove(out)
    cpu1 = me.cpu_times()
    server.should_exit = True
    thread.join(10)
    worker.kill()
    api_cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)  # the client runs in other processes
    tokens = report["output_tokens"]
    print(
        f"  API server: {api_cpu:.2f} CPU s for {tokens} tokens = {1e6 * api_cpu / max(tokens, 1):.1f} us a "
        f"token ({api_cpu / report['duration_s']:.0%} of a core over the run)"
    )
    shutil.rmtree(ipc_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
