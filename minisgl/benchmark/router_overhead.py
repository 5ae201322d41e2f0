"""The router's overhead per request: the same one-token request, one at a time, sent alternately to a
replica directly and to a router whose only worker is that replica; the difference of the latencies is
what the router adds (its proxying, its policy, the second HTTP hop).

    python -m minisgl --port 1921 &                       # a replica
    python -m sglang_router.launch_router --port 1920 --worker-urls http://127.0.0.1:1921 &
    python -m minisgl.benchmark.router_overhead --direct http://127.0.0.1:1921 --routed http://127.0.0.1:1920
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _latencies(client, url: str, n: int, body: dict) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        r = client.post(f"{url}/generate", json=body)
        r.raise_for_status()
        out.append(time.perf_counter() - start)
    return out


def measure(direct: str, routed: str, rounds: int, per_round: int, stream: bool) -> dict[str, float]:
    """Median and p90 latency (ms) of each path, interleaved in rounds so that a change in the machine's
    load hits both alike, and the median difference."""
    import httpx

    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "stream": stream}
    times: dict[str, list[float]] = {"direct": [], "routed": []}
    with httpx.Client(timeout=60) as client:
        for url in (direct, routed):  # warm both connections (and the router's first worker pick)
            _latencies(client, url, 3, body)
        for _ in range(rounds):
            times["direct"] += _latencies(client, direct, per_round, body)
            times["routed"] += _latencies(client, routed, per_round, body)
    out: dict[str, float] = {}
    for name, ts in times.items():
        ts.sort()
        out[f"{name}_p50_ms"] = 1000 * statistics.median(ts)
        out[f"{name}_p90_ms"] = 1000 * ts[int(0.9 * (len(ts) - 1))]
    out["overhead_p50_ms"] = out["routed_p50_ms"] - out["direct_p50_ms"]
    out["requests_per_path"] = rounds * per_round
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minisgl.benchmark.router_overhead", description=__doc__)
    p.add_argument("--direct", required=True, help="a replica's URL")
    p.add_argument("--routed", required=True, help="the URL of a router whose only worker is that replica")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--per-round", type=int, default=10)
    p.add_argument("--stream", action="store_true", help="stream the reply (SSE through the router)")
    args = p.parse_args(argv)
    print(json.dumps(measure(args.direct, args.routed, args.rounds, args.per_round, args.stream), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
