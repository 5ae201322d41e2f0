"""Online serving benchmark: streaming chat requests against any OpenAI-compatible server.

    python -m minisgl.benchmark.online --base-url http://127.0.0.1:1919/v1                    # W4, 16 at a time
    python -m minisgl.benchmark.online --base-url http://127.0.0.1:1919/v1 --request-rate 2   # Poisson arrivals
    python -m minisgl.benchmark.online --base-url http://127.0.0.1:8000/v1 --model HuggingFaceTB/SmolLM2-135M-Instruct

Workload W4 (the project's benchmark brief): N chat requests "Write a long story about <topic>, number <i>."
over 16 topics, temperature 0, max_tokens 128. Per request it measures the time to first token (TTFT), the
gaps between streamed chunks (ITL), the time per output token after the first (TPOT) and the end-to-end
latency, and reports mean / p50 / p90 / p99 of each plus the output throughput over the whole run.
Output tokens come from the server's usage (stream_options.include_usage) when it sends one, else from
counting content chunks.

The client reads the streams with a lean HTTP/1.1 reader (benchmark/sse_client.py: on a 2-core machine the
client shares the cores with the server it measures, and httpx's streaming path took 5% of a core at W4's
430 tok/s, a third of that now). One process can still fall behind a fast GPU server: `--processes N`
spreads the requests over N processes (each with its share of the concurrency or of the arrival rate, all starting at one
moment), and the report gives each process's CPU use, so a run shows whether the client was the limit
(doubling N must not raise the throughput).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from minisgl.benchmark.prompts import BENCH_SCHEMA, w4_prompts
from minisgl.benchmark.sse_client import HTTPError, open_client


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds from sending to the first content
    e2e: float = 0.0  # seconds from sending to the end of the stream
    output_tokens: int = 0
    usage_reported: bool = False
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    constrained: bool = False  # sent with a JSON schema (--constrained-fraction)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def constrained_rows(n: int, fraction: float) -> list[bool]:
    """Which of n requests carry the JSON schema: int(n * fraction) of them, spread evenly."""
    return [int((i + 1) * fraction) > int(i * fraction) for i in range(n)]


async def _one(
    client: Any, model: str, prompt: str, args: argparse.Namespace, constrained: bool = False
) -> RequestResult:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
    }
    if args.include_usage:
        body["stream_options"] = {"include_usage": True}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if constrained:  # ends once its JSON is complete
        schema = {"name": "bench", "schema": BENCH_SCHEMA}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    res = RequestResult(constrained=constrained)
    t0 = time.perf_counter()
    last = None
    chunks = 0
    try:
        async for payload in client.stream("/chat/completions", body):
            if payload == b"[DONE]":
                continue  # the reply ends right after it: read to its end, so the connection is reused
            event = _loads(payload)
            if event.get("usage"):
                res.output_tokens = int(event["usage"].get("completion_tokens", 0))
                res.usage_reported = True
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
    except Exception as e:  # noqa: BLE001 - a failed request is reported, not fatal
        res.error = str(e) if isinstance(e, HTTPError) else f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    if not res.usage_reported:
        res.output_tokens = chunks
    res.ok = last is not None
    if not res.ok:
        res.error = "no content streamed"
    return res


try:  # the client must not be the bottleneck: orjson parses each chunk several times faster
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - orjson comes with the service's extras
    _loads = json.loads


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    v = sorted(values)

    def pct(p: float) -> float:  # linear interpolation between closest ranks
        k = (len(v) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (k - lo)

    return {"mean": statistics.fmean(v), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def _prepare(args: argparse.Namespace) -> str:
    """The model name (asked from the server unless given), after the warm-up requests."""
    base = args.base_url.rstrip("/")
    model = args.model
    if model is None:
        import httpx

        async with httpx.AsyncClient(timeout=args.timeout, headers=_headers(args)) as http:
            model = (await http.get(f"{base}/models")).json()["data"][0]["id"]
    client = open_client(base, _headers(args), args.timeout)
    try:
        for i in range(args.warmup):  # excluded from the figures
            res = await _one(client, model, f"Warm-up request {i}.", args)
            if not res.ok and args.include_usage and res.error.startswith(("HTTP 400", "HTTP 422")):
                print(
                    "note: the server refused stream_options; counting content chunks instead",
                    file=sys.stderr,
                )
                args.include_usage = False
                await _one(client, model, f"Warm-up request {i}.", args)
    finally:
        await client.aclose()
    return model


async def _measure(
    args: argparse.Namespace, model: str, rows: list[int], start: float, progress: Any = None
) -> tuple[dict[int, RequestResult], float, float]:
    """Send requests `rows` (request i leaves at `start` + its Poisson delay, on the wall clock shared
    by the processes), `args.concurrency` at a time; returns their results, the time the last ended and
    this process's CPU seconds over the run."""
    prompts = w4_prompts(args.num_requests)
    under = constrained_rows(len(prompts), args.constrained_fraction)
    delays = [0.0] * len(prompts)
    if args.request_rate:  # Poisson arrivals: exponential gaps
        rng, t = random.Random(args.seed), 0.0
        for i in range(len(prompts)):
            delays[i] = t
            t += rng.expovariate(args.request_rate)
    results: dict[int, RequestResult] = {}
    client = open_client(args.base_url.rstrip("/"), _headers(args), args.timeout)
    try:
        gate = asyncio.Semaphore(args.concurrency) if args.concurrency else None

        async def task(i: int) -> None:
            await asyncio.sleep(max(0.0, start + delays[i] - time.time()))
            if gate is None:
                results[i] = await _one(client, model, prompts[i], args, under[i])
            else:
                async with gate:
                    results[i] = await _one(client, model, prompts[i], args, under[i])
            if progress is not None:
                progress.update(1)

        await asyncio.sleep(max(0.0, start - time.time()))
        cpu = time.process_time()
        await asyncio.gather(*(task(i) for i in rows))
        return results, time.time(), time.process_time() - cpu
    finally:
        await client.aclose()


