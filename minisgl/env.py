"""Environment switches read once at import time (MINISGL_* variables)."""

from __future__ import annotations

import os


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


class Env:
    """Typed view of the MINISGL_* environment variables."""

    @property
    def disable_overlap_scheduling(self) -> bool:
        return _flag("MINISGL_DISABLE_OVERLAP_SCHEDULING")

    @property
    def cache_dir(self) -> str:
        default = os.path.join(os.path.expanduser("~"), ".cache", "minisgl")
        return os.environ.get("MINISGL_CACHE_DIR", default)

    @property
    def cpu_kernels(self) -> bool:
        """Build and use the C kernels of kernel/cpu/ on CPUs (MINISGL_CPU_KERNELS=0 keeps torch ops)."""
        return _flag("MINISGL_CPU_KERNELS", default=True)

    @property
    def pdl(self) -> bool:
        """Launch the decode-path Triton kernels with programmatic dependent launch on Hopper and newer
        GPUs (MINISGL_PDL=0 launches them plainly)."""
        return _flag("MINISGL_PDL", default=True)

    @property
    def layer_kernel(self) -> bool:
        """Run each decoder layer of a one-request decode step as one Triton launch (kernel/triton/layer.py,
        MINISGL_LAYER_KERNEL=1); off by default: on an H200 it measured slower than the layer's own five
        kernels (docs/BENCHMARKS.md)."""
        return _flag("MINISGL_LAYER_KERNEL")

    @property
    def decode_step(self) -> str:
        """Whether the layers of a decode step of 1-8 requests run as one persistent CUDA kernel on Hopper
        GPUs where nvcc is present (kernel/step_kernel.py), MINISGL_DECODE_STEP: "auto" (unset, the default)
        times the kernel and the layers' own kernels when each of those sizes' decode graphs is captured and
        keeps the faster (engine/graph/decode.py; without decode graphs the layers' kernels run); "on" (1)
        always the kernel where it serves the batch, "off" (0) never."""
        value = os.environ.get("MINISGL_DECODE_STEP", "auto").strip().lower()
        if value in ("", "auto"):
            return "auto"
        if value in ("1", "true", "yes", "on"):
            return "on"
        if value in ("0", "false", "no", "off"):
            return "off"
        raise ValueError(f"MINISGL_DECODE_STEP must be auto, 1 (on) or 0 (off), not {value!r}")

    @property
    def decode_step_splits(self) -> int | None:
        """At most this many splits of each KV head's keys in the one-kernel decode step
        (MINISGL_DECODE_STEP_SPLITS, a measurement knob; unset: as many as the SMs allow, at most 16)."""
        value = os.environ.get("MINISGL_DECODE_STEP_SPLITS", "").strip()
        if not value:
            return None
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"MINISGL_DECODE_STEP_SPLITS must be a whole number >= 1, not {value!r}")
        return int(value)

    @property
    def decode_tile(self) -> str:
        """The decode attention's launches (MINISGL_DECODE_TILE): BLOCK_N:warps:stages in several
        splits:stages in one[:programs an SM the split count aims for; by default 8, for batches over a
        float8 pool 16], for batches of several requests, then for one request; e.g. 64:4:3:4,64:4:3:4 (the
        GPU tiling before 2026-12-03). Empty: the tuned defaults (attention/triton_backend.py)."""
        return os.environ.get("MINISGL_DECODE_TILE", "").strip()

    @property
    def fp8_v_bytes(self) -> bool:
        """Decode attention over a float8 pool reads V as float8 bytes, converted after the dot operand's
        transpose, as before 2026-12-03 (MINISGL_FP8_V_BYTES=1; default: 32-bit words converted first)."""
        return _flag("MINISGL_FP8_V_BYTES")

    @property
    def check_integrity(self) -> bool:
        """Fail (not just log) when the idle-time KV integrity check finds a leak; tests set it."""
        return _flag("MINISGL_STRICT_INTEGRITY")


ENV = Env()
