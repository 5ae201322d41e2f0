"""Where a decode step's time goes: CPU scheduling vs device kernels, on a W1-like steady state.

python -m minisgl.benchmark.profile_step --model qwen3-0.6b --batch 256 --context 600
python -m minisgl.benchmark.profile_step --batch 256 --min-context 400 --context 1400   # a spread of lengths
python -m minisgl.benchmark.profile_step --model PATH --batch 256 --constrained  # every row under a schema
python -m minisgl.benchmark.profile_step --batch 1,256 --context 600 --kernel-table [--json PATH]
python -m minisgl.benchmark.profile_step --context 600 --step-trace   # the one-kernel step's stages
Prints the wall time per step, the CPU time of scheduling / result processing, and the top device kernels
(torch.profiler) for a few steps. --kernel-table instead prints, per batch size, a Markdown table of the
step's kernels by op against the bytes each must move at the copy bandwidth (benchmark/kernel_table.py)."""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from typing import Any

import torch

from minisgl.core import Phase, SamplingParams
from minisgl.llm import LLM
from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils import options
from minisgl.utils.device import is_cuda, synchronize


def build_parser() -> argparse.ArgumentParser:
    """The profile's flags plus the engine's and the scheduler's options, as LLM takes them."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--batch", type=_sizes, default=[256], help="requests a step (--kernel-table: a list, e.g. 1,256)"
    )
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument(
        "--min-context", type=int, default=None, help="decode: prompt lengths uniform in [this, --context]"
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prefill", action="store_true", help="profile one prefill step instead")
    ap.add_argument("--timeline", action="store_true", help="run W1 and summarise every step instead")
    ap.add_argument(
        "--constrained",
        action="store_true",
        help="decode: every request under LONG_STRING_SCHEMA (a model with a tokenizer: not a shape config)",
    )
    ap.add_argument(
        "--kernel-table",
        action="store_true",
        help="decode: per op, the kernels' time against the bytes they must move at the copy bandwidth",
    )
    ap.add_argument("--json", metavar="PATH", default=None, help="--kernel-table: also write the tables here")
    ap.add_argument(
        "--step-trace",
        action="store_true",
        help="batch 1 with the one-kernel decode step (MINISGL_DECODE_STEP=1): where each stage of a layer "
        "waits, from the kernel's own clock readings",
    )
    # by default bf16 random weights of qwen3-0.6b's shapes
    defaults = {
        "model_path": "qwen3-0.6b",
        "dtype": "bfloat16",
        "load_format": "dummy",
        "show_progress": False,
    }
    options.add_flags(ap, SchedulerConfig, defaults=defaults)
    return ap


WARM_STEPS = 5  # decode steps of the steady state before a measurement starts

# --constrained's schema: one string of at least 100k characters, so no request can complete its JSON during
# the measured steps (the batch stays full), with the mask of a JSON string (nearly every token allowed)
LONG_STRING_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 100_000}},
    "required": ["text"],
}


def _sizes(text: str) -> list[int]:
    """A batch size or a comma-separated list of them: "1,256" -> [1, 256]."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch sizes are integers, comma-separated: {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1: {text!r}")
    return sizes


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    if args.step_trace:
        return step_trace(args)
    if args.kernel_table:
        if args.prefill or args.timeline or args.constrained:
            ap.error(
                "--kernel-table profiles plain decode steps: not with --prefill, --timeline or --constrained"
            )
        return kernel_tables(args)
    if len(args.batch) > 1:
        ap.error("a list of batch sizes needs --kernel-table")
    args.batch = args.batch[0]
    if args.timeline:
        return timeline(args)
    llm = _make_llm(args, max_running_req=max(args.batch, 1))  # unless --max-running-req says otherwise
    if args.constrained and llm.tokenizer is None:
        raise SystemExit("--constrained needs a model with a tokenizer (not a shape-only config)")
    s = llm.scheduler
    random.seed(0)
    if args.prefill:  # profile the first prefill step (after a warm-up request)
        llm.generate([[1] * args.context], SamplingParams(max_tokens=2))
        from torch.profiler import ProfilerActivity, profile

        for rep in range(3):  # separate the first-time costs (allocations, Triton compiles) from a step's own
            for i in range(args.batch):
                s.add_request(
                    20_000 + rep * 1000 + i,
                    [random.randint(0, 10000) for _ in range(args.context)],
                    SamplingParams(max_tokens=2, ignore_eos=True),
                )
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            batch = s._schedule()
            t1 = time.perf_counter()
            out = s.launcher.launch(batch)
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            s._pending_outputs += s._process(batch, out)
            while s.has_work:
                s.step()
            print(
                f"prefill rep {rep}: schedule {(t1 - t0) * 1e3:.1f} ms, launch {(t2 - t1) * 1e3:.1f} ms, "
                f"device wait {(t3 - t2) * 1e3:.1f} ms"
            )
        for i in range(args.batch):
            s.add_request(
                10_000 + i,
                [random.randint(0, 10000) for _ in range(args.context)],
                SamplingParams(max_tokens=2, ignore_eos=True),
            )
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            s.step()
            torch.cuda.synchronize()
            print(f"prefill step: {(time.perf_counter() - t) * 1e3:.1f} ms")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=50))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=50))
        return
    random.seed(0)
    lo = args.context if args.min_context is None else args.min_context
    schema = LONG_STRING_SCHEMA if args.constrained else None
    _steady_decode(s, args.batch, lo, args.context, args.steps + 50, schema=schema)

    timers = {"schedule": 0.0, "launch": 0.0, "process": 0.0}
    orig = {"schedule": s._schedule, "launch": s.launcher.launch, "process": s._process}

    def wrap(name):
        def f(*a, **k):
            t = time.perf_counter()
            try:
                return orig[name](*a, **k)
            finally:
                timers[name] += time.perf_counter() - t

        return f

    s._schedule, s._process = wrap("schedule"), wrap("process")
    s.launcher.launch = wrap("launch")
    t = time.perf_counter()
    for _ in range(args.steps):
        s.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / args.steps
    print(
        f"batch {args.batch}{' constrained' if args.constrained else ''}, context ~{lo}..{args.context}: "
        f"{wall * 1e3:.2f} ms/step "
        f"({args.batch / wall:.0f} tok/s); CPU per step: "
        + ", ".join(f"{k} {v / args.steps * 1e3:.2f} ms" for k, v in timers.items())
    )
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            s.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


