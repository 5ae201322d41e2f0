"""Kernels: each op has a torch reference (kernel/reference.py) and may have a Triton version.

The Triton versions are used on CUDA tensors when Triton is importable; everything else takes the
reference path. `use_triton(False)` forces the reference (the tests compare the two).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.gguf.stored import StoredWeight

from . import cpu, stored
from . import reference as ref
from .args import LayerWeights, SamplingRows, SplitAttention
from .args import Rope as Rope  # re-exported: the rotary layer and the attention backends build one
from .step_kernel import MAX_BATCH, StepWeights

DECODE_STEP_MAX_BATCH = MAX_BATCH  # the requests one decode_step launch serves, at most
_TRITON_ENABLED = True
_CPU_PACKED_LINEAR = torch.backends.mkldnn.is_available()
_HALF = (torch.bfloat16, torch.float16)


def use_triton(enabled: bool) -> None:
    """Whether CUDA tensors take the Triton kernels (False: the torch reference, for comparisons)."""
    global _TRITON_ENABLED
    _TRITON_ENABLED = enabled


def _triton_kernels():
    """The Triton kernels (kernel/triton), or None when they are switched off or Triton is missing."""
    if not _TRITON_ENABLED:
        return None
    try:
        from . import triton as triton_kernels
    except ImportError:
        return None
    return triton_kernels


def decode_layer(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weights: LayerWeights,
    num_heads: int,
    num_kv_heads: int,
    cos_sin_cache: torch.Tensor,
    attention: dict,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole dense decoder layer of a one-request decode step in one launch (kernel/triton/layer.py):
    (the MLP's output, the new residual) of x on the stream x + residual, the new K/V stored. `attention`:
    the attention backend's layer_inputs for the layer. The layer kernel has no torch form: the layer's
    own modules are its reference."""
    kernels = _triton_kernels()
    assert kernels is not None, "the layer kernel needs Triton"
    return kernels.decode_layer(
        x, residual, weights, num_heads, num_kv_heads, cos_sin_cache=cos_sin_cache, **attention
    )


def decode_layer_fits(weights: LayerWeights) -> bool:
    """Whether decode_layer serves a layer of these weights (Triton there, every width within its tile)."""
    kernels = _triton_kernels()
    return kernels is not None and kernels.layer_fits(
        weights.qkv.shape[1], weights.down.shape[1], weights.o.shape[1]
    )


def decode_step_available(device: torch.device) -> bool:
    """Whether kernel.decode_step may run on device (kernel/step_kernel.py: a Hopper GPU, nvcc, not switched
    off)."""
    from . import step_kernel as step

    return step.available(device)


def decode_step_fits(weights: LayerWeights, num_heads: int, num_kv_heads: int) -> bool:
    """Whether decode_step serves a layer of these weights and head counts."""
    from . import step_kernel as step

    head_dim = weights.o.shape[1] // num_heads
    return step.fits(weights, num_heads, num_kv_heads, head_dim)


def step_weights(
    layers: list[LayerWeights], num_heads: int, num_kv_heads: int, head_dim: int, cos_sin_cache: torch.Tensor
) -> StepWeights:
    """Every layer's tensors packed for decode_step (a step_kernel.StepWeights)."""
    from . import step_kernel as step

    return step.step_weights(layers, num_heads, num_kv_heads, head_dim, cos_sin_cache)


def decode_step_serves(weights: StepWeights, batch: int) -> bool:
    """Whether decode_step runs a step of `batch` requests of the model these weights are (at most eight,
    as its shared memory and blocks allow)."""
    from . import step_kernel as step

    return step.serves(weights, batch)


_step_calls = 0


def decode_step_calls() -> int:
    """How many times decode_step has been called in this process (eager steps and graph captures): a graph
    runner tells from it whether a capture ran the kernel (a model it does not serve runs its layers)."""
    return _step_calls


