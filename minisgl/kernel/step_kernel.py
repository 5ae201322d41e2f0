"""The decode step of one to eight requests as one persistent CUDA kernel (kernel/cuda/decode_step.cu): every
dense decoder layer from the embedding rows to the last layer's (MLP output, residual), each block spinning
on the tagged words of the stage before instead of waiting at kernel boundaries, and streaming its next
weights into shared memory meanwhile; the batch's requests share that weight stream.

The kernel is built with nvcc once per machine (into MINISGL_CACHE_DIR) and called through ctypes on
torch's current stream, so CUDA graphs capture it as one node. Its argument block is a row of int64 in
the order of _FIELDS, which the library reports and this module checks. By default (MINISGL_DECODE_STEP
unset or auto) the decode graph runner times it against the layers' own kernels when it captures the
graph of each batch size it serves and keeps the faster (engine/graph/decode.py); MINISGL_DECODE_STEP=1
always runs it where it serves, =0 never; where nvcc or a Hopper GPU is missing, the layers run as
before."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
import time
from typing import TYPE_CHECKING, NamedTuple

import torch

from minisgl.env import ENV

if TYPE_CHECKING:
    from . import LayerWeights

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "cuda", "decode_step.cu")
_FIELDS = (
    "layers",
    "num_layers",
    "hidden",
    "heads",
    "kv_heads",
    "head_dim",
    "inter",
    "rot_half",
    "splits",
    "batch",
    "x_in",
    "h2",
    "y",
    "w_qkv",
    "w_attn",
    "w_h2",
    "w_act",
    "w_y",
    "part_o",
    "part_lse",
    "k_cache",
    "v_cache",
    "kv_layer_stride",
    "stride_kt",
    "stride_kh",
    "page_table",
    "stride_pt",
    "table_idx",
    "seq_lens",
    "out_loc",
    "positions",
    "idx64",
    "cos_sin",
    "stride_cs",
    "counters",
    "ring_bytes",
    "vec_elems",
    "scratch_floats",
    "trace",
)
_LAYER_FIELDS = ("in_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "post_norm", "gate_up", "down")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_THREADS_WARPS = 16  # NW in the kernel: 512 threads
_MAX_GROUP = 8
_MAX_SPLITS = 16
MAX_BATCH = 8  # requests a launch (MAXB)
_MIN_RING = 32 * 1024  # a batch whose input rows leave less of the weight ring than this is not served
# the kernel's static shared memory (mbarriers, chunk offsets, the four stage kinds: 992 B) fits in this
_STATIC_SMEM = 1024
_TRACE_POINTS = 25  # clock readings a layer: 5 stages x (start, weights issued, inputs in, weights in, done)
_lib: ctypes.CDLL | None = None
_tried = False


def _nvcc() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    path = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
    return path if path and os.path.exists(path) else shutil.which("nvcc")


_PARTS = 5  # decode_step.cu's STEP_PART values: 0 the entry points, 1-4 an instance family each


def _build() -> str | None:
    """The library's path, compiled once per source and flags (None: no nvcc, or it failed): its parts
    (decode_step.cu's STEP_PART) by as many nvcc processes at once, then linked."""
    nvcc = _nvcc()
    if nvcc is None:
        logger.info("No nvcc: the one-kernel decode step is off")
        return None
    flags = ["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC", "-lineinfo"]
    # measurement variants (decode_step.cu's STEP_* macros), e.g. MINISGL_DECODE_STEP_DEFINES="-DSTEP_GATE=1"
    flags += os.environ.get("MINISGL_DECODE_STEP_DEFINES", "").split()
    with open(_SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    out_dir = os.path.join(ENV.cache_dir, "kernels")
    path = os.path.join(out_dir, f"decode_step-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    logger.info(f"Compiling the decode-step kernel with {nvcc} in {_PARTS} parts at once (once per machine)")
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        objs = [os.path.join(tmp, f"part{p}.o") for p in range(_PARTS)]
        compiles = [
            subprocess.Popen(
                [nvcc, *flags, f"-DSTEP_PART={p}", "-c", "-o", obj, _SOURCE],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for p, obj in enumerate(objs)
        ]
        errors = [proc.communicate()[1] for proc in compiles]
        lib = os.path.join(tmp, "decode_step.so")
        if all(proc.returncode == 0 for proc in compiles):
            link = [nvcc, "-shared", "-gencode=arch=compute_90a,code=sm_90a", *objs, "-o", lib]
            result = subprocess.run(link, capture_output=True, text=True, check=False)
            errors.append(result.stderr)
        if not os.path.exists(lib):
            logger.warning(
                "Compiling the decode-step kernel failed; the layers run as before:\n%s",
                "".join(errors)[-2000:],
            )
            return None
        os.replace(lib, path)  # atomic: processes building at once each see a whole library
    logger.info(f"Compiled the decode-step kernel in {time.perf_counter() - start:.0f}s")
    return path


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    path = _build()
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    lib.minisgl_step_fields.restype = ctypes.c_char_p
    lib.minisgl_step_error.restype = ctypes.c_char_p
    lib.minisgl_decode_step.argtypes = [
        ctypes.POINTER(ctypes.c_int64),
        ctypes.c_float,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    fields = lib.minisgl_step_fields().decode().rstrip(",").split(",")
    assert tuple(fields) == tuple(_FIELDS), f"decode_step.cu's fields {fields} differ from {_FIELDS}"
    assert lib.minisgl_step_max_group() == _MAX_GROUP and lib.minisgl_step_threads() == 32 * _THREADS_WARPS
    assert lib.minisgl_step_max_splits() == _MAX_SPLITS and lib.minisgl_step_trace_points() == _TRACE_POINTS
    assert lib.minisgl_step_max_batch() == MAX_BATCH
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    limit = getattr(props, "shared_memory_per_block_optin", 227 * 1024)
    err = lib.minisgl_step_prepare(limit - _STATIC_SMEM)
    if err:
        logger.warning(
            "The decode-step kernel does not load (%s): the layers run as before", lib.minisgl_step_error(err)
        )
        return None
    _lib = lib
    return _lib


def buildable(device: torch.device) -> bool:
    """Whether the kernel can run on device: a Hopper GPU (it is built for sm_90a), nvcc there."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    return _load() is not None


def available(device: torch.device) -> bool:
    """Whether the one-kernel decode step may run on device: not switched off (MINISGL_DECODE_STEP=0),
    buildable. Under "auto" the decode graph runner then times it against the layers' own kernels."""
    return ENV.decode_step != "off" and buildable(device)


class StepWeights(NamedTuple):
    """Every layer's tensors for decode_step, their addresses as one device table [layers, 9]."""

    layers: list[LayerWeights]
    table: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int
    cos_sin_cache: torch.Tensor


def fits(lw: LayerWeights, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel serves a layer of these shapes and dtype."""
    group = heads // kv_heads
    hidden, inter = lw.qkv.shape[1], lw.down.shape[1]
    return (
        lw.qkv.dtype in _DTYPES
        and head_dim in (64, 128)
        and group <= _MAX_GROUP
        and heads % kv_heads == 0
        and hidden % 8 == 0
        and inter % 8 == 0
        and all(t is None or _whole_rows(t, lw.qkv.dtype) for t in lw[:-1])
    )


def _whole_rows(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Contiguous, of the model's dtype, 16-byte aligned (the kernel copies rows in 16-byte pieces)."""
    return t.is_contiguous() and t.dtype == dtype and t.data_ptr() % 16 == 0


def step_weights(
    layers: list[LayerWeights], heads: int, kv_heads: int, head_dim: int, cos_sin_cache: torch.Tensor
) -> StepWeights:
    """The pointer table of the layers (kept alive with them)."""
    rows = [[0 if t is None else t.data_ptr() for t in lw[: len(_LAYER_FIELDS)]] for lw in layers]
    table = torch.tensor(rows, dtype=torch.int64).to(layers[0].qkv.device)
    return StepWeights(layers, table, heads, kv_heads, head_dim, cos_sin_cache)


class _Buffers(NamedTuple):
    """The plain outputs (h2, y [batch, hidden]: what decode_step returns), the stages' tagged words (w_*: a
    row a request; a bf16 value and a 16-bit tag in an int32, a float32 value and a 32-bit tag in an int64),
    the attention splits' tagged float32 words and the counters (the tags' base, the blocks out)."""

    h2: torch.Tensor
    y: torch.Tensor
    w_qkv: torch.Tensor
    w_attn: torch.Tensor
    w_h2: torch.Tensor
    w_act: torch.Tensor
    w_y: torch.Tensor
    part_o: torch.Tensor
    part_lse: torch.Tensor
    counters: torch.Tensor


_BUFFERS: dict[tuple, _Buffers] = {}

# set by trace(): a kept int64 tensor that every later launch fills with its blocks' clock readings
# (benchmark/profile_step.py --step-trace); read it with trace_view()
_TRACE: torch.Tensor | None = None
_TRACE_MAX_LAYERS = 256
_last_grid = 0  # blocks of the last launch made (the trace's layout)


def _buffers(sw: StepWeights, splits: int, batch: int) -> _Buffers:
    """The step's scratch, once per model shape and batch size: kept, so CUDA graphs replay on the same
    addresses. The words start at zero, a tag no launch waits for; the counters start at zero and the kernel
    advances the tags' base by the layer count each launch. Each batch size has its own, so every launch
    writes every word of its buffers at every layer: a word is never left behind long enough for the 16-bit
    tags to come round to the one a reader waits for."""
    lw = sw.layers[0]
    dev, dtype = lw.qkv.device, lw.qkv.dtype
    hidden, inter, n_qkv = lw.qkv.shape[1], lw.down.shape[1], lw.qkv.shape[0]
    key = (dev, dtype, hidden, inter, n_qkv, sw.heads, sw.kv_heads, sw.head_dim, splits, batch)
    if key not in _BUFFERS:
        word = torch.int32 if dtype == torch.bfloat16 else torch.int64

        def rows(n: int) -> torch.Tensor:
            return torch.zeros((batch, n), dtype=dtype, device=dev)

        def words(n: int, dt: torch.dtype = word) -> torch.Tensor:
            return torch.zeros(batch * n, dtype=dt, device=dev)

        _BUFFERS[key] = _Buffers(
            rows(hidden),
            rows(hidden),
            words(n_qkv),
            words(sw.heads * sw.head_dim),
            words(hidden),
            words(inter),
            words(hidden),
            words(sw.heads * splits * sw.head_dim, torch.int64),
            words(sw.heads * splits, torch.int64),
            torch.zeros(2, dtype=torch.int32, device=dev),
        )
    return _BUFFERS[key]


def trace(device: torch.device) -> None:
    """Makes every later launch on device record its blocks' clock64 readings (trace_view); call it before
    any launch is captured in a CUDA graph."""
    global _TRACE
    blocks = torch.cuda.get_device_properties(device).multi_processor_count
    _TRACE = torch.zeros(blocks * (_TRACE_MAX_LAYERS * _TRACE_POINTS + 4), dtype=torch.int64, device=device)


def trace_view(num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last launch's readings (on the CPU): [blocks, layers, 5 stages, 5 points] of clock64 (stage start,
    next weights issued, inputs in, weights in, done; attention: start, issued, q in, split written,
    merged), and [blocks, 4]: (clock64, globaltimer ns) at the block's start and end."""
    assert _TRACE is not None and _last_grid, "trace() was not called, or no launch was made since"
    t, blocks = _TRACE.cpu(), _last_grid
    n = blocks * num_layers * _TRACE_POINTS
    return t[:n].view(blocks, num_layers, 5, 5), t[n : n + 4 * blocks].view(blocks, 4)


def _vec_rows(batch: int) -> int:
    """The input rows a batch's projections dot with each weight row: 1, 2, 4 or 8 (decode_step.cu's
    vec_rows; the rows past the batch's are dotted and dropped)."""
    return batch if batch <= 2 else 4 if batch <= 4 else MAX_BATCH


def _smem(device: torch.device, sw: StepWeights, batch: int) -> tuple[int, int, int, int]:
    """(ring bytes, vec elements, scratch floats, total bytes) of the kernel's shared memory, laid out as
    decode_step.cu's kernel does: the weight ring; the projections' input rows (_vec_rows of them), the
    batch's h and h2 and the next norm's weights (of the model's dtype); the layers' pointer table (int64);
    the position's cos / sin; the attention's scratch (attend() lays it out) and batch * NW floats of
    reduction."""
    props = torch.cuda.get_device_properties(device)
    limit = getattr(props, "shared_memory_per_block_optin", 227 * 1024)
    lw = sw.layers[0]
    hidden, inter, itemsize = lw.qkv.shape[1], lw.down.shape[1], lw.qkv.element_size()
    group, d = sw.heads // sw.kv_heads, sw.head_dim
    vec = -(-max(hidden, inter, sw.heads * d, 2 * d) // 8) * 8
    nw = _THREADS_WARPS
    table = -(-len(sw.layers) * len(_LAYER_FIELDS) // 2) * 2
    scratch = (group + 2) * d + group * d + d + (group + 1) * d + 2 * nw * _MAX_GROUP + nw * group * d
    fixed = itemsize * ((_vec_rows(batch) + 1) * vec + 2 * batch * hidden)
    fixed += 8 * table + 4 * (d + scratch + batch * nw)
    ring = (limit - fixed - _STATIC_SMEM) // 256 * 256
    return ring, vec, scratch, fixed + ring


def _grid(sw: StepWeights, device: torch.device) -> int:
    """One block an SM, every block with a unit of every projection (the tagged words' ordering needs it)."""
    lw = sw.layers[0]
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return min(sms, lw.qkv.shape[1], lw.down.shape[1], lw.qkv.shape[0])


def serves(sw: StepWeights, batch: int) -> bool:
    """Whether the kernel runs a step of `batch` requests of this model: at most MAXB, a block for each
    request's every KV head, and the batch's rows leaving at least _MIN_RING bytes of weight ring."""
    dev = sw.table.device
    return (
        1 <= batch <= MAX_BATCH
        and batch * sw.kv_heads <= _grid(sw, dev)
        and _smem(dev, sw, batch)[0] >= _MIN_RING
    )


def _model_fields(sw: StepWeights, x: torch.Tensor, buf: _Buffers, splits: int) -> dict[str, int]:
    """The argument block's shapes, weights, rotary table and scratch addresses."""
    lw, cache = sw.layers[0], sw.cos_sin_cache
    return {
        "layers": sw.table.data_ptr(),
        "num_layers": len(sw.layers),
        "hidden": lw.qkv.shape[1],
        "heads": sw.heads,
        "kv_heads": sw.kv_heads,
        "head_dim": sw.head_dim,
        "inter": lw.down.shape[1],
        "rot_half": cache.shape[-1] // 2,
        "splits": splits,
        "x_in": x.data_ptr(),
        **{name: getattr(buf, name).data_ptr() for name in _Buffers._fields},
        "cos_sin": cache.data_ptr(),
        "stride_cs": cache.stride(0),
    }


def _pool_fields(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    page_table: torch.Tensor,
    table_idx: torch.Tensor,
    seq_lens: torch.Tensor,
    out_loc: torch.Tensor,
    positions: torch.Tensor,
) -> dict[str, int]:
    """The argument block's KV pool and batch-index addresses; idx64 flags the int64 index tensors."""
    idx = (seq_lens, positions, table_idx, out_loc)
    assert all(t.dtype in (torch.int32, torch.int64) for t in idx)
    return {
        "k_cache": k_buffer.data_ptr(),
        "v_cache": v_buffer.data_ptr(),
        "kv_layer_stride": k_buffer.stride(0),
        "stride_kt": k_buffer.stride(1),
        "stride_kh": k_buffer.stride(2),
        "page_table": page_table.data_ptr(),
        "stride_pt": page_table.stride(0),
        "table_idx": table_idx.data_ptr(),
        "seq_lens": seq_lens.data_ptr(),
        "out_loc": out_loc.data_ptr(),
        "positions": positions.data_ptr(),
        "idx64": sum(1 << i for i, t in enumerate(idx) if t.dtype == torch.int64),
    }


def decode_step(
    x: torch.Tensor,
    sw: StepWeights,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    page_table: torch.Tensor,
    table_idx: torch.Tensor,
    seq_lens: torch.Tensor,
    out_loc: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer of a decode step of x.shape[0] requests (at most MAXB, where serves()) on their embedding
    rows x [batch, hidden]: (the last MLP output, the residual), as the layers' own forward returns them;
    the new K/V stored in k_buffer / v_buffer ([layers, slots, kv_heads, head_dim]). The index tensors hold
    a row a request. The outputs live in kept buffers, overwritten by the next call of the same batch size."""
    lib = _load()
    batch = x.shape[0]
    assert lib is not None and x.is_contiguous() and serves(sw, batch)
    lw = sw.layers[0]
    dev = x.device
    assert k_buffer.dtype == x.dtype == lw.qkv.dtype and k_buffer.stride() == v_buffer.stride()
    assert k_buffer.stride(-1) == 1 and page_table.dtype == torch.int32 and page_table.stride(-1) == 1
    assert x.data_ptr() % 16 == 0, "the embedding rows are read in 16-byte pieces"
    grid = _grid(sw, dev)
    splits = max(1, min(_MAX_SPLITS, grid // (batch * sw.kv_heads)))
    if ENV.decode_step_splits:  # a measurement knob: fewer, longer splits, a shorter merge
        splits = min(splits, ENV.decode_step_splits)
    global _last_grid
    _last_grid = grid
    buf = _buffers(sw, splits, batch)
    ring, vec, scratch, smem = _smem(dev, sw, batch)
    values = _model_fields(sw, x, buf, splits)
    values["batch"] = batch
    values.update(_pool_fields(k_buffer, v_buffer, page_table, table_idx, seq_lens, out_loc, positions))
    traced = _TRACE is not None and _TRACE.device == dev and len(sw.layers) <= _TRACE_MAX_LAYERS
    values.update(
        ring_bytes=ring, vec_elems=vec, scratch_floats=scratch, trace=_TRACE.data_ptr() if traced else 0
    )
    cache = sw.cos_sin_cache
    assert cache.dtype == torch.float32 and cache.stride(-1) == 1
    args = (ctypes.c_int64 * len(_FIELDS))(*(values[f] for f in _FIELDS))
    stream = torch.cuda.current_stream(dev).cuda_stream
    err = lib.minisgl_decode_step(
        args, lw.eps, scale * math.log2(math.e), _DTYPES[x.dtype], grid, smem, ctypes.c_void_p(stream)
    )
    if err:
        raise RuntimeError(f"decode_step launch failed: {lib.minisgl_step_error(err).decode()}")
    return buf.y, buf.h2
