"""Mixture of experts: the sparse layer (layer.py) and its backends, picked by name (`--moe-backend`)."""

from __future__ import annotations

import torch

from minisgl.utils import Registry

from .base import MoEBackend
from .layer import EXPERT_WEIGHT, Experts, SparseMoeBlock
from .torch_backend import TorchMoEBackend

MOE_BACKENDS: Registry[type] = Registry("MoE backend")
MOE_BACKENDS.register("torch")(TorchMoEBackend)


@MOE_BACKENDS.register("fused")
def _fused() -> MoEBackend:
    from .fused_backend import FusedMoEBackend  # imports Triton

    return FusedMoEBackend()


def create_moe_backend(name: str, device: torch.device) -> MoEBackend:
    """`auto`: the fused Triton kernels on CUDA, the torch reference elsewhere."""
    if name == "auto":
        name = "fused" if device.type == "cuda" else "torch"
    return MOE_BACKENDS.get(name)()


__all__ = [
    "EXPERT_WEIGHT",
    "MOE_BACKENDS",
    "Experts",
    "MoEBackend",
    "SparseMoeBlock",
    "create_moe_backend",
]
