"""The cost of a verify step against a decode step, one request (speculative decoding, W7's device part).

    python -m minisgl.benchmark.spec_verify --model qwen3-0.6b --load-format dummy    # GPU (H200)
    python -m minisgl.benchmark.spec_verify                                         # CPU, default model

One request with a prompt of --context tokens decodes; each step proposes exactly k tokens (a fixed
proposer: the tokens are arbitrary, so they are rejected, which changes nothing in the step's cost), k
from 0 (a plain decode step) to --max-k; on a GPU each replays a CUDA graph (decode or verify graphs). Each step is timed from launch to its
tokens on the host; the median of --steps steps per k is reported, and its ratio to the decode step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

from minisgl.scheduler.speculative import Proposer, SpecState


class FixedProposer(Proposer):
    """Proposes k arbitrary tokens for every request (the benchmark sets k)."""

    def __init__(self) -> None:
        self.k = 0

    def propose(self, reqs: list, ks: list[int]) -> list[list[int]]:
        return [[100 + i for i in range(self.k)] for _ in reqs]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=None, help="a model path or qwen3-0.6b / qwen3-8b (default: the embedded one)"
    )
    ap.add_argument("--load-format", default="auto", help="dummy: random weights with the real shapes")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens before the timed steps")
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per k")
    args = ap.parse_args(argv)

    import torch

    from minisgl.benchmark.offline import resolve_model, sync
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    llm = LLM(
        resolve_model(args.model),
        load_format=args.load_format,
        show_progress=False,
        speculative="ngram",
        num_speculative_tokens=max(1, args.max_k),
        speculative_max_batch=1,  # verify graphs for one request's k + 1 rows
    )
    sched, engine = llm.scheduler, llm.scheduler.engine
    proposer = FixedProposer()
    sched.proposer = proposer
    launch = engine.forward_batch
    times: dict[int, list[float]] = defaultdict(list)

    def timed(batch: Any) -> Any:
        sync(engine.device)
        t0 = time.perf_counter()
        out = launch(batch)
        out.wait()
        times[batch.size].append(time.perf_counter() - t0)
        return out

    engine.forward_batch = timed
    # the proposals are always rejected, which would rest the request (SpecState) or choose a small k
    # (StepCosts): keep it proposing all k
    keep_update, SpecState.update = SpecState.update, lambda self, proposed, accepted: None
    sched.step_costs.best_k = lambda hits, n, max_k: max_k
    prompt = [1000 + i % 5000 for i in range(args.context)]
    try:
        for k in range(args.max_k + 1):
            proposer.k = k
            # warm-up steps (kernels compile for a new row count), then the timed ones
            llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
            times[k + 1].clear()
            llm.generate([prompt], SamplingParams(max_tokens=args.steps + 1, ignore_eos=True))
    finally:
        engine.forward_batch, SpecState.update = launch, keep_update
    print(
        f"# verify step vs decode step: {engine.model_config.architecture} {str(engine.dtype)[6:]} on "
        f"{engine.device}, one request, context {args.context}, median of {args.steps} steps"
    )
    decode = statistics.median(times[1])
    for k in range(args.max_k + 1):
        t = statistics.median(times[k + 1])
        what = "decode" if k == 0 else f"verify k={k}"
        print(f"  {what}: {1000 * t:.2f} ms, {t / decode:.2f}x a decode step ({k + 1} tokens at most)")
    if torch.cuda.is_available():
        verify = engine.verify_graphs
        graphs = f"verify graphs: {verify.replays} replays" if verify is not None else "no verify graphs"
        print(f"# {torch.cuda.get_device_name()}, {graphs}")
    llm.shutdown()


if __name__ == "__main__":
    main()
