"""Head-of-line blocking: do large prompts stall the other requests' streams?

    python -m minisgl.benchmark.stall                      # the default model
    python -m minisgl.benchmark.stall --model /path/to/model --window 8

Starts the service (`python -m minisgl` on a free port), runs 8 streaming completions and measures the
longest gap between two chunks of any of them, first alone, then while hostile prompts arrive: a prompt at
the body limit (--max-request-bytes) and one at the byte bound of the context, a chat of as many short
messages as the body limit holds and one of as many as the context allows. Prints both figures; the
target is "with" <= "alone" + 0.5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx

from minisgl.utils.net import free_port

STREAMS = 8
MSG = '{"role":"user","content":"hi"},'


def start_service(model: str | None, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m minisgl` on a free port; returns once /v1/models answers."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "minisgl",
        "--port",
        str(port),
        *(["--model", model] if model else []),
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the service did not start")


async def _stream(client: httpx.AsyncClient, url: str, i: int, arrivals: list[float]) -> None:
    # 8 x 512 tokens fit any KV pool here: all 8 run at once
    body = {"prompt": f"Count from {i} onwards:", "max_tokens": 512, "temperature": 0, "ignore_eos": True}
    body["stream"] = True
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.perf_counter())
    except (httpx.HTTPError, asyncio.CancelledError):
        pass


def hostile_bodies(max_request_bytes: int, context: int, bytes_per_token: int) -> list[tuple[str, bytes]]:
    """(path, body): prompts maximal by bytes and by message count, at the body limit and at the bounds."""
    room = max_request_bytes - 64
    by_body = json.dumps({"prompt": "ab " * (room // 3), "max_tokens": 1}).encode()
    by_bound = json.dumps({"prompt": "ab " * (context * bytes_per_token // 3), "max_tokens": 1}).encode()
    many = b'{"max_tokens":1,"messages":[' + MSG.encode() * (room // len(MSG)) + MSG[:-1].encode() + b"]}"
    at_bound = json.dumps({"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}] * context})
    return [
        ("/v1/completions", by_body),
        ("/v1/completions", by_bound),
        ("/v1/chat/completions", many),
        ("/v1/chat/completions", at_bound.encode()),
    ]


async def measure(url: str, window: float, hostile: list[tuple[str, bytes]]) -> tuple[float, list[Any]]:
    """The longest gap between two chunks of any of the 8 streams over `window` seconds (after they all
    started), while the `hostile` bodies are sent one after the other; and the answers to those."""
    arrivals: list[list[float]] = [[] for _ in range(STREAMS)]
    answers: list[Any] = []
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(_stream(client, url, i, arrivals[i])) for i in range(STREAMS)]
        deadline = time.monotonic() + 300
        while not all(len(a) >= 2 for a in arrivals):
            if time.monotonic() > deadline or all(t.done() for t in tasks):
                raise RuntimeError("the 8 streams did not all start")
            await asyncio.sleep(0.05)
        start = time.perf_counter()
        await asyncio.sleep(0.5)
        for path, body in hostile:
            t = time.perf_counter()
            headers = {"Content-Type": "application/json"}
            r = await client.post(f"{url}{path}", content=body, headers=headers)
            answers.append((path, len(body), r.status_code, round(time.perf_counter() - t, 2)))
        await asyncio.sleep(max(0.0, window - (time.perf_counter() - start)))
        end = time.perf_counter()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    gaps = [b - a for arr in arrivals for a, b in itertools.pairwise(arr) if a >= start and b <= end]
    return max(gaps, default=float("nan")), answers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="the model to serve (default: the embedded default)")
    p.add_argument("--window", type=float, default=8.0, help="seconds of streaming measured per phase")
    p.add_argument("--max-request-bytes", type=int, default=8 << 20)
    p.add_argument("--server-arg", action="append", default=[], help="one more argument for the service")
    args = p.parse_args(argv)
    try:
        from minisgl.service.openai.params import BYTES_PER_TOKEN
    except ImportError:  # a tree from before the byte bound: measure it with the same prompts
        BYTES_PER_TOKEN = 32

    extra = ["--max-request-bytes", str(args.max_request_bytes), *args.server_arg]
    proc, url = start_service(args.model, extra)
    try:
        context = int(httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"])
        alone, _ = asyncio.run(measure(url, args.window, []))
        hostile = hostile_bodies(args.max_request_bytes, context, BYTES_PER_TOKEN)
        loaded, answers = asyncio.run(measure(url, args.window, hostile))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    for path, size, status, seconds in answers:
        print(f"hostile {path}: {size} bytes -> HTTP {status} in {seconds} s")
    print(f"longest gap between two chunks of {STREAMS} streams, alone: {alone:.3f} s")
    print(f"longest gap between two chunks of {STREAMS} streams, with the hostile prompts: {loaded:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
