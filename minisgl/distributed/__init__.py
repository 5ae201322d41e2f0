"""Tensor-parallel info and collectives (a no-op at TP=1; gloo on a CPU, NCCL on a GPU)."""

from .info import DistributedInfo, get_tp_info, set_tp_info
from .comm import all_gather_last_dim, all_reduce, init_process_group

__all__ = ["DistributedInfo", "get_tp_info", "set_tp_info", "all_reduce", "all_gather_last_dim",
           "init_process_group"]