def decode_step(x: torch.Tensor, weights: StepWeights, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Every dense layer of a decode step of up to eight requests in one CUDA launch (kernel/step_kernel.py):
    (the last MLP output, the residual) of the embedding rows x. `inputs`: the attention backend's
    step_inputs. Its reference is the layers' own modules."""
    from . import step_kernel as step

    global _step_calls
    _step_calls += 1
    return step.decode_step(x, weights, **inputs)


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b). On a CPU in float32 the weight is packed once (kept on the tensor, redone if it
    is written to) for the C kernel of kernel/cpu/, or where that is not built, for oneDNN; both beat
    MKL's GEMM at decode's row counts (the wide LM head most of all; docs/BENCHMARKS.md). On a
    CPU in bf16/fp16 the same C kernel runs on the exactly upcast inputs and rounds the result once.
    x may be a SplitAttention (decode attention not merged yet); weight may be a StoredWeight (GGUF blocks
    or half-precision rows, dequantized inside the C kernel: kernel/stored.py)."""
    if isinstance(weight, StoredWeight):
        return stored.linear(x, weight, bias)
    if isinstance(x, SplitAttention):
        ops = _triton_kernels()
        if ops is not None and ops.gemv_merge_fits(x, weight):
            return ops.gemv_merged(x, weight, bias)
        x = x.merge()
    if x.is_cuda:
        return _gpu_linear(x, weight, bias)
    if (
        x.device.type == "cpu"
        and x.dtype in _HALF
        and weight.dtype == x.dtype
        and _CPU_PACKED_LINEAR
        and cpu.linear_available()
    ):
        # Most CPUs have no bf16/fp16 arithmetic (torch's half matmuls run many times slower). A
        # half-precision GEMM multiplies exactly upcast inputs and accumulates in float32, so the float32
        # kernel on upcast inputs, rounded once at the end, computes the same thing at float32 speed.
        packed = _cpu_packed_weight(weight)
        if packed is not None:
            y = cpu.linear(x.float(), packed, weight.shape[0], None if bias is None else bias.float())
            return y.to(x.dtype)
    if x.device.type == "cpu" and x.dtype == torch.float32 and _CPU_PACKED_LINEAR:
        packed = _cpu_packed_weight(weight)
        if packed is not None and cpu.linear_available():
            return cpu.linear(x, packed, weight.shape[0], bias)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _cpu_packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of `weight`: for the C kernel where it is built, else oneDNN's; None (and F.linear
    from then on) where neither is available."""
    global _CPU_PACKED_LINEAR
    cached = getattr(weight, "_minisgl_packed", None)
    if cached is not None and cached[0] == weight._version:
        return cached[1]
    try:
        if cpu.linear_available():
            packed = cpu.pack_weight(weight.float())  # half weights: upcast exactly, once
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 256)
    except (AttributeError, RuntimeError):
        _CPU_PACKED_LINEAR = False
        return None
    weight._minisgl_packed = (weight._version, packed)
    return packed


def _gpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """On a GPU: the Triton GEMV at one row and the Triton GEMM at 2..16 rows, where they beat cuBLAS
    (docs/BENCHMARKS.md); cuBLAS everywhere else."""
    ops = _triton_kernels()
    if ops is not None and ops.gemv_fits(x, weight):
        return ops.gemv(x, weight, bias)
    if ops is not None and ops.gemm_fits(x, weight):
        return ops.gemm(x, weight, bias)
    return F.linear(x, weight, bias)


def silu_and_mul_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """linear(silu_and_mul(x), W, b): the gated MLP's down projection, one kernel at GPU decode sizes."""
    ops = _triton_kernels() if _on_gpu(x) else None
    if ops is not None and ops.gemv_fits(x, weight):
        return ops.gemv(x, weight, bias, gated=True)
    if ops is not None and ops.gemm_fits(x, weight, gated=True):
        return ops.gemm(x, weight, bias, gated=True)
    return linear(silu_and_mul(x), weight, bias)


