"""Hugging Face transformers as the peer, on the same workloads and the same machine as minisgl.

    python -m minisgl.benchmark.hf_peer --workload w3                    # continuous batching (W3 peer)
    python -m minisgl.benchmark.hf_peer --workload w3 --mode generate --batch-size 8   # padded batches
    python -m minisgl.benchmark.hf_peer --workload w2 --mode generate --model qwen3-0.6b --load-format dummy

Modes:
  cb        transformers' continuous batching (the manager behind `generate_batch`), each request with its
            own max_new_tokens and EOS disabled, greedy
  generate  `model.generate` on left-padded batches of --batch-size requests in order, greedy, each batch
            running to its longest output; only each request's own output length counts as output
Throughput = the workload's output tokens / wall time, after a warm-up, exactly as in offline.py."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from minisgl.benchmark.offline import Workload, get_workload, resolve_model, warmup_workload


def load_model(args: argparse.Namespace) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from minisgl.models.resolve import resolve_model_path

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype != "auto"
        else (torch.float32 if device == "cpu" else torch.bfloat16)
    )
    if device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    if args.load_format == "dummy":
        config = AutoConfig.from_pretrained(path)
        config._attn_implementation = args.attn
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=args.attn)
    else:
        path = resolve_model_path(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=args.attn).to(
            device
        )
    return model.eval()


def run_cb(model: Any, workload: Workload, warm: Workload) -> float:
    """Continuous batching: submit every request, wait for all; returns the timed run's seconds."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False, max_new_tokens=max(workload.outputs), eos_token_id=-1, pad_token_id=0
    )

    def solve(manager, w: Workload) -> int:
        ids = [
            manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in zip(w.prompts, w.outputs)
        ]
        pending, produced = set(ids), 0
        while pending:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("the continuous batching thread stopped")
                continue
            if result.is_finished() and result.request_id in pending:
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                pending.discard(result.request_id)
                produced += len(result.generated_tokens)
        return produced

    # no inference_mode here: the manager's thread (transformers 5.17) updates tensors made at its start
    with model.continuous_batching_context_manager(
        generation_config=config, block=True, timeout=30
    ) as manager:
        solve(manager, warm)
        sync(model.device)
        t0 = time.perf_counter()
        produced = solve(manager, workload)
        sync(model.device)
        seconds = time.perf_counter() - t0
    if produced != workload.output_tokens:
        raise RuntimeError(f"transformers generated {produced} tokens, expected {workload.output_tokens}")
    return seconds


def run_generate(model: Any, workload: Workload, warm: Workload, batch_size: int) -> float:
    """`generate` on left-padded batches in order; returns the timed run's seconds."""
    import torch

    def solve(w: Workload) -> None:
        for i in range(0, len(w.prompts), batch_size):
            prompts, outs = w.prompts[i : i + batch_size], w.outputs[i : i + batch_size]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
            n = max(outs)
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
            )
            assert out.shape[1] == width + n

    with torch.inference_mode():
        solve(warm)
        sync(model.device)
        t0 = time.perf_counter()
        solve(workload)
        sync(model.device)
        return time.perf_counter() - t0


def sync(device: Any) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="w3", choices=["w1", "w2", "w3", "shared-prefix"])
    ap.add_argument("--mode", default="cb", choices=["cb", "generate"])
    ap.add_argument(
        "--model", default=None, help="HF dir, .gguf, hub id, or qwen3-0.6b / qwen3-8b (shapes only)"
    )
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16, float16, or auto (bf16 on GPU)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument(
        "--attn",
        default="sdpa",
        help="attn_implementation: sdpa (cb uses its paged cache with sdpa), paged|eager, eager",
    )
    ap.add_argument("--batch-size", type=int, default=8, help="generate mode: requests per padded batch")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=1, help="timed runs; the median is reported")
    args = ap.parse_args(argv)

    import torch
    import transformers

    workload = get_workload(args.workload, args.num_requests)
    model = load_model(args)
    warm = warmup_workload(min(model.config.vocab_size - 1, 10000))
    times = []
    for _ in range(args.repeat):
        if args.mode == "cb":
            times.append(run_cb(model, workload, warm))
        else:
            times.append(run_generate(model, workload, warm, args.batch_size))
    seconds = statistics.median(times)
    tok_s = workload.output_tokens / seconds
    runs = (
        "" if len(times) == 1 else f" (median of {len(times)}: " + ", ".join(f"{t:.2f}" for t in times) + ")"
    )
    mode = "continuous batching" if args.mode == "cb" else f"generate, padded batches of {args.batch_size}"
    threads = f" ({torch.get_num_threads()} threads)" if model.device.type == "cpu" else ""
    extra = (
        f", {1000 * seconds / workload.output_tokens:.2f} ms per output token"
        if args.workload == "w2"
        else ""
    )
    print(
        f"{workload.name} HF transformers {transformers.__version__} {mode}: {tok_s:.1f} tok/s{extra} "
        f"({workload.output_tokens} output tokens in {seconds:.2f} s{runs}) | "
        f"model={type(model).__name__} {str(model.dtype).replace('torch.', '')} on {model.device}{threads}, "
        f"attn={model.config._attn_implementation}",
        flush=True,
    )


if __name__ == "__main__":
    main()