def _steady_decode(
    s, batch: int, lo: int, hi: int, max_tokens: int, uid0: int = 0, schema: dict | None = None
) -> None:
    """Queue `batch` requests of random prompts of lo..hi tokens (uids from uid0), run their prefill and
    WARM_STEPS decode steps: the steady decode state the measurements start from."""
    top = min(10000, s.vocab_size - 1)  # 10000 for the real vocabularies; a tiny test model has fewer
    for i in range(batch):
        s.add_request(
            uid0 + i,
            [random.randint(0, top) for _ in range(random.randint(lo, hi))],
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, json_schema=schema),
        )
    while s.prefill.waiting or s.prefill.chunked or s.grammar.compiling:
        s.step()
    for _ in range(WARM_STEPS):
        s.step()
    synchronize(s.device)


def llm_options(args: argparse.Namespace, **fallback: Any) -> dict[str, Any]:
    """The LLM keywords of the parsed options (a config in configs/ names the shapes); `fallback` fills
    options the command line left out."""
    from .offline import resolve_model

    kwargs = {**fallback, **options.given(args, SchedulerConfig)}
    return dict(kwargs, model_path=resolve_model(kwargs["model_path"]))


def _make_llm(args: argparse.Namespace, **fallback: Any) -> LLM:
    return LLM(**llm_options(args, **fallback))