def _process_main(args: argparse.Namespace, model: str, rows: list[int], start: float, out: Any) -> None:
    out.put(asyncio.run(_measure(args, model, rows, start)))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    base = args.base_url.rstrip("/")
    model = await _prepare(args)
    n = args.processes
    prompts = w4_prompts(args.num_requests)
    results: list[RequestResult] = [RequestResult() for _ in prompts]
    if n == 1:
        start = time.time()
        bar = tqdm(total=len(prompts), desc="requests", file=sys.stderr)
        parts = [await _measure(args, model, list(range(len(prompts))), start, bar)]
        bar.close()
    else:  # each process takes every n-th request and its share of the concurrency
        ctx = mp.get_context("spawn")
        share = argparse.Namespace(**vars(args))
        share.concurrency = math.ceil(args.concurrency / n) if args.concurrency else None
        out = ctx.Queue()
        start = time.time() + 3.0  # the processes import and connect first
        procs = [
            ctx.Process(
                target=_process_main, args=(share, model, list(range(k, len(prompts), n)), start, out)
            )
            for k in range(n)
        ]
        for proc in procs:
            proc.start()
        print(f"{n} client processes, {len(prompts)} requests", file=sys.stderr)
        parts = [out.get() for _ in procs]
        for proc in procs:
            proc.join()
    for part, _, _ in parts:
        for i, res in part.items():
            results[i] = res
    wall = max(end for _, end, _ in parts) - start
    client_cpu = [cpu / wall for _, _, cpu in parts]

    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ms = 1000.0
    tpots = [r.tpot for r in ok if r.tpot is not None]
    report = {
        "base_url": base,
        "model": model,
        "num_requests": len(prompts),
        "completed": len(ok),
        "failed": len(prompts) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "concurrency": args.concurrency,
        "request_rate": args.request_rate,
        "client_processes": n,
        "client_cpu_per_process": client_cpu,  # CPU seconds / wall seconds: 1.0 is a full core
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "duration_s": wall,
        "output_tokens": out_tokens,
        "tokens_counted_by": "usage" if ok and all(r.usage_reported for r in ok) else "content chunks",
        "output_throughput_tok_s": out_tokens / wall if wall > 0 else 0.0,
        "request_throughput_req_s": len(ok) / wall if wall > 0 else 0.0,
        "ttft_ms": {k: v * ms for k, v in _summary([r.ttft for r in ok]).items()},
        "tpot_ms": {k: v * ms for k, v in _summary(tpots).items()},
        "itl_ms": {k: v * ms for k, v in _summary([g for r in ok for g in r.itl]).items()},
        "e2e_ms": {k: v * ms for k, v in _summary([r.e2e for r in ok]).items()},
    }
    if args.constrained_fraction:
        report["by_kind"] = {name: _kind(ok, name == "constrained", wall) for name in ("constrained", "free")}
    if args.save_requests:
        report["requests"] = [asdict(r) for r in results]
    return report


