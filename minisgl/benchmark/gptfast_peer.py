"""gpt-fast (github.com/pytorch-labs/gpt-fast: a plain PyTorch Llama whose decode step is compiled with
torch.compile's "reduce-overhead" mode, i.e. inductor's kernels replayed as CUDA graphs) as W2's peer on
the same GPU, with random bf16 weights of a Llama-shaped config:

    python -m minisgl.benchmark.gptfast_peer --gpt-fast-dir DIR --model llama-3.2-1b

DIR is a checkout of gpt-fast: its model.py and generate.py are imported from there unchanged and its
`generate` does the work, with `decode_one_token` compiled as its own `--compile` does. W2 is counted as
offline.py counts it: one request of 128 random prompt tokens and 256 output tokens, the whole generate call
(the prefill included) over the output tokens, the median of --repeat calls after --warmup calls (the first
compiles, the next ones record the graphs). gpt-fast models Llama layers only (no q/k norm, head dim =
hidden / heads), so Qwen3 shapes cannot be given to it."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from minisgl.benchmark.offline import get_workload, resolve_model


def model_args(config: dict, block_size: int) -> dict:
    """gpt-fast's ModelArgs fields for a Hugging Face Llama config."""
    if config.get("model_type") != "llama":
        raise SystemExit(f"gpt-fast runs Llama layers only; this config is {config.get('model_type')!r}")
    if config["hidden_size"] // config["num_attention_heads"] != config.get(
        "head_dim", config["hidden_size"] // config["num_attention_heads"]
    ):
        raise SystemExit("gpt-fast takes head_dim = hidden_size / num_attention_heads")
    scaling = config.get("rope_scaling")
    if scaling is not None:
        scaling = {
            k: scaling[k]
            for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        }
    return {
        "block_size": block_size,
        "vocab_size": config["vocab_size"],
        "n_layer": config["num_hidden_layers"],
        "n_head": config["num_attention_heads"],
        "dim": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "n_local_heads": config["num_key_value_heads"],
        "rope_base": config["rope_theta"],
        "norm_eps": config["rms_norm_eps"],
        "rope_scaling": scaling,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpt-fast-dir", required=True, help="a checkout of pytorch-labs/gpt-fast")
    ap.add_argument("--model", default="llama-3.2-1b", help="a Llama config dir, or a shape config name")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    import torch

    sys.path.insert(0, os.path.abspath(args.gpt_fast_dir))
    import generate as gf  # gpt-fast's generate.py
    from model import ModelArgs, Transformer  # gpt-fast's model.py

    with open(os.path.join(resolve_model(args.model), "config.json")) as f:
        config = json.load(f)
    workload = get_workload("w2", None, None)
    prompt_len, out_len = len(workload.prompts[0]), workload.outputs[0]
    device = torch.device(args.device)
    with device:
        model = Transformer(ModelArgs(**model_args(config, block_size=4096)))
    model = model.to(dtype=torch.bfloat16).eval()
    # as gpt-fast's main() with --compile
    gf.decode_one_token = torch.compile(gf.decode_one_token, mode="reduce-overhead", fullgraph=True)
    prompt = torch.tensor(workload.prompts[0], dtype=torch.int, device=device)

    def once() -> float:
        gf.device_sync(args.device)
        t = time.perf_counter()
        with torch.inference_mode():
            gf.generate(model, prompt, out_len, 1, interactive=False, draft_model=None, temperature=0.0)
        gf.device_sync(args.device)
        return time.perf_counter() - t

    for i in range(args.warmup):
        print(f"warm-up {i + 1}/{args.warmup}: {once():.2f} s", flush=True)
    times = [once() for _ in range(args.repeat)]
    sec = statistics.median(times)
    print(
        f"W2 gpt-fast: {1000 * sec / out_len:.2f} ms per output token, {out_len / sec:.1f} tok/s, {sec:.2f} s "
        f"(median of {len(times)}: {', '.join(f'{t:.2f}' for t in times)}) | {config['model_type']} "
        f"{config['num_hidden_layers']} layers x {config['hidden_size']}, bf16, {prompt_len} prompt tokens on "
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
    )


if __name__ == "__main__":
    main()
