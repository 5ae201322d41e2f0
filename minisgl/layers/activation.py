"""SiLU-and-mul, the gated activation of Llama-style MLPs."""

from __future__ import annotations

import torch
from torch import nn

from minisgl import kernel


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernel.silu_and_mul(x)
