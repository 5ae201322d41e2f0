"""Tensor-parallel info and collectives (a no-op at TP=1; gloo on a CPU, NCCL on a GPU)."""

from .comm import (
    RankJoinError,
    all_gather_last_dim,
    all_gather_object,
    all_reduce,
    all_reduce_min,
    broadcast_object,
    destroy_process_group,
    init_process_group,
)
from .info import DistributedInfo, get_tp_info, set_tp_info

__all__ = [
    "DistributedInfo",
    "RankJoinError",
    "all_gather_last_dim",
    "all_gather_object",
    "all_reduce",
    "all_reduce_min",
    "broadcast_object",
    "destroy_process_group",
    "get_tp_info",
    "init_process_group",
    "set_tp_info",
]
