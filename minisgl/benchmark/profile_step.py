"""Where a decode step's time goes: CPU scheduling vs device kernels, on a W1-like steady state.

python -m minisgl.benchmark.profile_step --model qwen3-0.6b --batch 256 --context 600
python -m minisgl.benchmark.profile_step --batch 256 --min-context 400 --context 1400   # a spread of lengths
python -m minisgl.benchmark.profile_step --model PATH --batch 256 --constrained  # every row under a schema
Prints the wall time per step, the CPU time of scheduling / result processing, and the top device kernels
(torch.profiler) for a few steps."""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from minisgl.core import Phase, SamplingParams
from minisgl.llm import LLM
from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils import options


def build_parser() -> argparse.ArgumentParser:
    """The profile's flags plus the engine's and the scheduler's options, as LLM takes them."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
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
    # by default bf16 random weights of qwen3-0.6b's shapes
    defaults = {
        "model_path": "qwen3-0.6b",
        "dtype": "bfloat16",
        "load_format": "dummy",
        "show_progress": False,
    }
    options.add_flags(ap, SchedulerConfig, defaults=defaults)
    return ap


# --constrained's schema: one string of at least 100k characters, so no request can complete its JSON during
# the measured steps (the batch stays full), with the mask of a JSON string (nearly every token allowed)
LONG_STRING_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 100_000}},
    "required": ["text"],
}


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
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
            out = s._launch(batch)
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
    for i in range(args.batch):
        s.add_request(
            i,
            [random.randint(0, 10000) for _ in range(random.randint(lo, args.context))],
            SamplingParams(max_tokens=args.steps + 50, ignore_eos=True, json_schema=schema),
        )
    while s.prefill.waiting or s.prefill.chunked or s.grammar.compiling:
        s.step()
    for _ in range(5):
        s.step()
    torch.cuda.synchronize()

    timers = {"schedule": 0.0, "launch": 0.0, "process": 0.0}
    orig = {"schedule": s._schedule, "launch": s._launch, "process": s._process}

    def wrap(name):
        def f(*a, **k):
            t = time.perf_counter()
            try:
                return orig[name](*a, **k)
            finally:
                timers[name] += time.perf_counter() - t

        return f

    s._schedule, s._launch, s._process = wrap("schedule"), wrap("launch"), wrap("process")
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
    orig_schedule, orig_step, orig_launch = s._schedule, s.step, s._launch

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

    s._schedule, s.step, s._launch = schedule, step, launch
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


if __name__ == "__main__":
    main()