def timeline(args: argparse.Namespace) -> None:
    """Run W1 through LLM.generate and sum the wall time of prefill and decode steps by batch size."""
    from .offline import get_workload

    llm = _make_llm(args)
    w = get_workload("w1")
    llm.generate(w.prompts[:8], [SamplingParams(max_tokens=16, ignore_eos=True)] * 8)
    s = llm.scheduler
    steps: list = []  # [phase, batch size, tokens, wall s, schedule s, launch s]
    orig_schedule, orig_step, orig_launch = s._schedule, s.step, s.launcher.launch

    def schedule():
        t = time.perf_counter()
        b = orig_schedule()
        steps.append(
            [
                "idle" if b is None else b.phase,
                0 if b is None else b.size,
                0 if b is None else b.num_tokens,
                0.0,
                time.perf_counter() - t,
                0.0,
            ]
        )
        return b

    def launch(batch):
        t = time.perf_counter()
        out = orig_launch(batch)
        steps[-1][5] += time.perf_counter() - t
        return out

    def step():
        t = time.perf_counter()
        out = orig_step()
        if steps:
            steps[-1][3] += time.perf_counter() - t
        return out

    s._schedule, s.step, s.launcher.launch = schedule, step, launch
    t = time.perf_counter()
    llm.generate(w.prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in w.outputs])
    total = time.perf_counter() - t
    print(f"W1 {w.output_tokens / total:.0f} tok/s, {total:.2f} s, {len(steps)} steps")
    buckets: dict = {}
    for phase, bs, ntok, dt, sched, launch_s in steps:
        key = (phase, min(256, 1 << max(0, bs - 1).bit_length()) if phase == Phase.DECODE else 0)
        b = buckets.setdefault(key, [0, 0.0, 0, 0, 0.0, 0.0])
        for i, v in enumerate((1, dt, ntok, bs, sched, launch_s)):
            b[i] += v
    for key in sorted(buckets):
        n, dt, ntok, bs, sched, launch_s = buckets[key]
        print(
            f"{key[0]:>7} bs<={key[1]:>3}: {n:5d} steps {dt:7.3f} s ({dt / n * 1e3:6.2f} ms/step; host: schedule "
            f"{sched / n * 1e3:5.2f}, launch {launch_s / n * 1e3:5.2f}), {ntok} tokens, mean bs {bs / n:.1f}"
        )


# ---- --kernel-table -------------------------------------------------------------------------------------
PROFILE_STEPS = 5  # decode steps a kernel table averages over
_WINDOW = "kernel_table batch "  # the profiler's host range around a batch size's profiled steps


STAGE_NAMES = ("qkv", "attention", "o", "gate_up", "down")


def step_trace(args: argparse.Namespace) -> None:
    """--step-trace: the steady decode state of one request at --context keys through the one-kernel
    decode step, its blocks' clock readings over --steps steps: per stage of a layer the median and the
    90th percentile over blocks, layers and steps of each phase, in microseconds at the clock the trace's
    own (clock64, globaltimer) pairs give."""
    if not torch.cuda.is_available():
        raise SystemExit("--step-trace needs a GPU: torch.cuda.is_available() is False here")
    from minisgl.kernel import step_kernel

    os.environ["MINISGL_DECODE_STEP"] = "1"
    device = torch.device("cuda", torch.cuda.current_device())
    if not step_kernel.buildable(device):
        raise SystemExit(
            "--step-trace: the one-kernel decode step does not build here (needs sm_90 and nvcc)"
        )
    from .kernel_table import DecodeShape, step_stage_bytes
    from .moe_layer import copy_bandwidth

    bandwidth = copy_bandwidth()  # before the engine sizes its KV pool from the free memory
    torch.cuda.empty_cache()
    step_kernel.trace(device)  # before the engine captures its graphs
    llm = _make_llm(args, max_running_req=1)
    s = llm.scheduler
    engine = s.engine
    layers = engine.model_config.num_layers
    shape = DecodeShape.of(engine.model_config, engine.dtype.itemsize, engine.kv_dtype.itemsize)
    random.seed(0)
    _steady_decode(s, 1, args.context, args.context, WARM_STEPS + args.steps + 4)
    rows, spans = [], []
    for _ in range(args.steps):
        s.step()
        synchronize(s.device)
        stages, tail = step_kernel.trace_view(layers)
        rows.append(stages)
        spans.append(tail)
    _drain(s)
    stage_bytes = step_stage_bytes(shape, args.context + 1)  # the new key is read too
    for line in stage_table(torch.stack(rows), torch.stack(spans), args.context, stage_bytes, bandwidth):
        print(line)


