"""Would two half-batches overlapped beat one batch on a GPU? A W1 decode step at batch 256 spends ~77% of
its time in decode attention, which is bound by the K/V bytes it reads, and most of the rest in the
layer's dense kernels (RMSNorm, the four projections, SiLU-and-mul), which at 256 rows run far below their
weights' bytes (docs/BENCHMARKS.md, the per-kernel tables). Split the batch in two halves A and B, and
each half-layer runs A's attention on one stream beside B's dense kernels on another: if the dense
kernels fit beside the attention's loads, the layer costs two attentions of half the batch plus what the
dense kernels take from its bandwidth, instead of attention plus dense at the whole batch.

python -m minisgl.benchmark.overlap --batch 256 --context 600 [--min-context 100]

Times, as CUDA graphs of --repeat layers (Qwen3-0.6B shapes, bf16, the engine's kernels): the attention
(store, split, merge) and the dense kernels of a layer at the whole batch and at half, each alone, and the
half-batch attention beside the half-batch dense kernels on two streams. Prints microseconds per layer:
serial = attention + dense at the whole batch; overlapped = twice the pair."""

from __future__ import annotations

import argparse

import torch

from minisgl import kernel
from minisgl.attention.triton_backend import TritonAttnBackend
from minisgl.benchmark.attn_decode import HEAD_DIM, HEADS, KV_HEADS, _layer, _setup
from minisgl.benchmark.gemm import _time

HIDDEN, INTER = 1024, 3072


def _weights(device: torch.device) -> dict[str, torch.Tensor]:
    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, dtype=torch.bfloat16, device=device) / k**0.5

    return {
        "qkv": w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
        "o": w(HIDDEN, HEADS * HEAD_DIM),
        "gate_up": w(2 * INTER, HIDDEN),
        "down": w(HIDDEN, INTER),
        "norm": torch.ones(HIDDEN, dtype=torch.bfloat16, device=device),
    }


def _dense(w: dict[str, torch.Tensor], x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """A layer's kernels other than attention, at x's rows: o, add + norm, gate/up, SiLU-and-mul, down,
    add + norm, the next QKV (the order they run in between two attentions)."""
    h = kernel.linear(attn, w["o"], None)
    normed, res = kernel.fused_add_rms_norm(h, x, w["norm"], 1e-6)
    y = kernel.linear(kernel.silu_and_mul(kernel.linear(normed, w["gate_up"], None)), w["down"], None)
    normed, _ = kernel.fused_add_rms_norm(y, res, w["norm"], 1e-6)
    return kernel.linear(normed, w["qkv"], None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--min-context", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    lo = args.context if args.min_context is None else args.min_context
    lens = torch.randint(lo, args.context + 1, (args.batch,), generator=gen).tolist()
    half = args.batch // 2
    w = _weights(device)

    def attention(rows: list[int]):
        cfg, pool, table, batch = _setup(rows, device, torch.bfloat16)
        backend = TritonAttnBackend(cfg, pool, table)
        backend.prepare_metadata(batch)
        n = len(rows)
        q = torch.randn(n, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
        k = torch.randn(n, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
        v = torch.randn_like(k)
        return lambda i: _layer(backend, q, k, v, i % 4, batch)

    def dense(n: int):
        x = torch.randn(n, HIDDEN, dtype=torch.bfloat16, device=device)
        attn = torch.randn(n, HEADS * HEAD_DIM, dtype=torch.bfloat16, device=device)
        return lambda i: _dense(w, x, attn)

    attn_all, dense_all = attention(lens), dense(args.batch)
    attn_a, dense_b = attention(lens[:half]), dense(args.batch - half)
    side = torch.cuda.Stream(device)

    def pair(i: int) -> None:
        main_stream = torch.cuda.current_stream(device)
        side.wait_stream(main_stream)
        attn_a(i)
        with torch.cuda.stream(side):
            dense_b(i)
        main_stream.wait_stream(side)

    t = {
        "attention, whole batch": _time(attn_all, args.repeat),
        "dense, whole batch": _time(dense_all, args.repeat),
        "attention, half": _time(attn_a, args.repeat),
        "dense, half": _time(dense_b, args.repeat),
        "half attention beside half dense": _time(pair, args.repeat),
    }
    for name, us in t.items():
        print(f"{name}: {us:.1f} us a layer", flush=True)
    serial = t["attention, whole batch"] + t["dense, whole batch"]
    overlapped = 2 * t["half attention beside half dense"]
    print(
        f"batch {args.batch} x {lo}..{args.context} keys: serial {serial:.1f} us a layer, two halves "
        f"overlapped {overlapped:.1f} us ({serial / overlapped:.2f}x)",
        flush=True,
    )


if __name__ == "__main__":
    main()
