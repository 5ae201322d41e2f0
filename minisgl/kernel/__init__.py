"""Kernels: each op has a torch reference (kernel/reference.py) and may have a Triton version.

The Triton versions are used on CUDA tensors when Triton is importable; everything else takes the
reference path. `use_triton(False)` forces the reference (the tests compare the two).
"""

from __future__ import annotations

from typing import Tuple

import torch

from . import reference as ref

_TRITON_ENABLED = True


def use_triton(enabled: bool) -> None:
    global _TRITON_ENABLED
    _TRITON_ENABLED = enabled


def _triton_ops():
    """The Triton module, or None when the tensors are on a CPU or Triton is missing."""
    if not _TRITON_ENABLED:
        return None
    try:
        from . import triton_ops
    except ImportError:
        return None
    return triton_ops


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ops = _triton_ops() if _on_gpu(x) else None
    if ops is not None and hasattr(ops, "rms_norm"):
        return ops.rms_norm(x, weight, eps)
    return ref.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    ops = _triton_ops() if _on_gpu(x) else None
    if ops is not None and hasattr(ops, "fused_add_rms_norm"):
        return ops.fused_add_rms_norm(x, residual, weight, eps)
    return ref.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    ops = _triton_ops() if _on_gpu(x) else None
    if ops is not None and hasattr(ops, "silu_and_mul"):
        return ops.silu_and_mul(x)
    return ref.silu_and_mul(x)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    ops = _triton_ops() if _on_gpu(q) else None
    if ops is not None and hasattr(ops, "apply_rotary"):
        return ops.apply_rotary(q, k, positions, cos_sin_cache)
    return ref.apply_rotary(q, k, positions, cos_sin_cache)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, out_loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    ops = _triton_ops() if _on_gpu(k) else None
    if ops is not None and hasattr(ops, "store_kv"):
        return ops.store_kv(k_cache, v_cache, out_loc, k, v)
    return ref.store_kv(k_cache, v_cache, out_loc, k, v)
