"""A decode step's device kernels against the bytes each must move: the table of
`python -m minisgl.benchmark.profile_step --kernel-table`.

Three pure parts, each testable without a GPU:
- the bytes model (`decode_step_bytes`): per op of a dense decoder's decode step, the fewest bytes its
  kernel must move (weights once, activations in and out once, the K/V of every key once), following the
  GPU dispatch of kernel/__init__.py (GEMV at one row, the Triton GEMM at 2..16 rows with the norm or SiLU
  fused in, cuBLAS beyond with separate RMSNorm and SiLU-and-mul kernels) and the Triton attention
  backend's split-KV decode (rotary, q/k norm and the KV store inside it; its merge a kernel of its own,
  or inside the O projection's GEMV at one request);
- the attribution (`attribute`): each profiled device kernel to one op, by name (`kernel_kind`) and, for
  the projections, by position: the step launches them in model order (QKV, O, gate/up, down per layer,
  then the LM head), so the i-th projection kernel of a step is known whatever library ran it;
- the table (`build_rows`, `markdown`): per op, launches, time, bytes, the time those bytes take at the
  copy bandwidth (the floor) and how close the kernels come to it.

Under programmatic dependent launch a kernel starts before the previous one ends (it prefetches its
weights, then waits), so kernel spans overlap: each row also gives its exclusive time (the part of its
spans no earlier kernel covers); these add up to the device's busy time, and the step's wall time minus
that is the time the device sat idle between kernels.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minisgl.models import ModelConfig

# the ops of a step, in launch order (the table's row order); PROJECTIONS are labelled by position
PROJECTIONS = ("qkv proj", "o proj", "gate_up proj", "down proj")
LM_HEAD = "lm head"
OPS = (
    "small ops",
    "embed",
    "qkv proj",
    "rotary / kv store",
    "attention",
    "attn merge",
    "o proj",
    "rms norm",
    "gate_up proj",
    "silu_and_mul",
    "down proj",
    "moe",
    LM_HEAD,
    "projections",  # every projection kernel in one row when their count does not give the positions
    "argmax",
    "sampling",
    "memcpy / memset",
    "other",
)

# Kernel-dispatch limits of kernel/triton/gemm.py (tests/test_kernel_table.py checks they agree)
GEMM_MAX_ROWS = 16
GEMM_MAX_BYTES = 16 << 20
ARGMAX_BLOCK = 8192  # kernel/triton/argmax.py: vocabulary entries a program reads


@dataclass(frozen=True)
class DecodeShape:
    """What the bytes model needs of a dense decoder (one rank), with the activation / weight and K/V
    element sizes."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    dtype_bytes: int = 2
    kv_bytes: int = 2
    qk_norm: bool = False  # Qwen3's RMSNorm over each head of q and k (its weights are read too)

    @classmethod
    def of(cls, cfg: ModelConfig, dtype_bytes: int = 2, kv_bytes: int = 2) -> DecodeShape:
        """The shape of a ModelConfig; a mixture-of-experts model is refused (its MLP is not modelled)."""
        if cfg.moe is not None:
            raise ValueError(f"the kernel table models dense decoders; {cfg.architecture} has experts")
        return cls(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.vocab_size,
            cfg.num_layers,
            dtype_bytes,
            kv_bytes,
            qk_norm=cfg.architecture.startswith("Qwen3"),
        )


@dataclass(frozen=True)
class OpBytes:
    """An op's fewest bytes a step (all layers) and the kernels the dispatch launches for it a step
    (None: not modelled)."""

    bytes: int
    launches: int | None


def projection_path(rows: int, n: int, k: int, elem: int, gated: bool = False) -> str:
    """Which kernel serves y = x W^T for W [n, k] at `rows` rows on a GPU, as kernel._gpu_linear,
    silu_and_mul_linear and add_rms_norm_linear decide: "gemv" (one row), "gemm" (the Triton GEMM: 2..16
    rows, K a multiple of 64, W at most 16 MB) or "cublas". gated: W's input is silu(gate) * up."""
    del gated  # the gated GEMM has the same limits; the argument documents the call sites
    if rows == 1:
        return "gemv"
    if 2 <= rows <= GEMM_MAX_ROWS and k % 64 == 0 and n * k * elem <= GEMM_MAX_BYTES:
        return "gemm"
    return "cublas"


