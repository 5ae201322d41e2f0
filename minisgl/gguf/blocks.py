"""GGML's block types (the ones weights are kept in as stored: llama.cpp's quantized blocks, F16, BF16, F32)
and their reference dequantization: torch with the same arithmetic as gguf.quants (every scale x quant
product exact in float32, tested against it). The C kernels of kernel/cpu/ must equal it."""

from __future__ import annotations

import torch

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


def row_bytes(ggml_type: int, k: int) -> int:
    _, qk, nbytes = STORED_TYPES[ggml_type]
    if k % qk:
        raise ValueError(f"a {STORED_TYPES[ggml_type][0]} row of {k} values is not whole blocks of {qk}")
    return k // qk * nbytes


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


def dequantize_any(ggml_type: int, data: torch.Tensor, k: int) -> torch.Tensor:
    """Like `dequantize`, also for the types no weight is kept in as stored (gguf.quants for those)."""
    if ggml_type in STORED_TYPES:
        return dequantize(ggml_type, data, k)
    import gguf

    out = gguf.quants.dequantize(data.numpy(), ggml_type).copy()
    return torch.from_numpy(out).reshape(data.shape[0], k)
