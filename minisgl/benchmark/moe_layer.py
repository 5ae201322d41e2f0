"""Time one mixture-of-experts layer (routing + experts, bf16) on a GPU: the fused Triton path
(kernel/triton/moe.py, in a CUDA graph) against the torch reference (kernel/reference.py, eager: it loops
over the experts with a host sync), next to the layer's bandwidth floor.

python -m minisgl.benchmark.moe_layer [--model qwen3-30b-a3b,mixtral-8x7b] [--tokens 1,32,256] [--tp 1]
The floor of a step is the bytes it must read or write, the weights of the distinct experts its routing
touches (3 * H * I * 2 bytes each) plus x and the output, over the copy bandwidth measured here (a large
device-to-device copy: bytes read + written per second). Each timing cycles over ROUTINGS random routings
(different experts each step, as successive decode steps touch), so weights are not served from L2.
Prints microseconds per layer, the fraction of the floor each path reaches and the fused path's relative
error against the reference."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

# name -> (experts, k, H, I, renormalize)
MODELS = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, True),
    "mixtral-8x7b": (8, 2, 4096, 14336, True),
}
TOKENS = [1, 32, 256]
ROUTINGS = 8  # routings a timing cycles over


def log(msg: str) -> None:
    """Progress on stdout, flushed (the runs take minutes)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def time_us(fn: Callable[[int], object], steps: int, replays: int = 10, graph: bool = True) -> float:
    """Microseconds per call of fn(i), i over range(steps): a CUDA graph of the steps replayed (graph=False:
    eager calls, for code that synchronises)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(steps):  # warm up (and compile) outside the capture
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for i in range(steps):
                fn(i)
        g.replay()
        run = g.replay
    else:

        def run() -> None:
            for i in range(steps):
                fn(i)

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * steps)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes per second a large device-to-device copy moves (read + written)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):  # eager: one copy is milliseconds, launch costs do not count
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * 20 / (start.elapsed_time(end) * 1e-3)


def layer_weights(experts: int, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 w13 [E, 2I, H] and w2 [E, H, I], scaled so activations stay near 1."""
    w13 = torch.empty(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16).normal_(
        0, hidden**-0.5
    )
    w2 = torch.empty(experts, hidden, inter, device="cuda", dtype=torch.bfloat16).normal_(0, inter**-0.5)
    return w13, w2


def floor_bytes(ids: torch.Tensor, hidden: int, inter: int) -> int:
    """Bytes a step must move: the distinct experts' weights, x read and the output written (bf16)."""
    distinct = int(ids.unique().numel())
    return distinct * 3 * hidden * inter * 2 + 2 * ids.shape[0] * hidden * 2


def bench(name: str, tokens: list[int], tp: int, bandwidth: float, with_torch: bool) -> None:
    """One table row per token count for a model's layer shape (I divided by tp)."""
    from minisgl.kernel import reference as ref
    from minisgl.kernel import triton as triton_kernels

    experts, top_k, hidden, inter, renorm = MODELS[name]
    inter //= tp
    log(f"{name}: {experts} experts, k={top_k}, H={hidden}, I={inter}: allocating weights")
    w13, w2 = layer_weights(experts, hidden, inter)
    for t in tokens:
        xs = [torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(ROUTINGS)]
        logits = [torch.randn(t, experts, device="cuda") for _ in range(ROUTINGS)]
        routes = [ref.moe_route(g, top_k, renorm) for g in logits]
        floor_us = sum(floor_bytes(ids, hidden, inter) for _, ids in routes) / ROUTINGS / bandwidth * 1e6
        touched = sum(int(ids.unique().numel()) for _, ids in routes) / ROUTINGS

        def fused(i: int, xs=xs, logits=logits) -> torch.Tensor:
            weights, ids = triton_kernels.moe_route(logits[i], top_k, renorm)
            return triton_kernels.fused_moe(xs[i], w13, w2, weights, ids)

        def torch_ref(i: int, xs=xs, logits=logits) -> torch.Tensor:
            weights, ids = ref.moe_route(logits[i], top_k, renorm)
            return ref.fused_moe(xs[i], w13, w2, weights, ids)

        want = torch_ref(0)
        err = ((fused(0).float() - want.float()).norm() / want.float().norm()).item()
        fused_us = time_us(fused, ROUTINGS)
        line = f"{name:14} {t:5d} {touched:7.1f} {floor_us:8.1f} {fused_us:8.1f} {floor_us / fused_us:6.1%}"
        if with_torch:
            torch_us = time_us(torch_ref, ROUTINGS, replays=3, graph=False)
            line += f" {torch_us:9.1f} {floor_us / torch_us:6.1%} {torch_us / fused_us:6.1f}x"
        print(line + f" {err:8.1e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    parser.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel size: the experts' I is divided by it"
    )
    parser.add_argument("--no-torch", action="store_true", help="skip the (slow) torch reference timings")
    args = parser.parse_args()
    models = args.model.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    tokens = [int(t) for t in args.tokens.split(",")]
    if not torch.cuda.is_available():
        raise SystemExit("moe_layer needs a CUDA device")
    torch.manual_seed(0)
    log(f"device {torch.cuda.get_device_name()}: measuring the copy bandwidth")
    bandwidth = copy_bandwidth()
    log(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written)")
    print(
        f"{'model':14} {'T':>5} {'experts':>7} {'floor us':>8} {'fused us':>8} {'floor':>6}"
        + ("" if args.no_torch else f" {'torch us':>9} {'floor':>6} {'speedup':>7}")
        + f" {'err':>8}",
        flush=True,
    )
    for name in models:
        bench(name, tokens, args.tp, bandwidth, not args.no_torch)
        torch.cuda.empty_cache()  # the model's weights went with bench()


if __name__ == "__main__":
    main()
