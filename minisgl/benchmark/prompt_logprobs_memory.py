"""Peak memory of one long prompt's log-probabilities on the CPU (the offline LLM, in this process).

    python -m minisgl.benchmark.prompt_logprobs_memory                 # 8,000 tokens, the embedded model
    python -m minisgl.benchmark.prompt_logprobs_memory --tokens 8000 --top 5

Runs the prompt once for one generated token (the prefill's own peak), then again with every prompt
token's log-probability (`prompt_logprobs`, max_tokens 0), and reports the process's peak resident memory
(ru_maxrss) after each, next to the size the whole prompt's float32 logits would have: the engine reduces
them 256 rows at a time, so the second peak should exceed the first by about 2 x 256 x vocab x 4 bytes,
not by prompt_len x vocab x 4.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main(argv: list[str] | None = None) -> None:
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--top", type=int, default=1, help="top log-probabilities per position")
    a = p.parse_args(argv)
    llm = LLM(a.model, dtype=torch.float32, max_seq_len_override=a.tokens + 64, show_progress=False)
    vocab = llm.scheduler.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab, (a.tokens,), generator=g).tolist()
    llm.generate([prompt[:64]], SamplingParams(max_tokens=1, prompt_logprobs=a.top))  # warm up both paths
    loaded = peak_mib()
    llm.scheduler.cache.flush()
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1))
    plain_s, plain = time.perf_counter() - t0, peak_mib()
    llm.scheduler.cache.flush()  # the positions are computed again either way: they need their logits
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=a.top))[0]
    lp_s, with_lp = time.perf_counter() - t0, peak_mib()
    assert len(out["prompt_logprobs"]) == a.tokens
    llm.shutdown()
    report = {
        "tokens": a.tokens,
        "vocab": vocab,
        "peak_mib_after_load": round(loaded),
        "peak_mib_prefill": round(plain),
        "peak_mib_prefill_with_logprobs": round(with_lp),
        "full_logits_mib": round(a.tokens * vocab * 4 / 2**20),
        "reduction_block_mib": round(2 * 256 * vocab * 4 / 2**20),
        "prefill_s": round(plain_s, 2),
        "prefill_with_logprobs_s": round(lp_s, 2),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
