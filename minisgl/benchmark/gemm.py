"""Time the decode-size GEMMs of one transformer layer: cuBLAS (torch's F.linear, after a separate SiLU-and-mul
kernel for the down projection, as the layer ran them before) against the Triton skinny GEMM
(triton_kernels.gemm), at Qwen3-0.6B or Qwen3-8B shapes in bf16.

python -m minisgl.benchmark.gemm --model 0.6b [--rows 2,8,32,128] [--sweep]
Each timing is a CUDA graph of back-to-back calls that cycle over enough weight copies that no weight is
in L2 when read; prints microseconds per call and the weight bytes read per second. --sweep also times
every tiling in SWEEP and prints the fastest, next to the default one that gemm() picks. The engine calls
gemm() only for 2-16 rows and weights up to 16 MB (triton_kernels.gemm_fits); the larger row counts, the LM
head and the Qwen3-8B shapes are here to show where cuBLAS is the better choice."""

from __future__ import annotations

import argparse
import itertools
import json
import os
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from minisgl.kernel import triton as triton_kernels

# (name, N, K, gated) of one layer's projections
SHAPES = {
    "0.6b": [
        ("qkv", 4096, 1024, False),
        ("o", 1024, 2048, False),
        ("gate_up", 6144, 1024, False),
        ("down", 1024, 3072, True),
        ("lm_head", 151936, 1024, False),
    ],
    "8b": [
        ("qkv", 6144, 4096, False),
        ("o", 4096, 4096, False),
        ("gate_up", 24576, 4096, False),
        ("down", 4096, 12288, True),
    ],
}
ROWS = [2, 4, 8, 16, 32, 64, 128, 256]
SWEEP = {"block_n": [16, 32, 64], "block_k": [128, 256], "num_k": [1, 2, 4], "warps": [4, 8]}
L2_DEFEAT = 256 << 20  # bytes of weights a timing cycles over


def _configs(m: int, k: int) -> list[tuple[int, int, int, int, int]]:
    """The tilings to time (BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, num_warps): whole K slices, at most 64 KB
    of weights a program."""
    block_m = max(16, min(64, 1 << (m - 1).bit_length()))
    return [
        (block_m, bn, bk, nk, w)
        for bn, bk, nk, w in itertools.product(
            SWEEP["block_n"], SWEEP["block_k"], SWEEP["num_k"], SWEEP["warps"]
        )
        if k % (bk * nk) == 0 and bn * bk * nk <= 32768
    ]


def _compile(args: tuple[int, bool, list]) -> int:
    """Compile (by running once, small N) the kernels for one K; fills Triton's on-disk cache."""
    k, gated, configs = args
    x = torch.randn(16, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
    done = 0
    for config in configs:
        try:
            triton_kernels.gemm(x, w, gated=gated, config=config)
            done += 1
        except (OutOfResources, RuntimeError) as e:  # too much shared memory, or Triton cannot compile it
            print(f"skipped {config} for K={k}: {e}", flush=True)
    torch.cuda.synchronize()
    return done


def _time(fn, copies: int, replays: int = 10) -> float:
    """Microseconds per call of fn(i) for i over the weight copies, in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(copies):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * copies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="0.6b")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts")
    parser.add_argument("--sweep", action="store_true", help="also time every tiling in SWEEP")
    parser.add_argument("--dump", help="with --sweep: write every timing to this file as JSON lines")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    shapes = SHAPES[args.model]
    if args.sweep:  # compile every tiling in parallel processes first (Triton caches them on disk)
        jobs = []
        for _, _, k, gated in shapes:
            configs = sorted({c for m in rows for c in _configs(m, k)})
            jobs += [(k, gated, configs[i::4]) for i in range(4)]
        ctx = torch.multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(len(jobs), os.cpu_count() or 1), mp_context=ctx) as pool:
            print(f"compiled {sum(pool.map(_compile, jobs))} kernels", flush=True)
    torch.manual_seed(0)
    print(
        f"{'shape':8} {'rows':>4} {'cuBLAS us':>9} {'GB/s':>6} {'triton us':>9} {'GB/s':>6} {'err':>8}"
        + ("  best us   best (BM, BN, BK, NUM_K, warps)" if args.sweep else ""),
        flush=True,
    )
    for name, n, k, gated in shapes:
        copies = max(2, L2_DEFEAT // (n * k * 2))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        for m in rows:
            line, timed = _compare(m, k, gated, weights, args.sweep)
            print(f"{name:8} {m:4d} {line}", flush=True)
            if args.dump:
                with open(args.dump, "a") as f:
                    f.writelines(
                        json.dumps({"shape": name, "n": n, "k": k, "m": m, "us": us, "config": c}) + "\n"
                        for us, c in timed
                    )


def _compare(m: int, k: int, gated: bool, weights: list[torch.Tensor], sweep: bool) -> tuple[str, list]:
    """One line of the table (cuBLAS, gemm()'s default tiling, with sweep the fastest tiling) and the
    sweep's (microseconds, tiling) pairs."""
    n, copies = weights[0].shape[0], len(weights)
    x = torch.randn(m, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(F.silu(x[:, :k]) * x[:, k:] if gated else x, weights[0])
    got = triton_kernels.gemm(x, weights[0], gated=gated)
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    if gated:
        cublas = _time(lambda i: F.linear(triton_kernels.silu_and_mul(x), weights[i]), copies)
    else:
        cublas = _time(lambda i: F.linear(x, weights[i]), copies)
    ours = _time(lambda i: triton_kernels.gemm(x, weights[i], gated=gated), copies)
    if not torch.equal(triton_kernels.gemm(x, weights[0], gated=gated), got):  # split-K counters were reset
        raise RuntimeError(f"gemm gave a different result after graph replays ({m} x {n} x {k})")
    line = (
        f"{cublas:9.2f} {n * k * 2 / cublas / 1e3:6.0f} {ours:9.2f} {n * k * 2 / ours / 1e3:6.0f} {err:8.1e}"
    )
    timed = []
    if sweep:
        for c in _configs(m, k):
            try:
                us = _time(lambda i, c=c: triton_kernels.gemm(x, weights[i], gated=gated, config=c), copies)
            except (OutOfResources, RuntimeError):  # already reported when compiling
                continue
            timed.append((us, c))
        best = min(timed)
        line += f"  {best[0]:7.2f}   {best[1]}"
    return line, timed


if __name__ == "__main__":
    main()
