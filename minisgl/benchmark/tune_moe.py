"""Tune the fused-MoE tiles on this GPU and write the best per layer shape and token count into
minisgl/kernel/triton/moe_configs.json (the table moe.moe_config reads; entries for other devices and
shapes are kept).

python -m minisgl.benchmark.tune_moe [--shapes qwen3-30b-a3b,qwen3-30b-a3b-tp2,...] [--tokens 1,2,4,...]
    [--quick] [--output PATH] [--jobs 16]
For each shape and token count: random bf16 weights and uniform random routings; for each BLOCK_M that fits
the rows an expert gets, every gate/up tiling and every down tiling (with split K at few rows) is timed on
its own in a CUDA graph cycling over several routings (weights not served from L2); the best BLOCK_M by the
sum of the two best times wins, is checked against the torch reference, and is written after each token
count (an interrupted run keeps what it finished). Kernels are compiled first in --jobs processes."""

from __future__ import annotations

import argparse
import itertools
import json
import os
from concurrent.futures import ProcessPoolExecutor

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from minisgl.benchmark.moe_layer import layer_weights, log, time_us

COMPILE_ERRORS = (OutOfResources, CompilationError, RuntimeError)

# name -> (experts, k, H, I)
SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "qwen3-30b-a3b-tp2": (128, 8, 2048, 384),
    "qwen3-30b-a3b-tp4": (128, 8, 2048, 192),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
ROUTINGS = 4
SPACE = {  # per GEMM: BLOCK_N, BLOCK_K, num_warps, num_stages; GROUP_M and SPLIT_K by the rows
    "block_m": [16, 32, 64, 128],
    "block_n": [32, 64, 128],
    "block_k": [64, 128, 256],
    "warps": [4, 8],
    "stages": [2, 3, 4, 5],
    "split_k": [1, 2, 4, 8],
}
QUICK = {
    "block_m": [16, 32, 64],
    "block_n": [32, 64, 128],
    "block_k": [64, 128],
    "warps": [4],
    "stages": [3, 4],
    "split_k": [1, 2, 4],
}
SMEM = 200 << 10  # shared memory a tiling may use (an H200 has 227 KB a block)


def block_ms(space: dict, experts: int, top_k: int, tokens: int) -> list[int]:
    """The BLOCK_M values worth trying: up to twice the rows an expert gets on average."""
    pairs = tokens * top_k
    rows = pairs / min(experts, pairs)
    return [m for m in space["block_m"] if m == space["block_m"][0] or m <= 2 * rows]


