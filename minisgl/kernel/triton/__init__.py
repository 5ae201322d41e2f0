"""Triton versions of the ops in kernel/reference.py (same signatures), one module per op family, plus the
paged attention kernels of the Triton attention backend.

| module | holds |
| --- | --- |
| launch | programmatic dependent launch and the launch helpers every kernel shares |
| norm | RMSNorm, fused residual add + RMSNorm |
| activation | SiLU-and-mul |
| rotary | rotary (optionally after Qwen3's q/k norm, optionally storing K/V), the KV store |
| gemv | one-row projections: plain, gated, pre-norm, split-merging |
| gemm | 2..16-row projections: plain, gated, pre-norm |
| argmax | the greedy token over the vocabulary |
| sampling | temperature, min-p, top-k, top-p and seeded noise for a batch, one program per row |
| attention | split-KV paged decode and its merge, prefill/extend |
| layer | a whole decoder layer of a one-request decode step in one launch (grid barriers between stages) |
| moe | mixture-of-experts routing and the fused experts (align, grouped GEMMs, sum); tiles in moe_configs.json |

kernel/__init__.py calls the ops below for CUDA tensors; importing this package fails where Triton is
missing, and the callers then take the torch reference."""

from .activation import silu_and_mul
from .argmax import argmax
from .gemm import gemm, gemm_add_rms_norm, gemm_fits
from .gemv import gemv, gemv_add_rms_norm, gemv_fits, gemv_merge_fits, gemv_merged
from .launch import launch_opts, pdl
from .layer import decode_layer, layer_fits
from .moe import fused_moe, moe_route
from .norm import fused_add_rms_norm, rms_norm
from .rotary import apply_rotary, qk_norm_rotary, store_kv
from .sampling import sample

__all__ = [
    "apply_rotary",
    "argmax",
    "decode_layer",
    "fused_add_rms_norm",
    "fused_moe",
    "gemm",
    "gemm_add_rms_norm",
    "gemm_fits",
    "gemv",
    "gemv_add_rms_norm",
    "gemv_fits",
    "gemv_merge_fits",
    "gemv_merged",
    "launch_opts",
    "layer_fits",
    "moe_route",
    "pdl",
    "qk_norm_rotary",
    "rms_norm",
    "sample",
    "silu_and_mul",
    "store_kv",
]
