"""CPU kernels in C (the C files of this folder, one concern each: attention.c, gemm.c, stored_gemm.c, ...),
compiled once per machine with the system compiler (build.py) and loaded with ctypes; each has a torch
reference it is tested against, and callers fall back to that reference when no compiler is found
(`available()` is False) or MINISGL_CPU_KERNELS=0. The descriptors the decode step and the MoE kernel read are
laid out in layout.py, the one definition both sides use."""

from __future__ import annotations

import ctypes

import torch

from minisgl.env import ENV
from minisgl.kernel.cpu import build, layout
from minisgl.kernel.cpu.layout import Descriptor

_lib: ctypes.CDLL | None = None
_tried = False


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if not ENV.cpu_kernels:
        return None
    path = build.build()
    if path is None:
        return None
    _lib = _bind(build.load(path))
    return _lib


def load_variant(extra_flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The library built with extra compiler flags (an older -march: the tests of the fallback paths), or
    None without a compiler."""
    path = build.build(extra_flags)
    return None if path is None else _bind(build.load(path))


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """lib with its entry points' argument types set."""
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.decode_attention_f32.argtypes = [
        ptr,
        ptr,
        ptr,
        ptr,
        i64,
        ptr,
        ptr,
        ptr,
        i32,
        i32,
        i32,
        i32,
        f32,
        i64,
        i32,
    ]
    lib.decode_attention_f32.restype = None
    lib.rms_norm_f32.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, f32, i32]
    lib.silu_and_mul_f32.argtypes = [ptr, i64, ptr, i64, i64, i32]
    lib.argmax_rows_f32.argtypes = [ptr, i64, i64, i64, ptr, i32]
    lib.argmax_rows_f32.restype = i64
    lib.rotary_neox_f32.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i32, i32, i32, i32]
    lib.store_kv_f32.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64]
    lib.dequant_rows.argtypes = [i32, ptr, i64, ptr, i64, i64, ptr, i32]
    lib.linear_stored.argtypes = [ptr, i64, ptr, i32, i64, ptr, ptr, i64, i64, i64, i64, i32]
    lib.linear_stored_q8.argtypes = [ptr, i64, ptr, i32, i64, ptr, ptr, i64, i64, i64, i64, i32]
    lib.linear_stored_q8.restype = i32
    lib.stored_type_supported.argtypes = [i32]
    lib.q8_type_supported.argtypes = [i32]
    lib.moe_stored_f32.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i32]
    lib.moe_stored_f32.restype = None
    if hasattr(lib, "linear_packed_f32"):  # AVX2 builds only
        lib.pack_weight_f32.argtypes = [ptr, ptr, i64, i64, i32]
        lib.linear_packed_f32.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i32]
        lib.decode_step_f32.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, f32, f32, i32]
        lib.decode_step_f32.restype = None
    return lib


def available() -> bool:
    return _load() is not None


def linear_available() -> bool:
    lib = _load()
    return lib is not None and hasattr(lib, "linear_packed_f32")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] float32 -> the panel layout linear() reads (N rounded up to PANEL_ROWS, zero-filled)."""
    lib = _load()
    N, K = weight.shape
    w = weight.detach().contiguous()
    panel = layout.PANEL_ROWS
    packed = torch.empty((N + panel - 1) // panel * panel * K, dtype=torch.float32)
    lib.pack_weight_f32(w.data_ptr(), packed.data_ptr(), N, K, torch.get_num_threads())
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 times the packed W [n, K], transposed (+ bias): [..., n]."""
    lib = _load()
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    M, K = x2.shape
    y = torch.empty(M, n, dtype=torch.float32)
    bias = bias.contiguous() if bias is not None else None  # kept alive across the call
    b = bias.data_ptr() if bias is not None else None
    lib.linear_packed_f32(x2.data_ptr(), packed.data_ptr(), b, y.data_ptr(), M, n, K, torch.get_num_threads())
    return y.view(*x.shape[:-1], n)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """q [B, Hq, D] float32 attends over keys 0..lens[b]-1 of page-table row rows[b] (int64 tensors), the
    last `window` of them where window > 0 (a sliding-window layer);
    k/v_cache [slots, Hkv, D]; page_table [rows, L] int32. Returns [B, Hq, D]. Same math as
    reference.decode_attention."""
    lib = _load()
    assert lib is not None, "CPU kernels unavailable: check kernel.cpu.available() first"
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    assert q.dtype == k_cache.dtype == v_cache.dtype == torch.float32 and page_table.dtype == torch.int32
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and page_table.stride(1) == 1
    assert rows.dtype == lens.dtype == torch.int64 and Hq % Hkv == 0
    q = q.contiguous()
    rows, lens = rows.contiguous(), lens.contiguous()
    out = torch.empty_like(q)
    lib.decode_attention_f32(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        page_table.data_ptr(),
        page_table.stride(0),
        rows.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        B,
        Hq,
        Hkv,
        D,
        scale,
        window,
        torch.get_num_threads(),
    )
    return out


