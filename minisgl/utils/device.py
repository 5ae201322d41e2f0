"""Device abstraction: CUDA streams, events and pinned memory, which become no-ops on a CPU.

The scheduler and engine call these helpers instead of torch.cuda directly, so the overlap loop and the
graph runner follow the same code path on a CPU as on a GPU.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch


class NullStream:
    """Stands in for torch.cuda.Stream on a CPU: work runs synchronously, waits are no-ops."""

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


class NullEvent:
    """Stands in for torch.cuda.Event on a CPU: CPU work is complete when it is recorded."""

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: object = None) -> None:
        pass


def pick_device(name: str | None = None) -> torch.device:
    """`cuda` when available (or asked for), else `cpu`."""
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def create_stream(device: torch.device):
    return torch.cuda.Stream(device=device) if is_cuda(device) else NullStream()


def current_stream(device: torch.device):
    return torch.cuda.current_stream(device) if is_cuda(device) else NullStream()


def create_event(device: torch.device):
    return torch.cuda.Event() if is_cuda(device) else NullEvent()


@contextlib.contextmanager
def use_stream(stream) -> Iterator[None]:
    if isinstance(stream, NullStream):
        yield
    else:
        with torch.cuda.stream(stream):
            yield


def pin(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Pinned host memory so device->host copies can be asynchronous; plain memory on a CPU."""
    return tensor.pin_memory() if is_cuda(device) else tensor


def synchronize(device: torch.device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def physical_cores() -> int:
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
        if n:
            return n
    except Exception:  # psutil missing or unable to read the topology
        pass
    return os.cpu_count() or 1


def set_cpu_threads(tp_size: int = 1) -> int:
    """Physical cores / TP size threads unless OMP_NUM_THREADS is set: one thread per logical core slows
    small decode matmuls down by tens of times."""
    if "OMP_NUM_THREADS" in os.environ:
        n = int(os.environ["OMP_NUM_THREADS"])
    else:
        n = max(1, physical_cores() // max(1, tp_size))
    torch.set_num_threads(n)
    return n
