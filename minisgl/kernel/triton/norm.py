"""RMSNorm and the fused residual add + RMSNorm, one row per program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import gdc_begin, launch_opts, pdl, rows, warps


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro,
                     N, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row per program: (with res_ptr: residual += x, then) out = w * norm(x) like reference.rms_norm."""
    gdc_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if res_ptr is not None:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # add in float32, round once to the activation dtype: what torch's residual + x does
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)  # the reference casts back before the weight multiply
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape), as reference.rms_norm."""
    shape, n = x.shape, x.shape[-1]
    x2 = rows(x)
    out = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](x2, None, weight, out, None, x2.stride(0), None, out.stride(0), None, n,
                                         eps, BLOCK=block, PDL=pdl(x), num_warps=warps(block), **launch_opts(x))
    return out.view(shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place when residual is a unit-stride 2-D view); returns (rms_norm(residual),
    residual). One pass over the row instead of three."""
    shape, n = x.shape, x.shape[-1]
    x2 = rows(x)
    r2 = rows(residual)
    out = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, r2, x2.stride(0), r2.stride(0), out.stride(0),
                                         r2.stride(0), n, eps, BLOCK=block, PDL=pdl(x), num_warps=warps(block),
                                         **launch_opts(x))
    return out.view(shape), r2.view(shape)