def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm projection: h = x + residual (x when residual is None); returns (linear(rms_norm(h)), h).
    One kernel at GPU decode sizes; elsewhere the (fused) norm, then linear."""
    ops = _triton_kernels() if _on_gpu(x) else None
    if ops is not None and x.is_contiguous() and (residual is None or residual.is_contiguous()):
        if ops.gemv_fits(x, weight):
            return ops.gemv_add_rms_norm(x, residual, norm_weight, eps, weight, bias)
        if ops.gemm_fits(x, weight):
            return ops.gemm_add_rms_norm(x, residual, norm_weight, eps, weight, bias)
    if residual is None:
        normed, h = rms_norm(x, norm_weight, eps), x
    else:
        normed, h = fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias), h


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) as int32 for 2-D logits: a two-pass Triton kernel on a GPU (torch's single pass
    reads a large batch of vocabulary-wide rows far below the bandwidth: docs/BENCHMARKS.md), two vector
    passes in C on a CPU in float32 (torch's took ~1 ms a decode batch there), torch elsewhere."""
    if x.dim() == 2 and x.numel() and cpu.elementwise_ok(x):
        out = cpu.argmax(x)
        if out is not None:
            return out
    ops = _triton_kernels() if _on_gpu(x) else None
    if ops is not None and x.dim() == 2 and x.stride(-1) == 1:
        return ops.argmax(x)
    return x.argmax(dim=-1).to(torch.int32)


def sample(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Each row's token [S] int32 under its temperature, min-p, top-k, top-p and noise keys: one Triton
    kernel on a GPU (no sort, no host sync), the torch reference (the same kept set and noise) elsewhere."""
    ops = _triton_kernels() if _on_gpu(logits) else None
    if ops is not None and logits.dim() == 2 and logits.stride(-1) == 1:
        return ops.sample(logits, rows)
    return ref.sample(logits, rows)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 2 and cpu.elementwise_ok(x, weight):
        return cpu.rms_norm(x, weight, eps)
    ops = _triton_kernels() if _on_gpu(x) else None
    if ops is not None:
        return ops.rms_norm(x, weight, eps)
    return ref.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() == 2 and cpu.elementwise_ok(x, residual, weight):
        return cpu.rms_norm(x, weight, eps, residual)
    ops = _triton_kernels() if _on_gpu(x) else None
    if ops is not None:
        return ops.fused_add_rms_norm(x, residual, weight, eps)
    return ref.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2 and cpu.elementwise_ok(x):
        return cpu.silu_and_mul(x)
    ops = _triton_kernels() if _on_gpu(x) else None
    if ops is not None:
        return ops.silu_and_mul(x)
    return ref.silu_and_mul(x)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_store: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotary on q and k. kv_store = (k_cache, v_cache, out_loc, v): also store the rotated k and v into
    the KV pool rows out_loc (one kernel on a GPU) and return (q, None)."""
    if cpu.elementwise_ok(q, k, cos_sin_cache) and q.stride(1) == q.shape[2] and k.stride(1) == k.shape[2]:
        return _then_store(*cpu.apply_rotary(q, k, positions, cos_sin_cache), kv_store)  # in place
    ops = _triton_kernels() if _on_gpu(q) else None
    if ops is not None:
        return ops.apply_rotary(q, k, positions, cos_sin_cache, kv_store)
    return _then_store(*ref.apply_rotary(q, k, positions, cos_sin_cache), kv_store)


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_store: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over each head of q and k, then rotary (Qwen3): one kernel on a GPU; kv_store as in
    apply_rotary."""
    ops = _triton_kernels() if _on_gpu(q) else None
    if ops is not None:
        return ops.qk_norm_rotary(q, k, q_weight, k_weight, eps, positions, cos_sin_cache, kv_store)
    return _then_store(*ref.qk_norm_rotary(q, k, q_weight, k_weight, eps, positions, cos_sin_cache), kv_store)


def _then_store(
    q: torch.Tensor, k: torch.Tensor, kv_store: tuple | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if kv_store is None:
        return q, k
    k_cache, v_cache, out_loc, v = kv_store
    store_kv(k_cache, v_cache, out_loc, k, v)
    return q, None


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, out_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    if cpu.elementwise_ok(k_cache, v_cache, k, v) and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2]:
        return cpu.store_kv(k_cache, v_cache, out_loc, k, v)
    ops = _triton_kernels() if _on_gpu(k) else None
    if ops is not None:
        return ops.store_kv(k_cache, v_cache, out_loc, k, v)
    return ref.store_kv(k_cache, v_cache, out_loc, k, v)
