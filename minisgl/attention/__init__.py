"""Attention backends, picked by name (`--attn`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minisgl.kernel import cpu as cpu_kernels
from minisgl.utils import Registry

from .base import AttnConfig, BaseAttnBackend, HybridBackend
from .cpu_backend import CpuAttnBackend
from .torch_backend import TorchAttnBackend

if TYPE_CHECKING:
    from minisgl.kvcache.pool import KVPool

ATTN_BACKENDS: Registry[type] = Registry("attention backend")
ATTN_BACKENDS.register("torch")(TorchAttnBackend)
ATTN_BACKENDS.register("cpu")(CpuAttnBackend)


def _register_optional() -> None:
    """Backends whose imports may be missing register themselves only when they import."""
    try:
        from .triton_backend import TritonAttnBackend

        if "triton" not in ATTN_BACKENDS:
            ATTN_BACKENDS.register("triton")(TritonAttnBackend)
    except ImportError:
        pass


# names other engines use for library backends this build does not provide
_NOT_BUILT = {"fi": "FlashInfer", "fa": "FlashAttention"}


def attn_backend_names() -> list[str]:
    """The names `--attn` accepts (each side of a `prefill,decode` pair too); imports no backend's kernels
    beyond the optional ones' modules."""
    _register_optional()
    return ["auto", *ATTN_BACKENDS.names()]


def check_attn_name(spec: str) -> None:
    """Raise ValueError naming the known backends if `spec` (one name or `prefill,decode`) names another;
    cheap enough for option parsing, before any model work."""
    names = [n.strip() for n in spec.split(",")]
    if all(n == "auto" or n in ATTN_BACKENDS for n in names) and len(names) <= 2:
        return  # known without importing the optional backends (triton's import takes ~0.5 s)
    known = attn_backend_names()
    for name in names:
        if name in _NOT_BUILT and name not in ATTN_BACKENDS:
            resolve_attn_name(name, torch.device("cpu"))  # raises its "not available in this build"
        if name not in known or len(names) > 2:
            raise ValueError(
                f"unknown attention backend {spec!r}; supported: {', '.join(known)} (or a prefill,decode pair)"
            )


def resolve_attn_name(name: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """`auto`: triton on CUDA (when importable); cpu on a CPU where its C kernel builds; torch elsewhere."""
    _register_optional()
    if name in _NOT_BUILT and name not in ATTN_BACKENDS:
        raise ValueError(
            f"attention backend {name!r} ({_NOT_BUILT[name]}) is not available in this build; "
            f"supported: {', '.join(ATTN_BACKENDS.names())} (triton is the fast path on GPUs)"
        )
    if name != "auto":
        return name
    if device.type == "cuda" and "triton" in ATTN_BACKENDS:
        return "triton"
    if (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16, torch.float16)
        and cpu_kernels.available()
    ):
        return "cpu"
    return "torch"


def attends_sliding_windows(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the backend(s) `name` resolves to attend over a layer's sliding window (AttnConfig.windows)."""
    _register_optional()
    return all(
        ATTN_BACKENDS.get(resolve_attn_name(n.strip(), device, dtype)).sliding_window for n in name.split(",")
    )


KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn}


def kv_dtype_problem(kv: str, names: list[str]) -> str | None:
    """What is wrong with KV pool dtype `kv` (a KV_CACHE_DTYPES name) under the registered backends
    `names`: a float8 pool where one of them does not declare `supports_fp8_kv`; None where nothing is."""
    if KV_CACHE_DTYPES[kv] is None:
        return None
    refused = [n for n in names if not ATTN_BACKENDS.get(n).supports_fp8_kv]
    if not refused:
        return None
    able = [n for n in ATTN_BACKENDS.names() if ATTN_BACKENDS.get(n).supports_fp8_kv]
    return (
        f"{kv} needs an attention backend that reads float8 K/V ({', '.join(able)}); "
        f"{', '.join(refused)} does not: pass --attn {able[0]}"
    )


def kv_cache_dtype(name: str, device: torch.device, dtype: torch.dtype, kv: str = "auto") -> torch.dtype:
    """The KV pool's dtype: the model's, or the one a backend's kernels read (`kv_dtype`: float32 under
    the cpu backend); `kv` fp8_e4m3 stores K/V as float8 e4m3 (rounded to nearest, no scale, as vLLM's fp8
    cache without calibrated scales), upcast where read, under backends that declare `supports_fp8_kv`."""
    backends = [resolve_attn_name(n.strip(), device, dtype) for n in name.split(",")]
    problem = kv_dtype_problem(kv, backends)
    if problem is not None:
        raise ValueError(f"--kv-cache-dtype {problem}")
    if KV_CACHE_DTYPES[kv] is not None:
        return KV_CACHE_DTYPES[kv]
    needed = {ATTN_BACKENDS.get(n).kv_dtype for n in backends} - {None}
    assert len(needed) <= 1, f"the backends {backends} need different KV pool dtypes {needed}"
    return needed.pop() if needed else dtype


def create_attn_backend(
    name: str, config: AttnConfig, kv_pool: KVPool, page_table: torch.Tensor
) -> BaseAttnBackend:
    """`name` is one backend, `auto`, or a `prefill,decode` pair."""
    _register_optional()
    if "," in name:
        prefill, decode = (resolve_attn_name(n.strip(), config.device, config.dtype) for n in name.split(","))
        return HybridBackend(
            ATTN_BACKENDS.get(prefill)(config, kv_pool, page_table),
            ATTN_BACKENDS.get(decode)(config, kv_pool, page_table),
        )
    return ATTN_BACKENDS.get(resolve_attn_name(name, config.device, config.dtype))(
        config, kv_pool, page_table
    )


__all__ = [
    "ATTN_BACKENDS",
    "KV_CACHE_DTYPES",
    "AttnConfig",
    "BaseAttnBackend",
    "attends_sliding_windows",
    "attn_backend_names",
    "check_attn_name",
    "create_attn_backend",
    "kv_cache_dtype",
    "kv_dtype_problem",
    "resolve_attn_name",
]