def stage_table(
    stages: torch.Tensor,
    tail: torch.Tensor,
    context: int,
    stage_bytes: tuple[int, ...] | None = None,
    bandwidth: float | None = None,
) -> list[str]:
    """The --step-trace report of clock readings stages [steps, blocks, layers, 5 stages, 5 points] and the
    blocks' (clock64, globaltimer) pairs tail [steps, blocks, 4]: the kernel's span, the SM clock, then a
    Markdown row per stage of each phase's p50 / p90 (over steps, blocks and layers; a block that recorded
    no reading of a stage, i.e. zeros, is left out of that stage) and the layer's start-to-start time.
    With stage_bytes (a layer's, per stage) and bandwidth (bytes a second): each stage's bytes, their
    floor at that bandwidth and the floor's share of the stage's p50, and the same for a layer."""
    from .kernel_table import fmt_bytes

    stages, tail = stages.double(), tail.double()
    per_ns = ((tail[..., 2] - tail[..., 0]) / (tail[..., 3] - tail[..., 1])).median().item()
    kernel_us = ((tail[..., 3].amax(-1) - tail[..., 1].amin(-1)) / 1e3).median().item()
    steps, blocks, layers = stages.shape[:3]
    head = (
        f"one-kernel decode step, batch 1, {context} keys, {layers} layers, {blocks} blocks: "
        f"kernel {kernel_us:.1f} us (median of {steps} steps, globaltimer), SM clock {per_ns:.2f} GHz"
    )
    lines = [head]
    phases = ("issue", "inputs", "weights", "compute")
    floors = stage_bytes is not None and bandwidth is not None
    extra = " bytes | floor us | of floor |" if floors else ""
    lines.append("| stage | " + " | ".join(f"{p} p50 / p90 us" for p in phases) + " | stage p50 us |" + extra)
    lines.append(
        "| --- | " + " | ".join("---" for _ in phases) + " | --- |" + " --- |" * (3 if floors else 0)
    )
    for i, name in enumerate(STAGE_NAMES):
        st = stages[:, :, :, i, :]
        valid = (st > 0).all(-1)  # blocks without attention work record no q / split points
        cells = []
        for p in range(4):
            d = ((st[..., p + 1] - st[..., p]) / per_ns / 1e3)[valid]
            cells.append(f"{d.median().item():.2f} / {d.quantile(0.9).item():.2f}" if d.numel() else "-")
        total = ((st[..., 4] - st[..., 0]) / per_ns / 1e3)[valid].median().item()
        row = f"| {name} | " + " | ".join(cells) + f" | {total:.2f} |"
        if floors:
            floor = stage_bytes[i] / bandwidth * 1e6
            row += f" {fmt_bytes(stage_bytes[i])} | {floor:.2f} | {floor / total:.0%} |"
        lines.append(row)
    layer = (stages[:, :, 1:, 0, 0] - stages[:, :, :-1, 0, 0]) / per_ns / 1e3
    p50 = layer.median().item()
    lines.append(f"a layer, start to start: p50 {p50:.2f} us, p90 {layer.quantile(0.9).item():.2f} us")
    if floors:
        floor = sum(stage_bytes) / bandwidth * 1e6
        lines.append(
            f"a layer's bytes {fmt_bytes(sum(stage_bytes))}: {floor:.2f} us at {bandwidth / 1e12:.2f} TB/s, "
            f"{floor / p50:.0%} of a layer's p50; the layers' {fmt_bytes(layers * sum(stage_bytes))}: "
            f"{layers * floor:.1f} us, {layers * floor / kernel_us:.0%} of the kernel"
        )
    return lines


def kernel_tables(args: argparse.Namespace) -> None:
    """--kernel-table: per batch size of --batch, the steady decode state at --context keys a request
    (the decode CUDA graph as normal): its wall time a step without the profiler, then, in one profiler
    session for all batch sizes, PROFILE_STEPS steps whose device kernels are grouped by op against the
    op's bytes at the copy bandwidth (measured first)."""
    if not torch.cuda.is_available():
        raise SystemExit(
            "--kernel-table profiles the kernels of a GPU decode step: it needs CUDA, and "
            "torch.cuda.is_available() is False here"
        )
    from .kernel_table import DecodeShape
    from .moe_layer import copy_bandwidth

    bandwidth = copy_bandwidth()  # before the engine sizes its KV pool from the free memory
    torch.cuda.empty_cache()
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s (2 GiB dst.copy_(src), 20 repeats, read + written)")
    llm = _make_llm(args, max_running_req=max(args.batch))  # unless --max-running-req says otherwise
    engine = llm.scheduler.engine
    if engine.config.tp_info.size != 1:
        raise SystemExit("--kernel-table models one rank: run it without tensor parallelism")
    try:
        shape = DecodeShape.of(engine.model_config, engine.dtype.itemsize, engine.kv_dtype.itemsize)
    except ValueError as e:
        raise SystemExit(f"--kernel-table: {e}") from None
    emit_kernel_tables(llm, args, shape, bandwidth)


