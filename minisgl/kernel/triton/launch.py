"""What every Triton kernel here shares: programmatic dependent launch and the shape helpers of the launches.

The kernels also run on CPU tensors under TRITON_INTERPRET=1 (set before Triton is imported), which is how
the CPU tests check them against kernel/reference.py.

Every kernel accepts a unit stride on the last dimension and any stride on the others, so the q/k/v views
that come out of the fused QKV projection need no copy. An input a launch does not have (no bias, no
residual, no fused rotary) is passed as None: Triton compiles a variant without it, so no kernel reads a
placeholder.

On Hopper and newer GPUs the kernels launch with programmatic dependent launch (PDL): a kernel may start
while the one before it is still running, and waits for it (`gdc_begin`) before it touches anything that
kernel may write; only reads of weights come before the wait. The next kernel's launch is released right
after the wait, so at most two kernels overlap and every kernel still sees all earlier ones complete.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from minisgl.env import ENV


@functools.cache
def _pdl_on(index: int) -> bool:
    cuda_lang = getattr(tl.extra, "cuda", None)
    return (ENV.pdl and torch.cuda.get_device_capability(index)[0] >= 9
            and hasattr(cuda_lang, "gdc_wait") and hasattr(cuda_lang, "gdc_launch_dependents"))


def pdl(x: torch.Tensor) -> bool:
    """Whether kernels on x's device launch with programmatic dependent launch."""
    return x.is_cuda and _pdl_on(x.device.index if x.device.index is not None else torch.cuda.current_device())


def launch_opts(x: torch.Tensor) -> dict:
    """Extra launch arguments for a kernel whose tensors live on x's device."""
    return {"launch_pdl": True} if pdl(x) else {}


@triton.jit
def gdc_begin(PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its writes are visible, then let the next kernel
    launch. A no-op without PDL; every PDL kernel calls it before its first dependent access."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, last] tensor with a unit last stride (a view whenever possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def warps(block: int) -> int:
    """More warps for wide rows so each thread keeps a handful of elements in registers."""
    return max(1, min(16, block // 256))


def half_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x is 2-D half-precision activations with unit last stride, W row-major in the same dtype."""
    return (x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.stride(-1) == 1 and weight.stride(-1) == 1)