def used_splits(seq_len: int, num_splits: int, block_n: int) -> int:
    """Splits of the split-KV decode kernel that hold keys for a sequence of seq_len keys: the sequence
    over num_splits, rounded up to whole key blocks (kernel/triton/attention.py's _split_len)."""
    per_split = -(-seq_len // num_splits)  # ceil division throughout
    chunk = -(-per_split // block_n) * block_n
    return -(-seq_len // chunk)


def _projection(shape: DecodeShape, b: int, n: int, k: int, inputs: int) -> int:
    """Bytes of one projection: W once, its inputs (given) and its output [b, n] once."""
    return n * k * shape.dtype_bytes + inputs + b * n * shape.dtype_bytes


def decode_step_bytes(
    shape: DecodeShape, seq_lens: Sequence[int], num_splits: int = 1, block_n: int = 64
) -> dict[str, OpBytes]:
    """Per op, the fewest bytes one decode step moves, for the batch whose rows hold seq_lens keys each
    (the new one included; padding rows of a graph count, with 1 key), num_splits KV splits a request."""
    b, e, w = len(seq_lens), shape.dtype_bytes, shape.dtype_bytes
    h, layers, d = shape.hidden, shape.layers, shape.head_dim
    q_dim, kv_dim = shape.heads * d, shape.kv_heads * d
    out: dict[str, OpBytes] = {}
    # graph inputs copy, page-table write, input-ids gather, positions + 1, token-pool write: int32 rows
    out["small ops"] = OpBytes(22 * 4 * b, None)  # launches not modelled (torch's indexing may add casts)
    out["embed"] = OpBytes(b * 4 + b * h * w + b * h * e, 1)

    # pre-norm projections: fused norm (GEMV / GEMM) reads x (+ residual, writing h) and the norm weight
    norms = [0, 0]  # standalone RMSNorm launches: (without residual, with residual)
    qkv_n, up_n = q_dim + 2 * kv_dim, 2 * shape.intermediate
    qkv = up = 0
    for layer in range(layers):
        for n, is_qkv in ((qkv_n, True), (up_n, False)):
            residual = not (is_qkv and layer == 0)  # the first layer's input has no residual yet
            if projection_path(b, n, h, w) == "cublas":
                norms[residual] += 1
                inputs = b * h * e  # the normed rows
            else:
                inputs = b * h * e + h * w + (2 * b * h * e if residual else 0)
            if is_qkv:
                qkv += _projection(shape, b, n, h, inputs)
            else:
                up += _projection(shape, b, n, h, inputs)
    out["qkv proj"] = OpBytes(qkv, layers)
    out["gate_up proj"] = OpBytes(up, layers)

    out.update(_attention_bytes(shape, seq_lens, num_splits, block_n))
    merged_in_o = b == 1 and num_splits > 1  # the fusion plan's merge_in_o_proj
    if merged_in_o:
        o_in = used_splits(seq_lens[0], num_splits, block_n) * shape.heads * (d + 1) * 4 + 4
    else:
        o_in = b * q_dim * e
    out["o proj"] = OpBytes(layers * _projection(shape, b, h, q_dim, o_in), layers)

    i = shape.intermediate
    gated_fused = projection_path(b, h, i, w, gated=True) != "cublas"
    down_in = b * 2 * i * e if gated_fused else b * i * e
    out["down proj"] = OpBytes(layers * _projection(shape, b, h, i, down_in), layers)
    silu = 0 if gated_fused else layers
    out["silu_and_mul"] = OpBytes(silu * (b * 2 * i * e + b * i * e), silu)

    norms[1] += 1  # the final norm: always its own kernel, with the last residual
    norm_bytes = norms[0] * (2 * b * h * e + h * w) + norms[1] * (4 * b * h * e + h * w)
    out["rms norm"] = OpBytes(norm_bytes, sum(norms))

    out[LM_HEAD] = OpBytes(_projection(shape, b, shape.vocab, h, b * h * e), 1)
    chunks = -(-shape.vocab // ARGMAX_BLOCK)
    out["argmax"] = OpBytes(b * shape.vocab * e + 2 * b * chunks * 8 + b * 4, 2)
    return out


def step_stage_bytes(shape: DecodeShape, context: int) -> tuple[int, ...]:
    """The one-kernel decode step's stages (qkv, attention, o, gate_up, down) of one layer of one request
    at `context` keys: the bytes each must read at least, its weights (with the norm's) or its keys' and
    values' rows with their page-table entries (and the new K and V stored)."""
    h, d, i, w = shape.hidden, shape.head_dim, shape.intermediate, shape.dtype_bytes
    q_dim, kv_dim = shape.heads * d, shape.kv_heads * d
    attention = context * (2 * kv_dim * shape.kv_bytes + 4) + 2 * kv_dim * shape.kv_bytes
    attention += 2 * d * w if shape.qk_norm else 0
    return (
        (q_dim + 2 * kv_dim) * h * w + h * w,
        attention,
        h * q_dim * w,
        2 * i * h * w + h * w,
        h * i * w,
    )


def _attention_bytes(
    shape: DecodeShape, seq_lens: Sequence[int], num_splits: int, block_n: int
) -> dict[str, OpBytes]:
    """The split-KV decode kernel (every key's K and V and page-table entry once; q, the new k/v and
    their store into the pool; the rotary table row; the partial outputs or the output) and the merge."""
    b, e, d, layers = len(seq_lens), shape.dtype_bytes, shape.head_dim, shape.layers
    keys = sum(seq_lens)
    kv_dim = shape.kv_heads * d
    per_layer = keys * (2 * kv_dim * shape.kv_bytes + 4)  # K and V, and the int32 page-table entry
    per_layer += b * shape.heads * d * e + 2 * b * kv_dim * e + 2 * b * kv_dim * shape.kv_bytes
    per_layer += b * d * 4 + 4 * b * 4  # the cos|sin row (float32) and positions, slots, rows, lengths
    per_layer += 2 * d * e if shape.qk_norm else 0
    merge = 0
    if num_splits > 1:  # partial outputs and log2-sum-exps (float32) of the splits that hold keys
        parts = sum(used_splits(n, num_splits, block_n) for n in seq_lens) * shape.heads * (d + 1) * 4
        per_layer += parts
        if b > 1:  # one request: the O projection merges them instead
            merge = parts + b * shape.heads * d * e + b * 4
    else:
        per_layer += b * shape.heads * d * e
    merges = layers if merge else 0
    return {
        "attention": OpBytes(layers * per_layer, layers),
        "attn merge": OpBytes(layers * merge, merges),
    }


# ---- kernel names -----------------------------------------------------------------------------------
# (pattern, kind) in order, first match wins; "projection" kernels are labelled by position, a "gemm
# helper" (cuBLAS's split-K reduction) joins the projection before it
_KINDS = [
    (r"^memcpy|^memset", "memcpy / memset"),
    (r"moe|_route_kernel|_count_kernel|_place_kernel|_gate_up_kernel|_down_kernel|_sum_kernel", "moe"),
    (r"argmax", "argmax"),
    (r"_stats_kernel|_search_kernel|_draw_kernel|_pick_kernel|sampl", "sampling"),
    (r"decode_merge|merge_splits", "attn merge"),
    (r"decode_split|extend_kernel|attention|flash|fmha", "attention"),
    (r"rotary|store_kv|_rope|rope_", "rotary / kv store"),
    (r"rms_norm|rmsnorm|layer_norm", "rms norm"),
    (r"silu_and_mul|silu|swiglu|act_and_mul", "silu_and_mul"),
    (r"splitkreduce|splitk_reduce|reduce_splitk", "gemm helper"),
    (
        r"gemv|gemm|nvjet|cutlass|xmma|cublas|wgmma|s16816|s1688|tensorop|sm90_|sm80_|ampere_|hopper_",
        "projection",
    ),
    (r"indexselect|index_select|vectorized_gather|embedding", "embed"),
    (r"elementwise|index|scatter|gather|fill|copy|cat|arange", "small ops"),
]
_KIND_RES = [(re.compile(p, re.IGNORECASE), kind) for p, kind in _KINDS]


def kernel_kind(name: str) -> str:
    """The op family of a device kernel (or memcpy / memset) by its name; "other" when none matches."""
    for pattern, kind in _KIND_RES:
        if pattern.search(name):
            return kind
    return "other"


def _outer(s: str) -> str:
    """s without <...> and (...) at any depth."""
    depth, kept = 0, []
    for ch in s:
        if ch in "<(":
            depth += 1
        elif ch in ">)" and depth:
            depth -= 1
        elif not depth:
            kept.append(ch)
    return "".join(kept).strip()


def short_name(name: str, width: int = 48) -> str:
    """A kernel name without its return type, namespaces, template arguments and parameter list; a
    generic CUTLASS wrapper (Kernel, Kernel2, device_kernel) is named by its first template argument."""
    s = name.strip()
    if kernel_kind(s) == "memcpy / memset":  # "Memcpy HtoD (Pinned -> Device)": no C++ to strip
        return s
    s = s.removeprefix("void ")
    base = _outer(s).rsplit("::", 1)[-1] or s
    if base in ("Kernel", "Kernel2", "device_kernel") and "<" in s:
        start, depth = s.index("<"), 0
        for end in range(start, len(s)):  # the '>' closing the first '<'
            depth += {"<": 1, ">": -1}.get(s[end], 0)
            if depth == 0:
                break
        first = s[start + 1 : end].split(",", 1)[0]
        base = _outer(first).rsplit("::", 1)[-1] or base
    return base if len(base) <= width else base[: width - 3] + "..."


# ---- attribution ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceEvent:
    """One device activity of a profile: a kernel, a memcpy or a memset (times in microseconds)."""

    name: str
    start: float
    dur: float


def attribute(events: Sequence[DeviceEvent], layers: int) -> list[str]:
    """The op of each event (events sorted by start). Projection kernels come qkv, o, gate_up, down per
    layer and then the LM head, 4 * layers + 1 a step: when their count is a whole number of steps they
    are labelled by position, otherwise they all go to "projections"."""
    kinds = [kernel_kind(ev.name) for ev in events]
    per_step = 4 * layers + 1
    count = kinds.count("projection")
    by_position = count > 0 and count % per_step == 0
    labels: list[str] = []
    seen, last = 0, None
    for kind in kinds:
        if kind == "projection":
            last = "projections"
            if by_position:
                i = seen % per_step
                last = LM_HEAD if i == per_step - 1 else PROJECTIONS[i % 4]
            seen += 1
            labels.append(last)
        elif kind == "gemm helper":
            labels.append(last or "other")  # part of the GEMM launched just before it
        else:
            labels.append(kind)
    return labels


def exclusive_times(events: Sequence[DeviceEvent]) -> list[float]:
    """Each event's time not covered by an earlier-starting event (events sorted by start): the parts of
    overlapping spans are counted once, so the sum is the time the device was busy."""
    out, covered = [], -math.inf
    for ev in events:
        end = ev.start + ev.dur
        out.append(max(0.0, end - max(ev.start, covered)))
        covered = max(covered, end)
    return out


@dataclass
class Row:
    """One op's line of the table, per step."""

    op: str
    kernels: dict[str, float] = field(default_factory=dict)  # short name -> launches a step
    launches: float = 0.0
    helper_launches: float = 0.0  # of them, cuBLAS's split-K reductions (the model counts GEMMs only)
    us: float = 0.0  # the kernels' spans
    exclusive_us: float = 0.0
    bytes: int | None = None
    model_launches: int | None = None  # what the bytes model expects (None: not modelled)

    def floor_us(self, bandwidth: float) -> float | None:
        """The time the op's bytes take at `bandwidth` bytes/s (None: bytes unknown)."""
        return None if self.bytes is None else self.bytes / bandwidth * 1e6


def build_rows(
    events: Sequence[DeviceEvent], steps: int, layers: int, model: dict[str, OpBytes]
) -> list[Row]:
    """The table's rows, per step over `steps` profiled steps, in OPS order: the events attributed to
    ops, each op with the bytes `model` gives it (unknown for ops it does not model)."""
    events = sorted(events, key=lambda ev: ev.start)
    rows: dict[str, Row] = {}
    for ev, op, excl in zip(events, attribute(events, layers), exclusive_times(events)):
        row = rows.setdefault(op, Row(op))
        key = short_name(ev.name)
        row.kernels[key] = row.kernels.get(key, 0.0) + 1 / steps
        row.launches += 1 / steps
        if kernel_kind(ev.name) == "gemm helper":
            row.helper_launches += 1 / steps
        row.us += ev.dur / steps
        row.exclusive_us += excl / steps
    if "projections" in rows:  # positions unknown: the row holds every projection, so all their bytes
        projs = [model[op] for op in (*PROJECTIONS, LM_HEAD) if op in model]
        total = OpBytes(sum(p.bytes for p in projs), sum(p.launches or 0 for p in projs))
        model = dict(model, projections=total)
    for op, row in rows.items():
        if op in model:
            row.bytes, row.model_launches = model[op].bytes, model[op].launches
    return [rows[op] for op in OPS if op in rows]


# ---- output -----------------------------------------------------------------------------------------
def fmt_bytes(n: int | None) -> str:
    """Bytes in decimal units: 8.39 MB."""
    if n is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _kernels_cell(kernels: dict[str, float], limit: int = 3) -> str:
    names = sorted(kernels, key=lambda k: -kernels[k])
    cell = ", ".join(f"`{k}`" + (f" x{kernels[k]:g}" if len(kernels) > 1 else "") for k in names[:limit])
    return cell + (f", +{len(names) - limit} more" if len(names) > limit else "")


def _launches_cell(row: Row) -> str:
    text = f"{row.launches:g}"
    main = row.launches - row.helper_launches
    if row.model_launches is not None and abs(main - row.model_launches) > 1e-6:
        text += f" (model: {row.model_launches})"  # the dispatch ran other kernels than modelled
    return text


@dataclass
class Table:
    """A kernel table and what its totals need: the step's wall time (timed without the profiler)."""

    title: str
    rows: list[Row]
    bandwidth: float  # bytes/s, read + written
    wall_us: float
    meta: dict[str, Any] = field(default_factory=dict)

    def totals(self) -> dict[str, float]:
        """Sums over the rows, and the idle time between kernels (wall - busy)."""
        floors = [r.floor_us(self.bandwidth) for r in self.rows]
        busy = sum(r.exclusive_us for r in self.rows)
        return {
            "wall_us": self.wall_us,
            "kernel_us": sum(r.us for r in self.rows),
            "busy_us": busy,
            "floor_us": sum(f for f in floors if f is not None),
            "bytes": sum(r.bytes for r in self.rows if r.bytes is not None),
            "launches": sum(r.launches for r in self.rows),
            "gap_us": self.wall_us - busy,
        }


def markdown(table: Table) -> str:
    """The table as Markdown, totals last, ready for docs/BENCHMARKS.md."""
    bw = table.bandwidth
    lines = [
        f"**{table.title}** (copy bandwidth {bw / 1e12:.2f} TB/s)",
        "",
        "| op | kernels | launches | us / step | exclusive us | share | bytes | floor us | of floor |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    wall = table.wall_us
    for r in table.rows:
        floor = r.floor_us(bw)
        of_floor = f"{floor / r.us:.0%}" if floor is not None and r.us > 0 else "—"
        lines.append(
            f"| {r.op} | {_kernels_cell(r.kernels)} | {_launches_cell(r)} | {r.us:.1f} | "
            f"{r.exclusive_us:.1f} | {r.exclusive_us / wall:.1%} | {fmt_bytes(r.bytes)} | "
            f"{'—' if floor is None else f'{floor:.1f}' if floor >= 10 else f'{floor:.2f}'} | {of_floor} |"
        )
    t = table.totals()
    lines.append(
        f"| **total** | | {t['launches']:g} | {t['kernel_us']:.1f} | {t['busy_us']:.1f} | "
        f"{t['busy_us'] / wall:.1%} | {fmt_bytes(int(t['bytes']))} | {t['floor_us']:.1f} | "
        f"{t['floor_us'] / wall:.0%} of the wall time |"
    )
    lines += [
        "",
        (
            f"Step wall time {wall:.1f} us (timed without the profiler); kernels {t['kernel_us']:.1f} us "
            f"(spans, overlapping under PDL), device busy {t['busy_us']:.1f} us, gaps between kernels "
            f"{t['gap_us']:.1f} us (wall - busy); the floor of every modelled byte {t['floor_us']:.1f} us. "
            "share: exclusive time / wall; of floor: floor / span."
        ),
    ]
    return "\n".join(lines)


def to_json(tables: Sequence[Table]) -> str:
    """Every table's rows, totals and metadata as JSON."""
    out = []
    for t in tables:
        rows = [
            {
                "op": r.op,
                "kernels": r.kernels,
                "launches": r.launches,
                "helper_launches": r.helper_launches,
                "model_launches": r.model_launches,
                "us": r.us,
                "exclusive_us": r.exclusive_us,
                "bytes": r.bytes,
                "floor_us": r.floor_us(t.bandwidth),
            }
            for r in t.rows
        ]
        out.append({"title": t.title, "bandwidth": t.bandwidth, **t.meta, "totals": t.totals(), "rows": rows})
    return json.dumps(out, indent=2)


# ---- reading a profile ------------------------------------------------------------------------------
_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def events_from_trace(trace: dict) -> list[DeviceEvent]:
    """The device activities (kernels, memcpys, memsets) of a Chrome trace as torch.profiler exports it
    (kineto's "cat" of each complete event), sorted by start."""
    out = [
        DeviceEvent(str(ev.get("name", "")), float(ev["ts"]), float(ev.get("dur", 0.0)))
        for ev in trace.get("traceEvents", [])
        if str(ev.get("cat", "")).lower() in _DEVICE_CATS and ev.get("ph", "X") == "X" and "ts" in ev
    ]
    return sorted(out, key=lambda ev: ev.start)


def windows_from_trace(trace: dict, prefix: str) -> dict[str, tuple[float, float]]:
    """name -> (start, end) of the host ranges (torch.profiler.record_function, kineto's "user_annotation")
    whose name starts with `prefix`, in the trace's clock (the device activities' too)."""
    return {
        str(ev["name"]): (float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0)))
        for ev in trace.get("traceEvents", [])
        if str(ev.get("cat", "")).lower() == "user_annotation" and str(ev.get("name", "")).startswith(prefix)
    }


def windows_from_function_events(function_events, prefix: str) -> dict[str, tuple[float, float]]:
    """The same from torch.profiler's FunctionEvents: the host-side ranges whose name starts with `prefix`."""
    return {
        ev.name: (float(ev.time_range.start), float(ev.time_range.end))
        for ev in function_events
        if ev.name.startswith(prefix) and not str(getattr(ev, "device_type", "")).upper().endswith("CUDA")
    }


def in_window(events: Sequence[DeviceEvent], window: tuple[float, float]) -> list[DeviceEvent]:
    """The events that start inside the window (the host range around a measurement, which waits for the
    device before and after, so every activity it launched starts inside it and no other does)."""
    start, end = window
    return [ev for ev in events if start <= ev.start <= end]


def events_from_function_events(function_events) -> list[DeviceEvent]:
    """The same from torch.profiler's FunctionEvents (prof.events()): those on a CUDA device, without the
    GPU projections of user annotations."""
    out = []
    for ev in function_events:
        if not str(getattr(ev, "device_type", "")).upper().endswith("CUDA"):
            continue
        if getattr(ev, "is_user_annotation", False):
            continue
        name = getattr(ev, "trace_name", None) or ev.name
        start, end = ev.time_range.start, ev.time_range.end
        out.append(DeviceEvent(name, float(start), float(end - start)))
    return sorted(out, key=lambda ev: ev.start)
