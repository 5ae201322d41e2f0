"""Which tensor-parallel rank this process is."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DistributedInfo:
    rank: int = 0
    size: int = 1
    ep_size: int = 1  # expert parallelism: MoE experts split over this many of the `size` ranks

    def is_primary(self) -> bool:
        return self.rank == 0


_TP_INFO = DistributedInfo()


def set_tp_info(info: DistributedInfo) -> None:
    global _TP_INFO
    _TP_INFO = info


def get_tp_info() -> DistributedInfo:
    return _TP_INFO
