"""Time the Triton prefill/extend attention alone at Qwen3-0.6B's heads (16 query, 8 KV, head_dim 128, bf16)
for a few tilings, each checked against the torch backend on the same inputs.

python -m minisgl.benchmark.attn_extend
Cases: 16 prompts x 512 tokens, 8 x 1,024, and 4 chunks of 512 tokens on 1,536 cached ones; each request's
slots are contiguous in the pool (as a fresh prefill allocates them). Prints microseconds per layer."""

from __future__ import annotations

import argparse

import torch

from minisgl.attention.base import AttnConfig
from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.attention.triton_backend import TritonAttnBackend
from minisgl.core import Batch, Phase, Req, SamplingParams
from minisgl.kvcache.pool import KVPool

HEADS, KV_HEADS, HEAD_DIM, MAX_SEQ = 16, 8, 128, 4096
CASES = [(16, 512, 0), (8, 1024, 0), (4, 512, 1536)]  # (requests, new tokens each, cached tokens each)
# (BLOCK_M, BLOCK_N, num_warps, num_stages) to compare
CONFIGS = [
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (64, 128, 4, 2),
    (128, 64, 4, 2),
    (128, 32, 4, 3),
    (64, 32, 4, 4),
]


def _setup(reqs: int, new: int, cached: int, device: torch.device):
    n = new + cached
    pool = KVPool(1, reqs * n + 16, 1, KV_HEADS, HEAD_DIM, torch.bfloat16, device)
    pool.k_buffer.normal_()
    pool.v_buffer.normal_()
    table = torch.zeros(reqs + 1, MAX_SEQ, dtype=torch.int32, device=device)
    table[:reqs, :n] = torch.arange(reqs * n, dtype=torch.int32, device=device).view(reqs, n)
    batch = Batch(
        [Req(i, [0], SamplingParams()) for i in range(reqs)],
        Phase.PREFILL,
        [cached] * reqs,
        [new] * reqs,
        [True] * reqs,
    )
    batch.table_idx = torch.arange(reqs, dtype=torch.int32, device=device)
    batch.seq_lens_t = torch.full((reqs,), n, dtype=torch.int32, device=device)
    batch.out_loc = table[:reqs, cached:n].reshape(-1).contiguous()
    batch.positions = torch.arange(cached, n, device=device).repeat(reqs)
    return AttnConfig(HEADS, KV_HEADS, HEAD_DIM, MAX_SEQ, device, torch.bfloat16), pool, table, batch


def _extend(backend: TritonAttnBackend, q: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The extend kernel alone: k/v None, the new K/V are in the pool already."""
    return backend.forward(q, None, None, 0, batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    device = torch.device("cuda")
    totals = dict.fromkeys(CONFIGS, 0.0)
    for case in CASES:
        cfg, pool, table, batch = _setup(*case, device)
        q = torch.randn(batch.num_tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
        reference = TorchAttnBackend(cfg, pool, table)
        reference.prepare_metadata(batch)
        want = reference.forward(q, None, None, 0, batch).float()
        for block_m, block_n, warps, stages in CONFIGS:
            backend = TritonAttnBackend(cfg, pool, table)
            backend.extend_blocks = (block_m, block_n)
            backend.extend_launch = {"num_warps": warps, "num_stages": stages}
            backend.prepare_metadata(batch)
            err = ((_extend(backend, q, batch).float() - want).norm() / want.norm()).item()
            for _ in range(3):
                _extend(backend, q, batch)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.repeat):
                _extend(backend, q, batch)
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) / args.repeat * 1e3
            totals[(block_m, block_n, warps, stages)] += us if err < 1e-2 else float("inf")
            print(
                f"{case[0]} x {case[1]} new on {case[2]} cached; tiles {block_m}x{block_n}, {warps} warps, "
                f"{stages} stages: {us:.1f} us a layer, relative error {err:.1e}"
                + ("" if err < 1e-2 else " WRONG")
            )
    best = min(totals, key=totals.get)
    print(f"fastest over all cases: tiles {best[0]}x{best[1]}, {best[2]} warps, {best[3]} stages")


if __name__ == "__main__":
    main()
