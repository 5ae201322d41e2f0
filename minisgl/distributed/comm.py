"""Collectives used by the parallel layers. At TP=1 they return their input untouched."""

from __future__ import annotations

import torch
import torch.distributed as dist

from minisgl.utils import init_logger

from .info import get_tp_info

logger = init_logger(__name__)


def init_process_group(rank: int, size: int, init_method: str, device: torch.device) -> None:
    """Join the TP group: NCCL on CUDA, gloo on a CPU."""
    if size == 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if rank == 0:  # NCCL's set-up takes seconds, before anything else is logged
        logger.info(f"Joining the {size} tensor-parallel ranks ({backend}, {init_method})")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if get_tp_info().size == 1:
        return x
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension (the vocab-parallel LM head)."""
    size = get_tp_info().size
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
