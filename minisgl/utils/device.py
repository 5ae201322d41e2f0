"""Device abstraction: CUDA streams, events and pinned memory, which become no-ops on a CPU.

The scheduler and engine call these helpers instead of torch.cuda directly, so the overlap loop and the
graph runner follow the same code path on a CPU as on a GPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np
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


class HostRing:
    """A few pinned int32 host buffers used in turn for per-step transfers, so a step allocates no pinned
    memory. A buffer is handed out again only after the copy that last used it has completed (its event:
    with overlap scheduling at most one step is in flight, so that wait never blocks in practice). On a
    CPU the buffers are plain memory and the events no-ops."""

    def __init__(self, device: torch.device, slots: int = 4) -> None:
        self.device = device
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._events: list = [None] * slots
        self._next = 0

    def take(self, n: int) -> tuple[torch.Tensor, int]:
        """A host buffer of at least n elements and its slot; call `used(slot)` after its copy is queued."""
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        if self._events[i] is not None:
            self._events[i].synchronize()
            self._events[i] = None
        buf = self._bufs[i]
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1024, 2 * (0 if buf is None else buf.numel())), dtype=torch.int32)
            buf = self._bufs[i] = pin(buf, self.device)
        return buf, i

    def used(self, slot: int):
        """Mark the copies queued from (or into) buffer `slot` on the current stream; returns the event
        that completes with them."""
        event = create_event(self.device)
        event.record()
        self._events[slot] = event
        return event

    def pack(self, parts: list) -> tuple[torch.Tensor, list[int]]:
        """Pack int parts (lists or int32 tensors) into one buffer, each part starting 16-byte aligned, and
        copy it to the device in one asynchronous copy. Returns the device tensor and the parts' offsets."""
        arrays = [
            p if isinstance(p, torch.Tensor) else torch.from_numpy(np.asarray(p, dtype=np.int32))
            for p in parts
        ]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.numel() // 4) * 4
        cuda = is_cuda(self.device)
        buf, slot = self.take(total) if cuda else (torch.empty(total, dtype=torch.int32), -1)
        for off, a in zip(offsets, arrays):
            buf[off : off + a.numel()] = a
        if not cuda:
            return buf, offsets
        dev = buf[:total].to(self.device, non_blocking=True)
        self.used(slot)
        return dev, offsets


def synchronize(device: torch.device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def physical_cores() -> int:
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
        if n:
            return n
    except Exception:  # noqa: BLE001, S110 (psutil missing or unable to read the topology: count below)
        pass
    return os.cpu_count() or 1


def keep_freed_memory() -> bool:
    """Let glibc's malloc serve every block from its heap and keep what is freed, instead of mapping each
    large block afresh and returning it on free: a CPU step's activations and logits are megabytes (a long
    prefill's tens), and every fresh mapping costs page faults and the kernel zeroing its pages again. The
    process keeps its peak heap. False where the C library is not glibc or refuses a setting."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    # no mmap at all (M_MMAP_THRESHOLD cannot go past 32 MiB), and no trimming of the heap's top
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 1 << 40))


def set_cpu_threads(tp_size: int = 1) -> int:
    """Physical cores / TP size threads unless OMP_NUM_THREADS is set: one thread per logical core slows
    small decode matmuls down by tens of times."""
    if "OMP_NUM_THREADS" in os.environ:
        n = int(os.environ["OMP_NUM_THREADS"])
    else:
        n = max(1, physical_cores() // max(1, tp_size))
    torch.set_num_threads(n)
    return n
