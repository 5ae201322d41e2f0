"""Weights kept as stored in a GGUF file (quantized blocks, or half precision) and multiplied by the C
kernels of kernel/cpu.py, which dequantize each block in registers: the bytes read per decode step are
the file's (Q4_1: 0.625 byte a weight instead of float32's 4).

`dequantize` is the torch reference (the same arithmetic as gguf.quants, tested against it); the C
kernels must equal it, and callers fall back to it where the kernels are not built."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu

# GGML type id -> (name, elements per block, bytes per block)
STORED_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    20: ("IQ4_NL", 32, 18),
    23: ("IQ4_XS", 256, 136),
    30: ("BF16", 1, 2),
}
TYPE_IDS = {name: t for t, (name, _, _) in STORED_TYPES.items()}
# where a block of each quantized type keeps its fp16 scales (byte offsets; the rest is quants and packed
# sub-block scales): what a random block (tests, benchmarks) must set to keep its values finite and small
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82)}
SCALE_OFFSETS |= {
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}
# IQ4_NL / IQ4_XS: each 4-bit index stands for one of these (ggml's kvalues_iq4nl), times the scale
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
STORED_DOTS = ("exact", "int8")  # StoredWeight.dot, set from EngineConfig.stored_dot


def row_bytes(ggml_type: int, k: int) -> int:
    _, qk, nbytes = STORED_TYPES[ggml_type]
    if k % qk:
        raise ValueError(f"a {STORED_TYPES[ggml_type][0]} row of {k} values is not whole blocks of {qk}")
    return k // qk * nbytes


@dataclass
class StoredPart:
    """Rows [n, k] of one type: `data` is uint8 [n, row_bytes] (the file's blocks, row-major)."""

    ggml_type: int
    data: torch.Tensor
    n: int
    k: int

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.ggml_type, self.data, self.k)


class StoredWeight:
    """A weight matrix [N, K] held as stored: one part, or several stacked along N (a merged QKV whose
    parts differ in type); used in place of a float Parameter by the linear and embedding layers.

    `dot` is how `linear` multiplies it: "exact" (the default) dequantizes each block with the reference
    arithmetic; "int8" (the engine's --stored-dot int8) quantizes the activations to int8 blocks of 32 for
    the Q4_0/Q4_1/Q8_0 parts where K is a multiple of 32, and Q4_K/Q5_K/Q6_K on CPUs with AVX-512 VNNI
    (cpu.int8_dot_supported; llama.cpp's kind of arithmetic, approximate); the other parts stay exact."""

    def __init__(self, parts: list[StoredPart]) -> None:
        assert parts and all(p.k == parts[0].k for p in parts)
        self.parts = parts
        self.dot = "exact"
        self.shape = torch.Size([sum(p.n for p in parts), parts[0].k])
        self.dtype = torch.float32  # what it computes in
        self.device = torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def __repr__(self) -> str:
        types = "+".join(STORED_TYPES[p.ggml_type][0] for p in self.parts)
        return f"StoredWeight({types}, {tuple(self.shape)})"


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


def held_by(module: torch.nn.Module) -> list[StoredWeight]:
    """The StoredWeights a module holds itself: its weight, or an MoE layer's experts (moe.Experts.stored:
    per expert gate | up and down)."""
    w = module.__dict__.get("weight")
    held = [w] if isinstance(w, StoredWeight) else []
    experts = module.__dict__.get("stored")
    return held + [w for ws in experts for w in ws] if experts else held


def set_dot(model: torch.nn.Module, dot: str) -> int:
    """Every StoredWeight of the model multiplies by `dot` (STORED_DOTS) from now on; returns how many
    weights that is (a tied embedding and LM head count once)."""
    if dot not in STORED_DOTS:
        raise ValueError(f"stored dot {dot!r} is not one of {STORED_DOTS}")
    seen: set[int] = set()
    for module in model.modules():
        for w in held_by(module):
            if id(w) not in seen:
                seen.add(id(w))
                w.dot = dot
    return len(seen)


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


