"""The stored-weight kernels: y = x W^T and embedding rows for a gguf.stored.StoredWeight, by the C kernels
of kernel/cpu/ (each block dequantized in registers with the reference arithmetic of gguf/blocks.py);
the reference (dequantize, then the float op) where the kernels are not built or do not read a type."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.gguf.stored import StoredPart, StoredWeight

from . import cpu


def _kernel_ok(w: StoredWeight) -> bool:
    ok = getattr(w, "_kernel_ok", None)  # asked once per weight: a decode step makes ~120 calls
    if ok is None:
        ok = w._kernel_ok = cpu.available() and all(cpu.stored_type_supported(p.ggml_type) for p in w.parts)
    return ok


def linear(x: torch.Tensor, w: StoredWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) for float32 x [..., K] on a CPU."""
    if not _kernel_ok(w):
        return F.linear(x, w.dequantize(), bias)
    if x.dtype != torch.float32:  # the kernels compute in float32: round once at the end
        return linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape[0], w.shape[0], dtype=torch.float32)
    int8 = w.dot == "int8" and x2.shape[1] % 32 == 0

    def kernel(p: StoredPart):  # the int8 dot for the parts it reads, the exact one otherwise
        return cpu.linear_stored_q8 if int8 and cpu.int8_dot_supported(p.ggml_type) else cpu.linear_stored

    if len(w.parts) == 1:
        p = w.parts[0]
        kernel(p)(x2, p.ggml_type, p.data, bias, y)
        return y.view(*x.shape[:-1], w.shape[0])
    off = 0
    for p in w.parts:
        b = None if bias is None else bias[off : off + p.n].contiguous()
        kernel(p)(x2, p.ggml_type, p.data, b, y[:, off : off + p.n])
        off += p.n
    return y.view(*x.shape[:-1], w.shape[0])


def embedding(ids: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    """Rows `ids` of W, dequantized on lookup."""
    if len(w.parts) != 1 or not _kernel_ok(w):
        return F.embedding(ids, w.dequantize())
    p = w.parts[0]
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= p.n):
        raise IndexError(f"token id out of range of the {p.n}-row embedding")
    out = cpu.dequant_rows(p.ggml_type, p.data, p.k, flat, flat.numel())
    return out.view(*ids.shape, p.k)
