"""Tensor-parallel info and collectives (a no-op at TP=1; gloo on a CPU, NCCL on a GPU)."""

from .comm import all_gather_last_dim, all_reduce, init_process_group
from .info import DistributedInfo, get_tp_info, set_tp_info

__all__ = [
    "DistributedInfo",
    "all_gather_last_dim",
    "all_reduce",
    "get_tp_info",
    "init_process_group",
    "set_tp_info",
]
