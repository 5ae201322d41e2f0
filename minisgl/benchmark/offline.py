"""Offline throughput and latency of minisgl on the benchmark workloads.

    python -m minisgl.benchmark.offline --workload w3                  # CPU, default model, float32
    python -m minisgl.benchmark.offline --workload w3 --overlap on,off # overlap scheduling on vs off
    python -m minisgl.benchmark.offline --workload shared-prefix --cache radix,naive
    python -m minisgl.benchmark.offline --workload w1 --model qwen3-0.6b --load-format dummy   # GPU
    python -m minisgl.benchmark.offline --workload w2 --model qwen3-0.6b --load-format dummy   # GPU
    python -m minisgl.benchmark.offline --workload w3 --constrained-fraction 0.25  # a quarter under a schema
    python -m minisgl.benchmark.offline --workload w1 --model qwen3-0.6b --load-format dummy \
        --temperature 0.6 --top-p 0.9 --sampler fused,torch                                    # sampled

Workloads (random token ids from one seeded generator; every request ignores EOS and produces exactly its
output length; throughput = output tokens / wall time of the generate call, after a warm-up):
  w1  256 requests, prompts and outputs of 100..1024 tokens (GPU offline throughput)
  w2  1 request, 128 prompt tokens, 256 output tokens (GPU single-request latency)
  w3  32 requests, prompts and outputs of 32..256 tokens (CPU offline throughput)
  shared-prefix  64 requests = one common 512-token system prompt + 16..64 own tokens, 32 output tokens each
  w6a, w6b  the online workloads' requests, run offline (the service's ceiling on the same requests):
      W4's chat prompts through the model's chat template, 1024 x 512 output tokens (w6a), 16 x 256 (w6b)
--constrained-fraction F gives that fraction of the requests (spread evenly) the fixed JSON schema
BENCH_SCHEMA; such a request ends when its JSON is complete, so it may produce fewer tokens than its
length, and throughput counts the tokens generated (the unconstrained ones' own rate is printed too).
Every request greedy unless --temperature (then --top-p, --top-k, --min-p, and --request-seed S: request i
gets seed S + i; --seed is the engine's start-up seed) says otherwise, the same for every request.
Comma-separated values of --cache-type (--cache), --overlap and --sampler run each configuration in turn (a
fresh engine each). --model also takes qwen3-0.6b / qwen3-8b, shape-only configs (with --load-format dummy); the
other flags are LLM's options (minisgl/engine/config.py, minisgl/scheduler/config.py).
On a CPU shared with other busy processes, set OMP_WAIT_POLICY=PASSIVE (for the peer too): spinning OpenMP
threads otherwise slow both down several times, and by different amounts."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from minisgl.benchmark.prompts import BENCH_SCHEMA

CONFIGS_DIR = os.path.join(os.path.dirname(__file__), "configs")


def constrain(params: list, fraction: float) -> tuple[list, list[bool]]:
    """`params` with BENCH_SCHEMA given to int(n * fraction) of the n requests, spread evenly; and which."""
    import dataclasses

    rows = [int((i + 1) * fraction) > int(i * fraction) for i in range(len(params))]
    schema = json.dumps(BENCH_SCHEMA)
    return [dataclasses.replace(p, json_schema=schema) if c else p for p, c in zip(params, rows)], rows


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    outputs: list[int]  # output length of each request (its max_tokens)

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.outputs)


def make_workload(n: int, lo: int, hi: int, seed: int = 0, name: str = "") -> Workload:
    """The benchmark generator: Python's random, seeded; prompts drawn first, then output lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outputs = [rng.randint(lo, hi) for _ in range(n)]
    return Workload(name or f"N={n}, {lo}..{hi}", prompts, outputs)


def shared_prefix_workload(n: int = 64, prefix_len: int = 512, seed: int = 0) -> Workload:
    """n requests sharing one system prompt of prefix_len tokens, each with 16..64 tokens of its own."""
    rng = random.Random(seed)
    system = [rng.randint(0, 10000) for _ in range(prefix_len)]
    prompts = [system + [rng.randint(0, 10000) for _ in range(rng.randint(16, 64))] for _ in range(n)]
    return Workload(f"shared-prefix ({n} x {prefix_len}-token system prompt)", prompts, [32] * n)


def chat_workload(name: str, model_path: str, n: int, output_len: int) -> Workload:
    """The online benchmark's chat requests (benchmark.online's W4 prompts), tokenized as the service
    does: through the model's chat template."""
    from minisgl.benchmark.prompts import w4_prompts
    from minisgl.utils.hf import load_tokenizer

    tok = load_tokenizer(model_path)
    prompts = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for p in w4_prompts(n)
    ]
    return Workload(name, prompts, [output_len] * n)