def gemm_tilings(space: dict, block_m: int, rows: float, inter: int, gated: bool) -> list[dict]:
    """The tilings of one GEMM to time: within SMEM; a split K (down only) and GROUP_M > 1 only where
    they can pay (few rows; several m blocks an expert)."""
    group_m = [1] if rows <= block_m else [1, 8]
    splits = [1] if gated or rows > 16 else [s for s in space["split_k"] if inter // s >= 64]
    out = []
    for bn, bk, w, st, g, s in itertools.product(
        space["block_n"], space["block_k"], space["warps"], space["stages"], group_m, splits
    ):
        smem = (block_m * bk + (2 if gated else 1) * bk * bn) * 2 * st
        if smem > SMEM or (not gated and s > 1 and inter // s < bk):
            continue
        tiles = {"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": g, "num_warps": w, "num_stages": st}
        out.append(tiles if gated else {**tiles, "SPLIT_K": s})
    return out


def candidates(space: dict, shape: tuple, tokens: int) -> dict[int, tuple[list[dict], list[dict]]]:
    """BLOCK_M -> (gate/up tilings, down tilings) for one shape and token count."""
    experts, top_k, _, inter = shape
    pairs = tokens * top_k
    rows = pairs / min(experts, pairs)
    return {
        m: (gemm_tilings(space, m, rows, inter, True), gemm_tilings(space, m, rows, inter, False))
        for m in block_ms(space, experts, top_k, tokens)
    }


def _setup(shape: tuple, tokens: int, seed: int = 0):
    """Weights, ROUTINGS inputs and their routings (uniform random router logits)."""
    from minisgl.kernel import triton as triton_kernels

    experts, top_k, hidden, inter = shape
    torch.manual_seed(seed)
    w13, w2 = layer_weights(experts, hidden, inter)
    xs = [torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(ROUTINGS)]
    routes = [
        triton_kernels.moe_route(torch.randn(tokens, experts, device="cuda"), top_k, True)
        for _ in range(ROUTINGS)
    ]
    return w13, w2, xs, routes


def _compile(job: tuple) -> int:
    """Run (so compile, into Triton's on-disk cache) every chunks-th tiling, from the index-th, of one
    BLOCK_M of a shape at each token count; returns the number of launches that compiled."""
    from minisgl.kernel.triton import moe

    shape, space, tokens, block_m, index, chunks = job
    experts, top_k = shape[0], shape[1]
    done = 0
    for t in tokens:
        tilings = candidates(space, shape, t).get(block_m)
        if tilings is None:
            continue
        w13, w2, xs, routes = _setup(shape, t)
        aligned = moe.align(routes[0][1], experts, block_m)
        act = moe.gate_up(
            xs[0],
            w13,
            top_k,
            aligned,
            block_m,
            moe.default_config(experts, shape[2], shape[3], top_k, t)["gate_up"],
        )
        for tiles in (tilings[0] + tilings[1])[index::chunks]:
            try:
                if "SPLIT_K" in tiles:
                    moe.down(act, w2, routes[0][0], aligned, block_m, tiles)
                else:
                    moe.gate_up(xs[0], w13, top_k, aligned, block_m, tiles)
                done += 1
            except COMPILE_ERRORS as e:  # too much shared memory or registers: timing skips it too
                log(f"  skipped {tiles} at BLOCK_M={block_m}: {str(e).splitlines()[0][:120]}")
        torch.cuda.synchronize()
        del w13, w2, xs, routes, aligned, act
    return done


def _best(fn, tilings: list[dict]) -> tuple[float, dict]:
    """The fastest tiling (microseconds per call, tiling) of fn(i, tiles) over the routings."""
    best = (float("inf"), {})
    for tiles in tilings:
        try:
            us = time_us(lambda i, tiles=tiles: fn(i, tiles), ROUTINGS, replays=5)
        except COMPILE_ERRORS as e:  # did not compile: _compile reported it
            log(f"  not timed {tiles}: {type(e).__name__}")
            continue
        best = min(best, (us, tiles), key=lambda b: b[0])
    return best


def tune(shape: tuple, tokens: int, space: dict) -> tuple[dict, float, float]:
    """(best config, its fused_moe microseconds, the default config's) at one shape and token count."""
    from minisgl.kernel import reference as ref
    from minisgl.kernel.triton import moe

    experts, top_k, hidden, inter = shape
    w13, w2, xs, routes = _setup(shape, tokens)
    results = []
    for block_m, (gu, dn) in candidates(space, shape, tokens).items():
        aligned = [moe.align(ids, experts, block_m) for _, ids in routes]
        acts = [moe.gate_up(xs[i], w13, top_k, aligned[i], block_m, gu[0]) for i in range(ROUTINGS)]

        def up(i, tiles, aligned=aligned, block_m=block_m):
            return moe.gate_up(xs[i], w13, top_k, aligned[i], block_m, tiles)

        def dn_(i, tiles, aligned=aligned, block_m=block_m, acts=acts):
            return moe.down(acts[i], w2, routes[i][0], aligned[i], block_m, tiles)

        gu_us, gu_best = _best(up, gu)
        dn_us, dn_best = _best(dn_, dn)
        log(f"  BLOCK_M={block_m}: gate/up {gu_us:.1f} us {gu_best}, down {dn_us:.1f} us {dn_best}")
        results.append((gu_us + dn_us, {"BLOCK_M": block_m, "gate_up": gu_best, "down": dn_best}))
    config = min(results, key=lambda r: r[0])[1]
    default = moe.default_config(experts, hidden, inter, top_k, tokens)

    def run(cfg):
        return lambda i: moe.fused_moe(xs[i], w13, w2, routes[i][0], routes[i][1], config=cfg)

    got = run(config)(0)
    want = ref.fused_moe(xs[0], w13, w2, routes[0][0], routes[0][1])
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    if not err < 1e-2:
        raise RuntimeError(f"the tuned config {config} differs from the reference: relative error {err:.2e}")
    return config, time_us(run(config), ROUTINGS), time_us(run(default), ROUTINGS)


def write(path: str, device: str, key: str, tokens: int, config: dict) -> None:
    """Merge one entry into the table file (read again first: other runs may have written to it)."""
    table = {}
    if os.path.exists(path):
        with open(path) as f:
            table = json.load(f)
    entries = table.setdefault(device, {}).setdefault(key, {})
    entries[str(tokens)] = config
    table[device][key] = dict(sorted(entries.items(), key=lambda kv: int(kv[0])))
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")


def main() -> None:
    from minisgl.kernel.triton.moe import CONFIG_FILE

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    parser.add_argument("--quick", action="store_true", help="a smaller search space (minutes, not tens)")
    parser.add_argument("--output", default=CONFIG_FILE, help="the table to write (default: the package's)")
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="compile processes")
    args = parser.parse_args()
    names = args.shapes.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}; choose from {sorted(SHAPES)}")
    tokens = [int(t) for t in args.tokens.split(",")]
    space = QUICK if args.quick else SPACE
    if not torch.cuda.is_available():
        raise SystemExit("tune_moe needs a CUDA device")
    from minisgl.kernel.triton.moe import shape_key

    device = torch.cuda.get_device_name()
    for name in names:
        shape = SHAPES[name]
        chunks = max(1, args.jobs // len(space["block_m"]))
        jobs = [(shape, space, tokens, m, i, chunks) for m in space["block_m"] for i in range(chunks)]
        log(f"{name}: compiling in {args.jobs} processes")
        ctx = torch.multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max(1, min(args.jobs, len(jobs))), mp_context=ctx) as pool:
            log(f"{name}: compiled {sum(pool.map(_compile, jobs))} kernels")
        for t in tokens:
            log(f"{name} T={t}: timing")
            config, us, default_us = tune(shape, t, space)
            write(args.output, device, shape_key(shape[0], shape[2], shape[3], shape[1]), t, config)
            log(f"{name} T={t}: {us:.1f} us (default tiles {default_us:.1f} us) -> {args.output}")


if __name__ == "__main__":
    main()