def elementwise_ok(*tensors: torch.Tensor) -> bool:
    """Whether the C elementwise kernels take these: float32 CPU tensors with unit stride in the last dim."""
    return all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors
    ) and (available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """rms_norm(x) * w for x [M, H]; with a residual, (rms_norm(x + residual) * w, x + residual)."""
    M, H = x.shape
    out = torch.empty(M, H, dtype=torch.float32)
    res_out = torch.empty(M, H, dtype=torch.float32) if residual is not None else None
    if residual is not None:
        residual = residual.contiguous()
    _load().rms_norm_f32(
        x.data_ptr(),
        x.stride(0),
        residual.data_ptr() if residual is not None else None,
        res_out.data_ptr() if res_out is not None else None,
        weight.data_ptr(),
        out.data_ptr(),
        M,
        H,
        eps,
        torch.get_num_threads(),
    )
    return out if residual is None else (out, res_out)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2I] = [gate | up] -> silu(gate) * up [M, I]."""
    M, I2 = x.shape
    out = torch.empty(M, I2 // 2, dtype=torch.float32)
    _load().silu_and_mul_f32(x.data_ptr(), x.stride(0), out.data_ptr(), M, I2 // 2, torch.get_num_threads())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """x.argmax(dim=-1) as int32 for float32 x [M, N] (unit column stride); None when a row holds a NaN
    (torch's answer is the NaN's index: the caller asks torch)."""
    M, N = x.shape
    out = torch.empty(M, dtype=torch.int32)
    nans = _load().argmax_rows_f32(x.data_ptr(), x.stride(0), M, N, out.data_ptr(), torch.get_num_threads())
    return out if nans == 0 else None


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    """Neox rotary in place on q [T, Hq, D] and k [T, Hk, D] (heads contiguous); returns (q, k)."""
    T, Hq, D = q.shape
    assert q.stride(1) == D and k.stride(1) == D and cos_sin_cache.is_contiguous()
    positions = positions.to(torch.int64).contiguous()
    _load().rotary_neox_f32(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        k.stride(0),
        positions.data_ptr(),
        cos_sin_cache.data_ptr(),
        T,
        Hq,
        k.shape[1],
        D,
        cos_sin_cache.shape[1],
    )
    return q, k


def store_kv(k_cache, v_cache, out_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k_cache[out_loc] = k, v_cache[out_loc] = v, for k/v [T, Hkv, D] with contiguous rows."""
    T, H, D = k.shape
    assert k.stride(1) == D and v.stride(1) == D and k_cache.is_contiguous() and v_cache.is_contiguous()
    loc = out_loc.to(torch.int64).contiguous()
    _load().store_kv_f32(
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        loc.data_ptr(),
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        T,
        H * D,
    )


def stored_type_supported(ggml_type: int) -> bool:
    """Whether the C kernels read this GGUF block type (kernel/stored.py lists the ones they do)."""
    lib = _load()
    return lib is not None and bool(lib.stored_type_supported(ggml_type))


def q8_row_floats(k: int) -> int:
    """Room for one row of k activations quantized for the int8 dot, in floats: whole groups of up to four
    blocks of 32 (q8.h's xgroup), Q8_BLOCK_BYTES a block."""
    return (k + 127) // 128 * layout.Q8_BLOCK_BYTES