def get_workload(name: str, num_requests: int | None = None, model_path: str | None = None) -> Workload:
    if name in ("w6a", "w6b"):
        assert model_path is not None, "the w6 workloads need the model's tokenizer (--model)"
        n, out = (1024, 512) if name == "w6a" else (16, 256)
        w = chat_workload(name.upper(), model_path, n, out)
    elif name == "w1":
        w = make_workload(256, 100, 1024, name="W1")
    elif name == "w2":
        rng = random.Random(0)
        w = Workload("W2", [[rng.randint(0, 10000) for _ in range(128)]], [256])
    elif name == "w3":
        w = make_workload(32, 32, 256, name="W3")
    elif name == "shared-prefix":
        w = shared_prefix_workload()
    else:
        raise ValueError(f"unknown workload {name!r} (w1, w2, w3, shared-prefix)")
    if num_requests is not None:
        w = Workload(f"{w.name}[:{num_requests}]", w.prompts[:num_requests], w.outputs[:num_requests])
    return w


def warmup_workload(vocab_limit: int = 10000) -> Workload:
    """A few short requests with prompts unrelated to any workload (so they seed no prefix cache hits)."""
    rng = random.Random(12345)
    prompts = [[rng.randint(0, vocab_limit) for _ in range(rng.randint(16, 48))] for _ in range(4)]
    return Workload("warm-up", prompts, [8, 16, 4, 12])


def resolve_model(model: str | None) -> str | None:
    """`qwen3-0.6b` / `qwen3-8b` name the shape-only configs shipped here (use with --load-format dummy)."""
    if model and not os.path.exists(model) and os.path.isdir(os.path.join(CONFIGS_DIR, model)):
        return os.path.join(CONFIGS_DIR, model)
    return model


def run_once(args: argparse.Namespace, workload: Workload, options: dict[str, Any]) -> dict[str, Any]:
    """Build an engine from `options` (LLM keywords), warm it up, time `repeat` generate calls of the
    workload; returns the figures."""
    import torch

    from minisgl.llm import LLM

    kwargs = dict(options, model_path=resolve_model(options.get("model_path")))
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0
    engine = llm.scheduler.engine
    vocab = engine.model_config.vocab_size
    for p in workload.prompts:
        if max(p) >= vocab:
            raise ValueError(f"workload token ids reach {max(p)} but the model's vocabulary has {vocab}")
    try:
        warm = warmup_workload(min(vocab - 1, 10000))
        llm.generate(warm.prompts, request_params(args, warm))  # sampled as the runs are
        params = request_params(args, workload)
        params, rows = constrain(params, args.constrained_fraction)
        plain_tokens = sum(n for n, c in zip(workload.outputs, rows) if not c)
        times, computed, generated = [], [], []
        for _ in range(args.repeat):
            # every timed run starts from an empty prefix cache, as a fresh engine would
            cm = llm.scheduler.cache
            cm.free(cm.cache.evict(llm.scheduler.num_total_pages))
            before = llm.stats()
            sync(engine.device)
            t0 = time.perf_counter()
            outs = llm.generate(workload.prompts, params)
            sync(engine.device)
            times.append(time.perf_counter() - t0)
            after = llm.stats()
            computed.append(after["computed_prompt_tokens"] - before["computed_prompt_tokens"])
            got = sum(len(o["token_ids"]) for o, c in zip(outs, rows) if not c)
            if got != plain_tokens:
                raise RuntimeError(f"generated {got} unconstrained tokens, expected {plain_tokens}")
            generated.append(sum(len(o["token_ids"]) for o in outs))
        stats = llm.stats()
        return {
            "seconds": statistics.median(times),
            "all_seconds": times,
            "computed_prompt_tokens": int(statistics.median(computed)),
            "generated_tokens": int(statistics.median(generated)),
            "plain_tokens": plain_tokens,
            "constrained": sum(rows),
            "load_seconds": load_s,
            "device": str(engine.device),
            "dtype": str(engine.dtype).replace("torch.", ""),
            "attn": type(engine.attn_backend).__name__,
            "arch": engine.model_config.architecture,
            "threads": torch.get_num_threads() if engine.device.type == "cpu" else None,
            "max_batch_size": stats.get("max_batch_size"),
            "retractions": stats.get("num_retractions"),
        }
    finally:
        llm.shutdown()


def request_params(args: argparse.Namespace, workload: Workload) -> list:
    """Each request's SamplingParams: its output length, EOS ignored, the sampling flags (request i seeded
    with --request-seed + i)."""
    from minisgl.core import SamplingParams

    seed = args.request_seed
    return [
        SamplingParams(
            max_tokens=n,
            ignore_eos=True,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=None if seed is None else seed + i,
        )
        for i, n in enumerate(workload.outputs)
    ]


