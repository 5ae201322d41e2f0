"""Collectives used by the parallel layers, and the CPU (gloo) group the ranks coordinate over. At TP=1
no group is created and the collectives return their input untouched."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from minisgl.utils import init_logger

logger = init_logger(__name__)

# rank 0's messages to the other ranks can be minutes apart (an idle LLM, an idle service): the control
# group waits that long; a dead peer still fails it at once (its sockets close)
CONTROL_TIMEOUT = timedelta(days=30)
_CONTROL_GROUP: Any = None
_FORMED = False  # whether this process joined a group: the collectives are the identity until then


class RankJoinError(RuntimeError):
    """Not every tensor-parallel rank joined the group within the timeout (a node that never started)."""


def init_process_group(
    rank: int,
    size: int,
    init_method: str,
    device: torch.device,
    timeout: float = 120.0,
    force: bool = False,
) -> None:
    """Join the TP group (NCCL on CUDA, gloo on a CPU) and a gloo group for CPU-side coordination.
    Waits at most `timeout` seconds for every rank; the model's collectives time out after as long.
    At size 1 nothing is created unless `force` (a test of the collectives on one GPU)."""
    global _CONTROL_GROUP, _FORMED
    if size == 1 and not force:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if rank == 0:  # NCCL's set-up takes seconds, before anything else is logged
        logger.info(f"Joining the {size} tensor-parallel ranks ({backend}, {init_method})")
    try:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout),
        )
    except (RuntimeError, dist.DistError) as e:  # DistStoreError: a rank (a node) never came
        raise RankJoinError(
            f"rank {rank}: not all {size} tensor-parallel ranks joined at {init_method} within "
            f"{timeout:.0f} s (is every node started, with the same --dist-init-addr and --nnodes, "
            f"and a distinct --node-rank?): {str(e).splitlines()[0]}"
        ) from None
    _CONTROL_GROUP = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _FORMED = True


def destroy_process_group() -> None:
    """Leave the TP group (after the last collective)."""
    global _CONTROL_GROUP, _FORMED
    if dist.is_initialized():
        dist.destroy_process_group()
    _CONTROL_GROUP, _FORMED = None, False


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place."""
    if not _FORMED:
        return x
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension (the vocab-parallel LM head)."""
    if not _FORMED:
        return x
    size = dist.get_world_size()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


# ---- CPU-side coordination (the control group) ----------------------------------------------------------
def broadcast_object(obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank (the others pass nothing), over the control group."""
    if not _FORMED:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_CONTROL_GROUP)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, over the control group."""
    if not _FORMED:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_CONTROL_GROUP)
    return out


def all_reduce_min(value: int) -> int:
    """The smallest rank's `value` (e.g. KV pages that fit in its free memory)."""
    if not _FORMED:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CONTROL_GROUP)
    return int(t.item())