def emit_kernel_tables(llm: LLM, args: argparse.Namespace, shape, bandwidth: float) -> list:
    """The tables of every batch size of --batch, printed as Markdown (and written to --json); also runs
    on a CPU (the tests), where the profile holds no device activity and the tables no rows."""
    from .kernel_table import markdown, to_json

    s = llm.scheduler
    walls = [_time_decode(s, args, batch, 1_000_000 * (i + 1)) for i, batch in enumerate(args.batch)]
    runs, events, windows = _profile_decode(s, args)
    tables = []
    for batch, wall, run in zip(args.batch, walls, runs):
        found = windows.get(run["range"])
        if found is None and events:
            raise SystemExit(f"the profile holds no range {run['range']!r}: cannot tell its kernels")
        table = _table(s.engine, args, shape, bandwidth, batch, wall, run, events, found)
        print(markdown(table), flush=True)
        tables.append(table)
        if args.json:  # after every table: a later batch size that fails leaves the earlier ones
            with open(args.json, "w") as f:
                f.write(to_json(tables))
    if args.json:
        print(f"wrote {args.json}")
    return tables


def _time_decode(s, args: argparse.Namespace, batch: int, uid0: int) -> float:
    """Wall seconds a step of the steady decode state at `batch` requests, without the profiler; the
    requests then run to their end."""
    lo = args.context if args.min_context is None else args.min_context
    random.seed(0)
    _steady_decode(s, batch, lo, args.context, WARM_STEPS + args.steps + 4, uid0=uid0)
    t = time.perf_counter()
    for _ in range(args.steps):
        s.step()
    synchronize(s.device)
    wall = (time.perf_counter() - t) / args.steps
    _drain(s)
    return wall


def _drain(s) -> None:
    """Run the requests to their end (a few steps: their max_tokens leave a margin of 4)."""
    while s.has_work:
        s.step()
    synchronize(s.device)


def _profile_decode(s, args: argparse.Namespace) -> tuple[list[dict], list, dict]:
    """One profiler session (CUPTI starts once: a second start after CUDA graphs were captured is
    where torch's own notes report crashes) over every batch size's steady state, with PROFILE_STEPS
    steps of each inside a named host range. Returns per batch size what its bytes model needs, the
    session's device activities and the ranges."""
    from torch.profiler import ProfilerActivity, profile, record_function

    # torch turns CUPTI's teardown off for its own CUDA graphs (inductor) for the same reason
    os.environ.setdefault("TEARDOWN_CUPTI", "0")
    device, runner = s.device, s.engine.graph_runner
    lo = args.context if args.min_context is None else args.min_context
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda(device) else [])
    runs = []
    with profile(activities=activities) as prof:
        for i, batch in enumerate(args.batch):
            random.seed(0)
            _steady_decode(
                s, batch, lo, args.context, WARM_STEPS + PROFILE_STEPS + 4, uid0=2_000_000 * (i + 1)
            )
            keys = sorted((r.cached_len for r in s.decode.running), reverse=True)  # the next positions
            replays = runner.replays if runner is not None else 0
            name = f"{_WINDOW}{batch} #{i}"  # unique: --batch may name a size twice
            time.sleep(0.002)  # the range starts well after the last activity before it
            with record_function(name):
                for _ in range(PROFILE_STEPS):
                    s.step()
                synchronize(device)
            time.sleep(0.002)
            graphed = runner is not None and runner.replays - replays == PROFILE_STEPS
            runs.append({"keys": keys, "graphed": graphed, "ran": s.launcher.last_batch_size, "range": name})
            if i + 1 < len(args.batch):
                _drain(s)
    _drain(s)  # the last batch size's, outside the session
    events, windows = _read_profile(prof)
    return runs, events, windows