def _kind(ok: list[RequestResult], constrained: bool, wall: float) -> dict[str, float]:
    """The figures of the requests sent with (or without) the schema: their tokens over the run's wall
    time, and their own TTFT and TPOT."""
    mine = [r for r in ok if r.constrained == constrained]
    tokens = sum(r.output_tokens for r in mine)
    return {
        "requests": len(mine),
        "output_tokens": tokens,
        "output_throughput_tok_s": tokens / wall if wall > 0 else 0.0,
        "ttft_p50_ms": _summary([r.ttft for r in mine])["p50"] * 1000.0,
        "tpot_mean_ms": _summary([r.tpot for r in mine if r.tpot is not None])["mean"] * 1000.0,
    }


def print_report(rep: dict[str, Any]) -> None:
    mode = f"rate {rep['request_rate']}/s" if rep["request_rate"] else f"concurrency {rep['concurrency']}"
    print(
        f"\n{rep['model']} at {rep['base_url']}: {rep['completed']}/{rep['num_requests']} requests ({mode}), "
        f"max_tokens {rep['max_tokens']}, temperature {rep['temperature']}"
    )
    if rep["failed"]:
        print(f"  failed: {rep['failed']}  e.g. {rep['errors'][:2]}")
    print(
        f"  duration {rep['duration_s']:.2f} s, output tokens {rep['output_tokens']} "
        f"(counted by {rep['tokens_counted_by']})"
    )
    print(
        f"  output throughput {rep['output_throughput_tok_s']:.1f} tok/s, "
        f"{rep['request_throughput_req_s']:.2f} req/s"
    )
    cpu = ", ".join(f"{c:.0%}" for c in rep["client_cpu_per_process"])
    print(f"  client: {rep['client_processes']} process(es), CPU {cpu} of a core each")
    print(f"  {'(ms)':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key in ("ttft", "tpot", "itl", "e2e"):
        s = rep[f"{key}_ms"]
        print(f"  {key.upper():<6}{s['mean']:>10.1f}{s['p50']:>10.1f}{s['p90']:>10.1f}{s['p99']:>10.1f}")
    for name, k in rep.get("by_kind", {}).items():
        print(
            f"  {name}: {k['requests']} requests, {k['output_tokens']} tokens, "
            f"{k['output_throughput_tok_s']:.1f} tok/s, p50 TTFT {k['ttft_p50_ms']:.1f} ms, "
            f"mean TPOT {k['tpot_mean_ms']:.1f} ms"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m minisgl.benchmark.online",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:1919/v1", help="the server's OpenAI API root")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /models)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("MINISGL_API_KEY", ""),
        help="sent as `Authorization: Bearer <key>` (default: $MINISGL_API_KEY)",
    )
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument(
        "--concurrency", type=int, default=None, help="requests in flight (default 16 without a rate)"
    )
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second instead")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos (a minisgl/vLLM/SGLang extension)"
    )
    p.add_argument(
        "--no-usage",
        dest="include_usage",
        action="store_false",
        help="do not ask for stream_options.include_usage (count content chunks instead)",
    )
    p.add_argument(
        "--constrained-fraction",
        type=float,
        default=0.0,
        help="fraction (0..1) of the requests sent with a JSON schema (response_format); figures per kind",
    )
    p.add_argument("--warmup", type=int, default=1, help="requests sent first and not measured")
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="client processes sharing the requests (one may fall behind a fast server)",
    )
    p.add_argument("--output-json", default=None, help="also write the report here")
    p.add_argument(
        "--save-requests", action="store_true", help="include every request's measurements in the JSON"
    )
    args = p.parse_args(argv)
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = 16
    if (args.concurrency is not None and args.concurrency < 1) or (
        args.request_rate is not None and args.request_rate <= 0
    ):
        p.error("--concurrency must be >= 1 and --request-rate > 0")
    if args.processes < 1:
        p.error("--processes must be >= 1")
    report = asyncio.run(run(args))
    print_report(report)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["completed"] == report["num_requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
