"""Time one CPU decode step's stored-weight GEMVs, the exact dot against the int8-activation dot
(`--stored-dot int8`), at the default model's shapes (SmolLM2-135M: 30 layers of QKV 960 x 576, O 576 x 576,
gate|up 3072 x 576, down 576 x 1536) for the rows of x given: decode batches (1-64), or a prefill's
GEMMs (hundreds: the int8 dot's panel GEMM from 10 rows on AVX-512 VNNI).

python -m minisgl.benchmark.stored_dot [--type Q4_1] [--rows 1,3,6,16,32] [--threads 2] [--repeat 15]
Every layer has its own weights (random blocks with small fp16 scales, 66 MB in Q4_1), so a step streams
them from memory as a real one does; the two kernels alternate, and the median of --repeat steps is
printed (ms a step, and the weight bytes read per second)."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from minisgl.gguf.blocks import STORED_TYPES, TYPE_IDS
from minisgl.kernel import cpu as cpu_kernels

LAYERS, HIDDEN, INTER, QKV = 30, 576, 1536, 960
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # (N, K) per projection


def random_weights(name: str, seed: int = 0) -> list[list[torch.Tensor]]:
    """LAYERS x SHAPES stored weights of type `name`: random quants, fp16 scales (and minimums) 0.01."""
    t = TYPE_IDS[name]
    _, qk, nbytes = STORED_TYPES[t]
    rng = np.random.default_rng(seed)
    scales = 2 if name == "Q4_1" else 1
    layers = []
    for _ in range(LAYERS):
        layer = []
        for n, k in SHAPES:
            blocks = rng.integers(0, 256, size=(n * k // qk, nbytes), dtype=np.uint8)
            blocks[:, : 2 * scales] = np.full((len(blocks), scales), 0.01, np.float16).view(np.uint8)
            layer.append(torch.from_numpy(blocks.reshape(n, -1)))
        layers.append(layer)
    return layers


def time_step(kernel, weights, ggml_type: int, rows: int, threads: int) -> float:
    """Seconds for one step's GEMVs through `kernel` (the C entry point, called directly)."""
    xs = {k: torch.randn(rows, k) for k in (HIDDEN, INTER)}
    ys = {n: torch.empty(rows, n) for n, _ in SHAPES}
    t0 = time.perf_counter()
    for layer in weights:
        for (n, k), w in zip(SHAPES, layer):
            x, y = xs[k], ys[n]
            kernel(
                x.data_ptr(),
                k,
                w.data_ptr(),
                ggml_type,
                w.stride(0),
                None,
                y.data_ptr(),
                n,
                rows,
                n,
                k,
                threads,
            )
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--type", default="Q4_1", choices=["Q4_0", "Q4_1", "Q8_0"])
    ap.add_argument("--rows", default="1,3,6,16,32", help="rows of x (decode requests), comma-separated")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args(argv)
    lib = cpu_kernels._load()
    assert lib is not None, "CPU kernels unavailable"
    weights = random_weights(args.type)
    t = TYPE_IDS[args.type]
    nbytes = sum(w.numel() for layer in weights for w in layer)
    kernels = {"exact": lib.linear_stored, "int8": lib.linear_stored_q8}
    for rows in (int(r) for r in args.rows.split(",")):
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(args.repeat):
            for name, kernel in kernels.items():
                times[name].append(time_step(kernel, weights, t, rows, args.threads))
        line = [f"{args.type}, {rows} row(s), {args.threads} threads:"]
        for name, ts in times.items():
            med = statistics.median(ts)
            line.append(f"{name} {med * 1e3:.2f} ms ({nbytes / med / 1e9:.1f} GB/s)")
        print(" ".join(line))


if __name__ == "__main__":
    main()
