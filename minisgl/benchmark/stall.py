"""Head-of-line blocking: do large prompts stall the other requests' streams?

    python -m minisgl.benchmark.stall                      # the default model
    python -m minisgl.benchmark.stall --model /path/to/model --window 8

Starts the service (`python -m minisgl` on a free port), runs 8 streaming completions and measures the
longest gap between two chunks of any of them, first alone, then while hostile prompts arrive: a prompt at
the body limit (--max-request-bytes) and one at the byte bound of the context, a chat of as many short
messages as the body limit holds and one of as many as the context allows; then hostile constraints: a
JSON schema string of arrays nested 800 deep, one 1,000 deep, a 20,000-value enum abandoned by its client
after 2 s, a trivial schema right after it (how long it waits), 128 tools with tool_choice "required"
and an object of 3,000 optional properties (each given at most --constraint-timeout seconds). Prints
both figures; the target is "with" <= "alone" + 0.5 s.
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


STREAM_TOKENS = 512  # 8 x 512 tokens fit any KV pool here: all 8 run at once (--stream-tokens)


async def _stream(client: httpx.AsyncClient, url: str, i: int, arrivals: list[float], tokens: int) -> None:
    body = {"prompt": f"Count from {i} onwards:", "max_tokens": tokens, "temperature": 0}
    body["ignore_eos"] = True
    body["stream"] = True
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.perf_counter())
    except (httpx.HTTPError, asyncio.CancelledError):
        pass


def _nested_arrays(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + '{"type": "string"}' + "}" * depth


def hostile_constraints() -> list[tuple[str, bytes, float | None]]:
    """(path, body, client timeout: None for the default): constraints that are slow or deep to parse
    or compile; the 20,000-value enum is abandoned by its client."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    tools = [
        {"type": "function", "function": dict(tool["function"], name=f"tool_{i}", parameters={
            "type": "object",
            "properties": {"x": {"type": ["string", "integer", "null"]}},
        })}
        for i in range(128)
    ]  # fmt: skip
    enum = {"type": "string", "enum": [f"value number {i} of the enumeration" for i in range(20_000)]}
    props = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(3_000)}}
    bodies = [
        ({"prompt": "hi", "max_tokens": 4, "json_schema": _nested_arrays(800)}, None),
        ({"prompt": "hi", "max_tokens": 4, "guided_json": _nested_arrays(1000)}, None),
        ({"prompt": "hi", "max_tokens": 4, "json_schema": json.dumps(enum)}, 2.0),
        ({"prompt": "hi", "max_tokens": 4, "json_schema": '{"type": "object"}'}, None),
        (dict(chat, tools=tools, tool_choice="required"), None),
        ({"prompt": "hi", "max_tokens": 4, "json_schema": json.dumps(props)}, None),
    ]
    return [
        ("/v1/chat/completions" if "messages" in b else "/v1/completions", json.dumps(b).encode(), t)
        for b, t in bodies
    ]


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


async def measure(
    url: str,
    window: float,
    hostile: list[tuple[str, bytes, float | None]],
    timeout: float = 600,
    tokens: int = STREAM_TOKENS,
) -> tuple[float, list[Any]]:
    """The longest gap between two chunks of any of the 8 streams over `window` seconds (after they all
    started), while the `hostile` bodies are sent one after the other; and the answers to those."""
    arrivals: list[list[float]] = [[] for _ in range(STREAMS)]
    answers: list[Any] = []
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(_stream(client, url, i, arrivals[i], tokens)) for i in range(STREAMS)]
        deadline = time.monotonic() + 300
        while not all(len(a) >= 2 for a in arrivals):
            if time.monotonic() > deadline or all(t.done() for t in tasks):
                raise RuntimeError("the 8 streams did not all start")
            await asyncio.sleep(0.05)
        start = time.perf_counter()
        await asyncio.sleep(0.5)
        for path, body, limit in hostile:
            t = time.perf_counter()
            headers = {"Content-Type": "application/json"}
            try:  # each on a connection of its own: a request given up on closes its connection
                async with httpx.AsyncClient(timeout=limit or timeout) as one:
                    r = await one.post(f"{url}{path}", content=body, headers=headers)
                status: Any = r.status_code
            except httpx.TimeoutException:
                status = "no answer (client gave up)"
            except httpx.HTTPError as e:  # e.g. the connection closed: the server's process died?
                status = f"{type(e).__name__} (no answer)"
            answers.append([path, len(body), status, t, time.perf_counter()])
        await asyncio.sleep(max(0.0, window - (time.perf_counter() - start)))
        end = time.perf_counter()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    pairs = [(a, b) for arr in arrivals for a, b in itertools.pairwise(arr) if a >= start and b <= end]
    for answer in answers:  # which request a stall happened under: the longest gap overlapping it
        t0, t1 = answer[3:]
        answer[3:] = [round(t1 - t0, 2), max((b - a for a, b in pairs if b > t0 and a < t1), default=0.0)]
    return max((b - a for a, b in pairs), default=float("nan")), answers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="the model to serve (default: the embedded default)")
    p.add_argument("--window", type=float, default=8.0, help="seconds of streaming measured per phase")
    p.add_argument("--max-request-bytes", type=int, default=8 << 20)
    p.add_argument("--server-arg", action="append", default=[], help="one more argument for the service")
    p.add_argument(
        "--constraint-timeout",
        type=float,
        default=120.0,
        help="seconds a client waits for a hostile constraint",
    )
    p.add_argument("--stream-tokens", type=int, default=STREAM_TOKENS, help="tokens each stream generates")
    args = p.parse_args(argv)
    try:
        from minisgl.service.openai.params import BYTES_PER_TOKEN
    except ImportError:  # a tree from before the byte bound: measure it with the same prompts
        BYTES_PER_TOKEN = 32

    extra = ["--max-request-bytes", str(args.max_request_bytes), *args.server_arg]
    proc, url = start_service(args.model, extra)
    try:
        context = int(httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"])
        alone, _ = asyncio.run(measure(url, args.window, [], tokens=args.stream_tokens))
        hostile = [(p, b, None) for p, b in hostile_bodies(args.max_request_bytes, context, BYTES_PER_TOKEN)]
        hostile += hostile_constraints()
        loaded, answers = asyncio.run(
            measure(url, args.window, hostile, args.constraint_timeout, args.stream_tokens)
        )
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    for path, size, status, seconds, gap in answers:
        print(
            f"hostile {path}: {size} bytes -> HTTP {status} in {seconds} s; longest gap meanwhile {gap:.3f} s"
        )
    print(f"longest gap between two chunks of {STREAMS} streams, alone: {alone:.3f} s")
    print(f"longest gap between two chunks of {STREAMS} streams, with the hostile requests: {loaded:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
