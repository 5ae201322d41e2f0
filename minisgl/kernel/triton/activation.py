"""SiLU-and-mul of a gated MLP, and the rounding of it that the GEMV and GEMM prologues share."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import gdc_begin, launch_opts, pdl, rows


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in up's dtype, rounding where the reference does (silu(gate) before the multiply)."""
    g = gate.to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(up.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(up.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    gdc_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, silu_mul(gate, up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    n = x.shape[-1] // 2
    x2 = rows(x)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(n))
        grid = (x2.shape[0], triton.cdiv(n, block))
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), n, BLOCK=block, PDL=pdl(x), num_warps=4,
                                   **launch_opts(x))
    return out.view(*x.shape[:-1], n)
