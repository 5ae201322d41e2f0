"""Time the Triton split-KV decode attention alone at Qwen3-0.6B's heads (16 query, 8 KV, head_dim 128,
bf16 queries), over a pool whose slots are randomly permuted (decode tokens of many requests interleave in
the pool), for a few launch configurations.

python -m minisgl.benchmark.attn_decode --batch 64 --context 1500
python -m minisgl.benchmark.attn_decode --batch 256 --min-context 100 --context 2048 [--longest-first]
python -m minisgl.benchmark.attn_decode --batch 256 --context 600 --kv-dtype bf16,fp8_e4m3 --configs 64:4:3:4,32:1:3:3
(--min-context: lengths uniform in [min, context], in random order or longest first, as the scheduler
orders decode batches; --configs: BLOCK_N:warps:stages with several splits:stages with one[:programs an
SM the split count aims for, the backend's where left out].) Prints
microseconds per layer (one layer = one store + split + merge, timed as a CUDA graph of --repeat layers)
and the K/V bytes read per second."""

from __future__ import annotations

import argparse

import torch

from minisgl.attention.base import AttnConfig
from minisgl.attention.triton_backend import TritonAttnBackend
from minisgl.core import Batch, Phase, Req, SamplingParams
from minisgl.kernel import SplitAttention
from minisgl.kvcache.pool import KVPool

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 8, 128, 4
# BLOCK_N:num_warps:stages with several splits:stages with one, to compare
CONFIGS = "32:1:3:3,32:1:4:4,64:2:4:4,64:4:3:4,128:8:3:3"
KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}


def _setup(lens: list[int], device: torch.device, kv_dtype: torch.dtype):
    bs, total = len(lens), sum(lens)
    pool = KVPool(LAYERS, total + 16, 1, KV_HEADS, HEAD_DIM, kv_dtype, device)
    for buf in (pool.k_buffer, pool.v_buffer):
        buf.copy_(torch.randn(buf.shape, dtype=torch.bfloat16, device=device))
    max_seq = max(4096, max(lens))
    table = torch.zeros(bs + 1, max_seq, dtype=torch.int32, device=device)
    slots = torch.randperm(total, device=device).to(torch.int32).split(lens)
    for i, s in enumerate(slots):
        table[i, : len(s)] = s
    batch = Batch(
        [Req(i, [0], SamplingParams()) for i in range(bs)],
        Phase.DECODE,
        [n - 1 for n in lens],
        [1] * bs,
        [True] * bs,
    )
    batch.table_idx = torch.arange(bs, dtype=torch.int32, device=device)
    batch.seq_lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    batch.out_loc = torch.stack([s[-1] for s in slots])
    return AttnConfig(HEADS, KV_HEADS, HEAD_DIM, max_seq, device, torch.bfloat16), pool, table, batch


def _layer(
    backend: TritonAttnBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: Batch
) -> torch.Tensor:
    """One layer's store, split and merge (at one request the fusion plan leaves the merge to the output
    projection: it runs here instead)."""
    out = backend.forward(q, k, v, layer, batch)
    return out.merge() if isinstance(out, SplitAttention) else out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--min-context", type=int, default=None, help="lengths uniform in [this, --context]")
    ap.add_argument("--longest-first", action="store_true", help="order the batch by length, longest first")
    ap.add_argument("--kv-dtype", default="bf16", help="comma-separated pool dtypes: bf16, fp8_e4m3")
    ap.add_argument(
        "--configs",
        default=CONFIGS,
        help="comma-separated BLOCK_N:warps:stages:stages-at-one-split[:programs an SM]",
    )
    args = ap.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    lo = args.context if args.min_context is None else args.min_context
    lens = torch.randint(lo, args.context + 1, (args.batch,), generator=gen).tolist()
    if args.longest_first:
        lens.sort(reverse=True)
    q = torch.randn(args.batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    k = torch.randn(args.batch, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    for kv_name in args.kv_dtype.split(","):
        kv_dtype = KV_DTYPES[kv_name]
        cfg, pool, table, batch = _setup(lens, device, kv_dtype)
        gb = sum(lens) * KV_HEADS * HEAD_DIM * 2 * kv_dtype.itemsize / 1e9
        for config in configs:
            backend = TritonAttnBackend(cfg, pool, table)
            block_n, warps, several, one, waves = (config + backend.decode_tiles[0][len(config) :])[:5]
            backend.decode_tiles = ((block_n, warps, several, one, waves),) * 2
            backend.prepare_metadata(batch)
            for i in range(3):
                _layer(backend, q, k, v, i % LAYERS, batch)
            # one CUDA graph of `repeat` layers: device time alone, as in a decode graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(args.repeat):
                    _layer(backend, q, k, v, i % LAYERS, batch)
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) / args.repeat * 1e3
            print(
                f"batch {args.batch} x {lo}..{args.context} keys, {kv_name} pool, "
                f"{batch.attn_metadata.num_splits} splits ({waves} programs an SM), BLOCK_N {block_n}, "
                f"{warps} warps, stages {several}/{one}: {us:.1f} us a layer ({gb / us * 1e3:.2f} TB/s of K/V)",
                flush=True,
            )


if __name__ == "__main__":
    main()
