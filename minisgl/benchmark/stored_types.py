"""Time the stored-weight GEMM for every GGUF block type the CPU kernels read, at the layer shapes of a 1B
Llama (hidden 2048, intermediate 8192: rows whose K-quant blocks are whole), for the rows of x given: the
exact dot, or with --dot int8 the int8-activation dot where the build has it for the type (exact
otherwise, marked "(exact)").

python -m minisgl.benchmark.stored_types [--types Q4_0,Q4_K,Q6_K] [--rows 1,3,16] [--layers 4] [--repeat 7]
    [--dot exact|int8]
Each layer has its own random blocks (fp16 scales 0.01), so a step streams them from memory as a real one
does; the median of --repeat steps is printed per type and row count: ms a step, the block bytes read per
second, and weights per second (N x K x layers / time)."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from minisgl.gguf.blocks import SCALE_OFFSETS, STORED_TYPES, TYPE_IDS
from minisgl.gguf.stored import STORED_DOTS, StoredPart, StoredWeight
from minisgl.kernel import cpu as cpu_kernels
from minisgl.kernel import stored

HIDDEN, INTER = 2048, 8192
SHAPES = [(3072, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # QKV, O, gate|up, down
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]


def random_layers(name: str, layers: int, seed: int = 0, dot: str = "exact") -> list[list[StoredWeight]]:
    t = TYPE_IDS[name]
    _, qk, nbytes = STORED_TYPES[t]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(layers):
        layer = []
        for n, k in SHAPES:
            blocks = rng.integers(0, 256, size=(n * k // qk, nbytes), dtype=np.uint8)
            for off in SCALE_OFFSETS[name]:
                blocks[:, off : off + 2] = np.full((len(blocks), 1), 0.01, np.float16).view(np.uint8)
            data = torch.from_numpy(blocks.reshape(n, -1))
            w = StoredWeight([StoredPart(t, data, n, k)])
            w.dot = dot
            layer.append(w)
        out.append(layer)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(TYPES), help="block types, comma-separated")
    ap.add_argument("--rows", default="1,3,16", help="rows of x, comma-separated")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--dot", choices=STORED_DOTS, default="exact", help="how the weights multiply")
    args = ap.parse_args(argv)
    assert cpu_kernels.available(), "CPU kernels unavailable"
    rows_list = [int(r) for r in args.rows.split(",")]
    for name in args.types.split(","):
        layers = random_layers(name, args.layers, dot=args.dot)
        nbytes = sum(w.nbytes for layer in layers for w in layer)
        weights = sum(n * k for n, k in SHAPES) * args.layers
        exact = args.dot == "int8" and not cpu_kernels.int8_dot_supported(TYPE_IDS[name])
        line = [f"{name:5s}" + (" (exact)" if exact else "")]
        for rows in rows_list:
            xs = {k: torch.randn(rows, k) for k in (HIDDEN, INTER)}
            times = []
            for _ in range(args.repeat + 1):  # the first warms the caches of the stored weights' wrappers
                t0 = time.perf_counter()
                for layer in layers:
                    for (_, k), w in zip(SHAPES, layer):
                        stored.linear(xs[k], w)
                times.append(time.perf_counter() - t0)
            med = statistics.median(times[1:])
            line.append(
                f"| {rows} row(s): {med * 1e3:7.2f} ms, {nbytes / med / 1e9:5.1f} GB/s, "
                f"{weights * rows / med / 1e9:6.2f} G weight-rows/s"
            )
        print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