def _read_profile(prof) -> tuple[list, dict]:
    """The session's device activities and named ranges: from its Chrome trace (kineto's categories),
    else from its FunctionEvents."""
    from . import kernel_table as kt

    events, windows = [], {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        events, windows = kt.events_from_trace(trace), kt.windows_from_trace(trace, _WINDOW)
    except (OSError, KeyError, RuntimeError, TypeError, ValueError) as e:  # the FunctionEvents hold them too
        print(f"reading the profile's Chrome trace failed ({e!r}); using its events instead")
    if not events or not windows:
        function_events = prof.events()
        events = kt.events_from_function_events(function_events)
        windows = kt.windows_from_function_events(function_events, _WINDOW)
    if not events and torch.cuda.is_available():
        raise SystemExit(
            "the profile holds no device kernels: CUPTI recorded no CUDA activity (is another profiler "
            "attached, or CUDA activity unavailable in this torch build?)"
        )
    return events, windows


def _table(engine, args, shape, bandwidth: float, batch: int, wall: float, run: dict, events, window):
    """One batch size's Table from its profiled range of the session."""
    from .kernel_table import Table, build_rows, in_window

    events = in_window(events, window) if window is not None else []
    keys, graphed = run["keys"], run["graphed"]
    model, padded, num_splits = _step_model(engine, shape, keys, batch, graphed)
    lo = args.context if args.min_context is None else args.min_context
    mean_keys = sum(keys) / max(1, len(keys)) + 1 + (PROFILE_STEPS - 1) / 2
    notes = [] if graphed else ["not served by the decode CUDA graph"]
    if run["ran"] != batch or len(keys) != batch:
        notes.append(f"the steps ran {run['ran']} requests, not {batch}")
    title = (
        f"Decode step, batch {batch}" + (f" (graph of {padded})" if padded != batch else "") + ", "
        f"{mean_keys:.0f} keys a request (--context {lo}..{args.context}), "
        f"{engine.model_config.architecture} {str(engine.dtype).removeprefix('torch.')}, "
        f"{num_splits} KV split{'s' if num_splits > 1 else ''}" + "".join(f"; {n}" for n in notes)
    )
    meta = {
        "batch": batch,
        "padded": padded,
        "mean_keys": mean_keys,
        "num_splits": num_splits,
        "graphed": graphed,
        "profiled_steps": PROFILE_STEPS,
        "first_step": _first_step(events, shape.layers),
    }
    rows = build_rows(events, PROFILE_STEPS, shape.layers, model)
    return Table(title, rows, bandwidth, wall * 1e6, meta)


def _step_model(engine, shape, keys: list[int], batch: int, graphed: bool) -> tuple[dict, int, int]:
    """(the bytes model averaged over the profiled steps, the rows the kernels ran, KV splits): the
    requests' keys grow by one a step; a graph runs its padded size (padding rows hold one key) and
    fixes the split count for the longest sequence the engine allows."""
    from .kernel_table import OpBytes, decode_step_bytes

    padded = engine.graph_runner.padded_size(batch) if graphed else batch
    backend = engine.attn_backend
    num_splits = 1
    if hasattr(backend, "num_splits"):  # the Triton backend's split-KV decode
        longest = engine.max_seq_len if graphed else max(keys) + PROFILE_STEPS
        num_splits = backend.num_splits(padded, longest)
    block_n = backend.decode_tile(padded)[0] if hasattr(backend, "decode_tile") else 64
    pad = [1] * (padded - len(keys))
    steps = [
        decode_step_bytes(shape, [n + 1 + k for n in keys] + pad, num_splits, block_n)
        for k in range(PROFILE_STEPS)
    ]
    model = {
        op: OpBytes(round(sum(m[op].bytes for m in steps) / PROFILE_STEPS), b.launches)
        for op, b in steps[0].items()
    }
    return model, padded, num_splits


def _first_step(events: list, layers: int) -> list:
    """The first profiled step's activities in order, [short name, op, us], for checking the attribution."""
    from .kernel_table import attribute, short_name

    labels = attribute(events, layers)
    n = len(events) // PROFILE_STEPS
    return [[short_name(ev.name), op, round(ev.dur, 2)] for ev, op in zip(events[:n], labels[:n])]


if __name__ == "__main__":
    main()
