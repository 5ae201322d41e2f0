"""Weights kept as stored: a matrix held in its GGML block type (a .gguf file's quantized blocks, or a
checkpoint's half-precision rows) in place of a float Parameter, multiplied by the stored-weight kernels
(kernel/stored.py), which dequantize each block in registers: the bytes read per decode step are the
file's (Q4_1: 0.625 byte a weight instead of float32's 4)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .blocks import STORED_TYPES, dequantize

STORED_DOTS = ("exact", "int8")  # StoredWeight.dot, set from EngineConfig.stored_dot


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

    `dot` is how kernel.stored.linear multiplies it: "exact" (the default) dequantizes each block with the
    reference arithmetic; "int8" (the engine's --stored-dot int8) quantizes the activations to int8 blocks of 32 for
    the Q4_0/Q4_1/Q8_0 parts where K is a multiple of 32, and Q4_K/Q5_K/Q6_K on CPUs with AVX-512 VNNI
    (kernel.cpu.int8_dot_supported; llama.cpp's kind of arithmetic, approximate); the other parts stay exact."""

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