def moe_stored(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    inter: int,
    int8: bool = False,
) -> torch.Tensor:
    """A sparse layer's experts as stored, in one call (moe.c's moe_stored_f32): x [T, H] float32, ids int32
    [T, k] (-1: none), weights float32 [T, k], experts the E experts' descriptors (stored_experts): their
    gate [inter, H], up and down [H, inter] rows. Returns [T, H] float32:
    the routing-weighted sum of each token's experts, added in expert order. int8: the types the int8 dot
    reads multiply by it (llama.cpp's arithmetic, as --stored-dot int8), the rest exactly."""
    T, H = x.shape
    k, E = ids.shape[1], experts.shape[0]
    assert experts.shape[1] == layout.EXPERT.words and experts.dtype == torch.int64
    x, ids, weights = x.contiguous(), ids.to(torch.int32).contiguous(), weights.float().contiguous()
    out = torch.empty(T, H, dtype=torch.float32)
    scratch = torch.empty(T * k * (2 * H + 3 * inter), dtype=torch.float32)
    order = torch.empty(T * k + E + 1, dtype=torch.int64)
    qx = torch.empty(T * k * q8_row_floats(max(H, inter)) if int8 else 0, dtype=torch.float32)
    _lib.moe_stored_f32(
        x.data_ptr(), T, H, inter, k, ids.data_ptr(), weights.data_ptr(), experts.data_ptr(), E,
        out.data_ptr(), scratch.data_ptr(), order.data_ptr(), qx.data_ptr() if int8 else None,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def stored_experts(experts: list[tuple]) -> torch.Tensor:
    """The descriptors moe_stored reads, int64 [E, EXPERT words]: per expert its (gate, up, down) StoredParts
    (kernel/stored.py)."""

    def stored(p) -> Descriptor:
        return Descriptor(layout.STORED, type=p.ggml_type, data=p.data.data_ptr(), row_bytes=p.data.stride(0))

    descs = [Descriptor(layout.EXPERT, gate=stored(g), up=stored(u), down=stored(d)) for g, u, d in experts]
    return layout.stack(descs)


def int8_dot_supported(ggml_type: int) -> bool:
    """Whether this build's int8 dot (--stored-dot int8) reads the type: Q4_0/Q4_1/Q8_0 in every build,
    Q4_K/Q5_K/Q6_K where the CPU has AVX-512 VNNI."""
    lib = _load()
    return lib is not None and bool(lib.q8_type_supported(ggml_type))


def dequant_rows(
    ggml_type: int, data: torch.Tensor, k: int, rows: torch.Tensor | None, n: int
) -> torch.Tensor:
    """Rows `rows` (int64; None: rows 0..n-1) of a stored weight [*, k] (data: uint8 [*, row_bytes]) as
    float32 [n, k], dequantized exactly."""
    out = torch.empty(n, k, dtype=torch.float32)
    ptr = None if rows is None else rows.data_ptr()
    _load().dequant_rows(
        ggml_type, data.data_ptr(), data.stride(0), ptr, n, k, out.data_ptr(), torch.get_num_threads()
    )
    return out


def linear_stored(
    x: torch.Tensor,
    ggml_type: int,
    data: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
) -> None:
    """y [M, n] = x [M, k] float32 times the stored W [n, k], transposed (+ bias): the blocks are dequantized
    inside the kernel. x, y and data have unit column stride (y may be a column slice); the library is
    loaded (stored.linear checks available() first)."""
    _lib.linear_stored(*_stored_args(x, ggml_type, data, bias, y))


def _stored_args(x, ggml_type: int, data: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> tuple:
    """linear_stored's and linear_stored_q8's C arguments."""
    (M, K), N = x.shape, y.shape[1]
    b = bias.data_ptr() if bias is not None else None
    ptrs = (
        x.data_ptr(),
        x.stride(0),
        data.data_ptr(),
        ggml_type,
        data.stride(0),
        b,
        y.data_ptr(),
        y.stride(0),
    )
    return (*ptrs, M, N, K, torch.get_num_threads())


def linear_stored_q8(
    x: torch.Tensor,
    ggml_type: int,
    data: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
) -> None:
    """linear_stored with x quantized to int8 blocks of 32 first (llama.cpp's arithmetic, approximate):
    the types of int8_dot_supported, k a multiple of 32 (ValueError otherwise). Same layout rules as
    linear_stored."""
    assert x.stride(1) == 1 and y.stride(1) == 1 and data.stride(1) == 1
    rc = _load().linear_stored_q8(*_stored_args(x, ggml_type, data, bias, y))
    if rc != 0:
        raise ValueError(
            f"the int8 dot takes Q4_0/Q4_1/Q8_0 (and Q4_K/Q5_K/Q6_K with AVX-512 VNNI) with k % 32 == 0, "
            f"not type {ggml_type}, k {x.shape[1]}"
        )


def decode_step_available() -> bool:
    """Whether this build has decode_step (AVX2 builds, like the packed float32 linear it uses)."""
    lib = _load()
    return lib is not None and hasattr(lib, "decode_step_f32")


def decode_step(
    model: torch.Tensor,
    layers: torch.Tensor,
    tokens: tuple[torch.Tensor, ...],
    scratch: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    scale: float,
) -> None:
    """Every layer of a decode step in one call (decode_step.c's decode_step_f32): `model` and `layers`
    are its int64 descriptors, `tokens` = (ids, positions, KV slots, page-table rows, key counts), each
    int64 [B]; out [B, hidden] gets the final norm's output."""
    ids, pos, loc, rows, lens = tokens
    _lib.decode_step_f32(
        model.data_ptr(),
        layers.data_ptr(),
        ids.data_ptr(),
        pos.data_ptr(),
        loc.data_ptr(),
        rows.data_ptr(),
        lens.data_ptr(),
        ids.numel(),
        scratch.data_ptr(),
        out.data_ptr(),
        eps,
        scale,
        torch.get_num_threads(),
    )
