"""The memory roofline of an offline workload: the fewest bytes each step must read, over a bandwidth.

    python -m minisgl.benchmark.roofline --workload w1 --model qwen3-30b-a3b --bandwidth 4.20

Every decode step reads each weight it uses once (for an MoE model: the attention and dense weights, the
router, and the experts its batch touches) and the K/V of every running sequence; prefill reads each
prompt's weights once per step of --max-prefill-length tokens. All requests start together, as in the
offline benchmark, and leave the batch at their output length. The experts a step touches are those of
uniform top-k routing, E (1 - (1 - k/E)^B) per layer at B tokens (what random dummy weights route close
to); the bandwidth is the GPU's measured copy bandwidth (the offline benchmark logs it)."""

from __future__ import annotations

import argparse
import json
import os

from .offline import get_workload, resolve_model


def model_bytes(config: dict, dtype_bytes: int = 2) -> dict[str, float]:
    """Bytes of the dense weights, of one expert of one layer, and of one token's K/V."""
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads, kv_heads = (
        config["num_attention_heads"],
        config.get("num_key_value_heads") or config["num_attention_heads"],
    )
    head_dim = config.get("head_dim") or h // heads
    attn = h * head_dim * (heads + 2 * kv_heads) + heads * head_dim * h
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    expert_i = config.get("moe_intermediate_size") or config["intermediate_size"]
    sparse = layers if experts else 0
    if experts and config.get("model_type") == "qwen3_moe":
        dense_ids = set(config.get("mlp_only_layers") or [])
        step = config.get("decoder_sparse_step") or 1
        sparse = sum(1 for i in range(layers) if i not in dense_ids and (i + 1) % step == 0)
    dense_mlp = (layers - sparse) * 3 * h * config["intermediate_size"]
    head = (
        vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    )  # the LM head; one embedding row a token
    return {
        "dense": (layers * attn + dense_mlp + sparse * experts * h + head) * dtype_bytes,
        "expert": 3 * h * expert_i * dtype_bytes,
        "experts": experts,
        "top_k": config.get("num_experts_per_tok", 0),
        "sparse_layers": sparse,
        "kv_token": layers * 2 * kv_heads * head_dim * dtype_bytes,
    }


def touched_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts among `tokens` tokens' top-k choices under uniform routing."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens) if num_experts else 0.0


def step_bytes(b: dict, tokens: int, kv_tokens: int) -> float:
    experts = touched_experts(b["experts"], b["top_k"], tokens)
    return b["dense"] + b["sparse_layers"] * experts * b["expert"] + kv_tokens * b["kv_token"]


def roofline(
    config: dict, prompts: list[int], outputs: list[int], bandwidth: float, max_prefill: int
) -> dict:
    """Seconds and tokens/s of the workload at `bandwidth` bytes/s (prefill, then decode in lockstep)."""
    b = model_bytes(config)
    total = 0.0
    for start in range(0, sum(prompts), max_prefill):  # prefill steps, prompts packed back to back
        total += step_bytes(b, min(max_prefill, sum(prompts) - start), 0) / bandwidth
    decode = 0.0
    for t in range(max(outputs)):  # step t: every request with more than t output tokens
        running = [(p, o) for p, o in zip(prompts, outputs) if o > t]
        decode += step_bytes(b, len(running), sum(p + t for p, _ in running)) / bandwidth
    total += decode
    return {"seconds": total, "decode_seconds": decode, "tok_s": sum(outputs) / total}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="w1")
    ap.add_argument("--model", default="qwen3-0.6b", help="a config name (qwen3-30b-a3b, ...) or directory")
    ap.add_argument("--bandwidth", type=float, default=4.20, help="copy bandwidth in TB/s")
    ap.add_argument("--max-prefill-length", type=int, default=8192)
    args = ap.parse_args(argv)
    with open(os.path.join(resolve_model(args.model), "config.json")) as f:
        config = json.load(f)
    w = get_workload(args.workload)
    r = roofline(
        config, [len(p) for p in w.prompts], w.outputs, args.bandwidth * 1e12, args.max_prefill_length
    )
    print(
        f"{w.name} on {args.model} at {args.bandwidth} TB/s: roofline {r['tok_s']:,.0f} tok/s "
        f"({r['seconds']:.2f} s, decode {r['decode_seconds']:.2f} s)"
    )


if __name__ == "__main__":
    main()