def describe_sampling(args: argparse.Namespace) -> str:
    """The sampling flags as the result line shows them."""
    if args.temperature == 0.0:
        return "sampling=greedy"
    seeds = "none" if args.request_seed is None else f"{args.request_seed}+i"
    return (
        f"sampling=temperature {args.temperature} top_p {args.top_p} top_k {args.top_k} "
        f"min_p {args.min_p} seeds {seeds}"
    )


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_parser() -> argparse.ArgumentParser:
    """The workload flags plus the engine's and the scheduler's options, as LLM takes them (--cache-type and
    --overlap take comma-separated lists: each value runs in turn)."""
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.utils import options

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="w3", choices=["w1", "w2", "w3", "w6a", "w6b", "shared-prefix"])
    ap.add_argument(
        "--num-requests", type=int, default=None, help="only the first N requests of the workload"
    )
    ap.add_argument("--repeat", type=int, default=1, help="timed runs; the median is reported")
    ap.add_argument(
        "--constrained-fraction",
        type=float,
        default=0.0,
        help="fraction (0..1) of the requests constrained by a fixed JSON schema",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's (default 0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (default 1)")
    ap.add_argument("--top-k", type=int, default=-1, help="every request's top_k (default -1: no limit)")
    ap.add_argument("--min-p", type=float, default=0.0, help="every request's min_p (default 0)")
    ap.add_argument(
        "--request-seed", type=int, default=None, metavar="S", help="request i samples with seed S + i"
    )
    defaults = {"overlap": "on", "show_progress": False}
    options.add_flags(ap, SchedulerConfig, defaults=defaults, lists=("cache_type", "overlap", "sampler"))
    return ap


def runs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    """The LLM keywords of each configuration to run, in order (every --cache-type x every --overlap x
    every --sampler); a bad value exits through `parser` before any engine is built."""
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.utils import options

    given = options.given(args, SchedulerConfig)
    caches, overlaps, samplers = given.pop("cache_type"), given.pop("overlap"), given.pop("sampler")
    out = [
        dict(given, cache_type=c, overlap=o, sampler=s) for c in caches for o in overlaps for s in samplers
    ]
    for kw in out:
        options.build(SchedulerConfig, kw, parser)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not 0.0 <= args.constrained_fraction <= 1.0:
        ap.error("--constrained-fraction must be in [0, 1]")
    configs = runs(args, ap)
    workload = get_workload(args.workload, args.num_requests, resolve_model(configs[0].get("model_path")))
    try:  # a bad sampling flag fails before any engine is built
        request_params(args, workload)[0].validate()
    except ValueError as e:
        ap.error(str(e))
    print(
        f"# {workload.name}: {len(workload.prompts)} requests, {workload.input_tokens} prompt tokens, "
        f"{workload.output_tokens} output tokens"
    )
    for config in configs:
        cache, overlap = config["cache_type"], config["overlap"]
        r = run_once(args, workload, config)
        tok_s = r["generated_tokens"] / r["seconds"]
        where = (
            f"model={r['arch']} {r['dtype']} on {r['device']}"
            + (f" ({r['threads']} threads)" if r["threads"] else "")
            + f", attn={r['attn']}, cache={cache}, overlap={overlap}, sampler={config['sampler']}, "
            + describe_sampling(args)
        )
        if r["constrained"]:
            where += (
                f", {r['constrained']} requests constrained (unconstrained ones: "
                f"{r['plain_tokens'] / r['seconds']:.1f} tok/s)"
            )
        spread = (
            ""
            if len(r["all_seconds"]) == 1
            else f" (median of {len(r['all_seconds'])}: "
            + ", ".join(f"{s:.2f}" for s in r["all_seconds"])
            + ")"
        )
        if args.workload == "w2":
            ms = 1000 * r["seconds"] / workload.output_tokens
            print(
                f"{workload.name} minisgl: {ms:.2f} ms per output token, {tok_s:.1f} tok/s, "
                f"{r['seconds']:.2f} s{spread} | {where}"
            )
        elif args.workload == "shared-prefix":
            print(
                f"{workload.name} minisgl: prefill tokens computed {r['computed_prompt_tokens']} of "
                f"{workload.input_tokens}, end-to-end {r['seconds']:.2f} s{spread}, {tok_s:.1f} tok/s | {where}"
            )
        else:
            print(
                f"{workload.name} minisgl: {tok_s:.1f} tok/s ({r['generated_tokens']} output tokens in "
                f"{r['seconds']:.2f} s{spread}; max batch {r['max_batch_size']}, "
                f"retractions {r['retractions']}) | {where}",
                flush=True,
            )


if __name__ == "__main__":
    main()