# ---- the reference dequantization (gguf.quants' arithmetic, in torch) -----------------------------------


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian halves -> float32 [...]."""
    return b.contiguous().view(torch.float16).float().squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16*j] bytes -> [..., 32*j] values: each run of bytes' low nibbles, then its high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 packed bytes -> 8 six-bit scales and 8 six-bit minimums (ggml's get_scale_min_k4)."""
    sc = sc.to(torch.int32)
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = torch.cat([d & 63, (md & 0x0F) | ((d >> 6) << 4)], dim=-1)
    mins = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _bits(b: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 [nb, n / 8] -> int32 [nb, n]: bit i of the little-endian bytes at i."""
    shifts = torch.arange(8, dtype=torch.int32)
    return ((b.to(torch.int32).unsqueeze(-1) >> shifts) & 1).reshape(b.shape[0], n)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K's 2-bit quants: [nb, 64] bytes -> int32 [nb, 256], each half of 32 bytes giving its 32
    bytes' bits 0-1, then 2-3, 4-5, 6-7."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(1, 1, 4, 1)
    return ((qs.to(torch.int32).reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 256)


def _q5(b: torch.Tensor, off: int) -> torch.Tensor:
    """Q5_0/Q5_1's 32 five-bit values a block: nibbles at off + 4, the fifth bits in the word at off."""
    return _nibbles(b[:, off + 4 :]).to(torch.int32) | (_bits(b[:, off : off + 4], 32) << 4)


def _deq_blocks(ggml_type: int, b: torch.Tensor) -> torch.Tensor:
    """Blocks uint8 [nb, bytes] -> float32 [nb, qk]."""
    nb = b.shape[0]
    if ggml_type == 6:  # Q5_0
        return _f16(b[:, 0:2]).unsqueeze(1) * (_q5(b, 2) - 16).float()
    if ggml_type == 7:  # Q5_1
        return _f16(b[:, 0:2]).unsqueeze(1) * _q5(b, 4).float() + _f16(b[:, 2:4]).unsqueeze(1)
    if ggml_type == 10:  # Q2_K: 16 sub-blocks of 16, a 4-bit scale and minimum each
        sc = b[:, 0:16].to(torch.int32)
        d, dmin = _f16(b[:, 80:82]).unsqueeze(1), _f16(b[:, 82:84]).unsqueeze(1)
        dl, ml = (d * (sc & 0xF).float()).unsqueeze(-1), (dmin * (sc >> 4).float()).unsqueeze(-1)
        return (dl * _crumbs(b[:, 16:80]).reshape(nb, 16, 16).float() - ml).reshape(nb, 256)
    if ggml_type == 11:  # Q3_K: 2-bit quants, minus 4 where the high-bit mask is clear; 6-bit scales
        sc = b[:, 96:108].to(torch.int32)
        lo = (sc[:, 0:8].unsqueeze(1) >> torch.tensor([0, 4]).view(1, 2, 1)).reshape(nb, 16) & 0xF
        hi = (sc[:, 8:12].unsqueeze(1) >> torch.tensor([0, 2, 4, 6]).view(1, 4, 1)).reshape(nb, 16) & 3
        dl = _f16(b[:, 108:110]).unsqueeze(1) * ((lo | (hi << 4)) - 32).float()
        high = (
            _bits(b[:, 0:32], 256).reshape(nb, 32, 8).transpose(1, 2).reshape(nb, 256)
        )  # value e: byte e % 32
        q = _crumbs(b[:, 32:96]) - 4 * (1 - high)
        return (dl.unsqueeze(-1) * q.reshape(nb, 16, 16).float()).reshape(nb, 256)
    if ggml_type == 13:  # Q5_K: Q4_K with a fifth bit a value (sub-block j's in bit j of qh's bytes)
        d, dmin = _f16(b[:, 0:2]).unsqueeze(1), _f16(b[:, 2:4]).unsqueeze(1)
        scales, mins = _scale_min_k4(b[:, 4:16])
        high = _bits(b[:, 16:48], 256).reshape(nb, 32, 8).transpose(1, 2)  # [nb, 8 sub-blocks, 32]
        q = (_nibbles(b[:, 48:].reshape(nb, 4, 32)).reshape(nb, 8, 32).to(torch.int32) | (high << 4)).float()
        return ((d * scales).unsqueeze(-1) * q - (dmin * mins).unsqueeze(-1)).reshape(nb, 256)
    if ggml_type == 2:  # Q4_0
        return _f16(b[:, 0:2]).unsqueeze(1) * (_nibbles(b[:, 2:]).to(torch.int32) - 8).float()
    if ggml_type == 3:  # Q4_1
        d, m = _f16(b[:, 0:2]).unsqueeze(1), _f16(b[:, 2:4]).unsqueeze(1)
        return d * _nibbles(b[:, 4:]).float() + m
    if ggml_type == 8:  # Q8_0
        return _f16(b[:, 0:2]).unsqueeze(1) * b[:, 2:].contiguous().view(torch.int8).float()
    if ggml_type == 12:  # Q4_K: 4 runs of 32 bytes, each two sub-blocks of 32
        d, dmin = _f16(b[:, 0:2]).unsqueeze(1), _f16(b[:, 2:4]).unsqueeze(1)
        scales, mins = _scale_min_k4(b[:, 4:16])
        q = _nibbles(b[:, 16:].reshape(nb, 4, 32)).reshape(nb, 8, 32).float()
        return ((d * scales).unsqueeze(-1) * q - (dmin * mins).unsqueeze(-1)).reshape(nb, 256)
    if ggml_type == 14:  # Q6_K: two halves of 128 values
        ql, qh = b[:, 0:128].reshape(nb, 2, 64), b[:, 128:192].reshape(nb, 2, 1, 32).to(torch.int32)
        lo = torch.cat([ql & 0x0F, ql >> 4], dim=-1).reshape(nb, 2, 4, 32).to(torch.int32)
        hi = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(1, 1, 4, 1)) & 3
        q = ((lo | (hi << 4)) - 32).reshape(nb, 16, 16).float()
        scales = b[:, 192:208].contiguous().view(torch.int8).float()
        d = _f16(b[:, 208:210]).unsqueeze(1)
        return ((d * scales).unsqueeze(-1) * q).reshape(nb, 256)
    if ggml_type in (20, 23):  # IQ4_NL, IQ4_XS: nibbles index IQ4_VALUES (a block's first 16, then last 16)
        qs = b[:, 2:] if ggml_type == 20 else b[:, 8:]
        q = torch.tensor(IQ4_VALUES, dtype=torch.float32)[_nibbles(qs.reshape(nb, -1, 16)).long()]
        if ggml_type == 20:
            return _f16(b[:, 0:2]).unsqueeze(1) * q.reshape(nb, 32)
        # IQ4_XS: 8 sub-blocks of 32, 6-bit scales (low 4 bits in scales_l's nibbles, high 2 in scales_h) - 32
        lo = (b[:, 4:8].to(torch.int32).unsqueeze(-1) >> torch.tensor([0, 4])).reshape(nb, 8) & 0xF
        word = b[:, 2].to(torch.int32) | (b[:, 3].to(torch.int32) << 8)  # scales_h, little-endian
        hi = (word.unsqueeze(-1) >> torch.arange(0, 16, 2)) & 3
        dl = _f16(b[:, 0:2]).unsqueeze(1) * ((lo | (hi << 4)) - 32).float()
        return (dl.unsqueeze(-1) * q.reshape(nb, 8, 32)).reshape(nb, 256)
    raise ValueError(f"no reference dequantization for GGML type {ggml_type}")


def dequantize(ggml_type: int, data: torch.Tensor, k: int) -> torch.Tensor:
    """Stored rows uint8 [n, row_bytes] -> float32 [n, k]."""
    n = data.shape[0]
    if ggml_type == 0:
        return data.contiguous().view(torch.float32).reshape(n, k).clone()
    if ggml_type in (1, 30):
        half = torch.float16 if ggml_type == 1 else torch.bfloat16
        return data.contiguous().view(half).reshape(n, k).float()
    _, qk, nbytes = STORED_TYPES[ggml_type]
    blocks = data.contiguous().reshape(n * (k // qk), nbytes)
    return _deq_blocks(ggml_type, blocks).reshape(n, k)
