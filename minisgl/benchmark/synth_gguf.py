"""Write a GGUF file of random weights in llama.cpp's layout: a Llama-architecture model of the shapes
given, its projections in the block types of a llama.cpp quantization recipe, the tokenizer (and chat
template) of the embedded default model. For timing minisgl and llama.cpp on the same K-quant file where no
real one can be downloaded.

python -m minisgl.benchmark.synth_gguf OUT.gguf [--recipe q4_k_m] [--hidden 2048] [--layers 8] [--rope-freqs]
    [--experts 64 --experts-used 8 --expert-intermediate 512]

With --experts the model is a Qwen3-MoE (llama.cpp's `qwen3moe`: q/k norms, a float32 router and the
experts' gate, up and down projections in one 3-D tensor each, typed as the recipe types ffn_gate, ffn_up
and ffn_down); head_dim is hidden / heads.

Recipes: q4_k_m (attn_v, ffn_down and the output head Q6_K, the rest Q4_K, as llama.cpp's Q4_K_M keeps
them), q5_k_m (Q5_K and Q6_K), q6_k, iq4_xs (IQ4_XS, the output head Q6_K), q4_0, q8_0. Each block's fp16 scales are drawn so the weights have
about 1/sqrt(fan-in) of spread; norms are ones."""

from __future__ import annotations

import argparse

import numpy as np
from tqdm import tqdm

RECIPES = {
    "q4_k_m": {"default": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"},
    "q5_k_m": {"default": "Q5_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"},
    "q6_k": {"default": "Q6_K"},
    "iq4_xs": {"default": "IQ4_XS", "output": "Q6_K"},
    "q4_0": {"default": "Q4_0", "output": "Q8_0"},
    "q8_0": {"default": "Q8_0"},
}


def random_blocks(name: str, n: int, k: int, spread: float, rng: np.random.Generator) -> np.ndarray:
    """[n, row bytes] of random blocks of type `name` whose dequantized values have about `spread` of
    standard deviation (one fp16 scale per block, or two: the minimum's the same)."""
    import gguf

    from minisgl.gguf.blocks import SCALE_OFFSETS

    qtype = gguf.GGMLQuantizationType[name]
    qk, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n * k // qk, nbytes), dtype=np.uint8)
    offsets = SCALE_OFFSETS[name]
    for off in offsets:
        blocks[:, off : off + 2] = np.float16(1.0).reshape(1, 1).view(np.uint8)
    unit = float(gguf.quants.dequantize(blocks[:256], qtype).std())  # the spread at unit scales
    for off in offsets:
        d = (spread / unit) * rng.uniform(0.5, 1.5, size=(len(blocks), 1))
        blocks[:, off : off + 2] = d.astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def main(argv: list[str] | None = None) -> None:
    import gguf

    from minisgl.models.resolve import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--recipe", default="q4_k_m", choices=list(RECIPES))
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", type=int, default=0, help="a Qwen3-MoE of this many experts a layer")
    ap.add_argument("--experts-used", type=int, default=8)
    ap.add_argument("--expert-intermediate", type=int, default=512)
    ap.add_argument(
        "--rope-freqs",
        action="store_true",
        help="Llama 3.2's rope scaling (factor 32 over 8192), as rope_freqs",
    )
    args = ap.parse_args(argv)
    recipe = RECIPES[args.recipe]
    source = gguf.GGUFReader(default_model_path())
    vocab = int(source.fields["llama.vocab_size"].contents())
    h, inter, head_dim = args.hidden, args.intermediate, args.hidden // args.heads
    arch = "qwen3moe" if args.experts else "llama"
    writer = gguf.GGUFWriter(args.out, arch)
    writer.add_name(f"random {arch} {args.layers}x{h} {args.recipe}")
    if args.experts:
        for key, value in [
            ("expert_count", args.experts),
            ("expert_used_count", args.experts_used),
            ("expert_feed_forward_length", args.expert_intermediate),
            ("attention.key_length", head_dim),
            ("attention.value_length", head_dim),
        ]:
            writer.add_uint32(f"{arch}.{key}", value)
    for key, value in [
        ("block_count", args.layers),
        ("context_length", 8192),
        ("embedding_length", h),
        ("feed_forward_length", inter),
        ("attention.head_count", args.heads),
        ("attention.head_count_kv", args.kv_heads),
        ("rope.dimension_count", head_dim),
        ("vocab_size", vocab),
    ]:
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 500000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    for name, field in source.fields.items():  # the default model's tokenizer, as its file holds it
        if name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    rng = np.random.default_rng(args.seed)
    kv = args.kv_heads * head_dim
    tensors = [("token_embd", vocab, h)]
    for i in range(args.layers):
        tensors += [(f"blk.{i}.attn_norm", 1, h), (f"blk.{i}.ffn_norm", 1, h)]
        tensors += [(f"blk.{i}.attn_q", h, h), (f"blk.{i}.attn_k", kv, h), (f"blk.{i}.attn_v", kv, h)]
        tensors += [(f"blk.{i}.attn_output", h, h)]
        if args.experts:  # (name, rows, k, experts): the router in float32, then 3-D expert tensors
            e, ei = args.experts, args.expert_intermediate
            tensors += [(f"blk.{i}.attn_q_norm", 1, head_dim), (f"blk.{i}.attn_k_norm", 1, head_dim)]
            tensors += [(f"blk.{i}.ffn_gate_inp", -e, h), (f"blk.{i}.ffn_gate_exps", ei, h, e)]
            tensors += [(f"blk.{i}.ffn_up_exps", ei, h, e), (f"blk.{i}.ffn_down_exps", h, ei, e)]
        else:
            tensors += [(f"blk.{i}.ffn_gate", inter, h), (f"blk.{i}.ffn_up", inter, h)]
            tensors += [(f"blk.{i}.ffn_down", h, inter)]
    tensors += [("output_norm", 1, h), ("output", vocab, h)]
    if args.rope_freqs:
        from minisgl.gguf.config import llama3_factors

        factors = llama3_factors(head_dim, 500000.0, 32.0, 1.0, 4.0, 8192)
        writer.add_tensor("rope_freqs.weight", factors)
    for name, n, k, *experts in tqdm(tensors, desc="Writing random blocks", unit="tensor"):
        if n == 1:  # a norm: float32 ones
            writer.add_tensor(f"{name}.weight", np.ones(k, np.float32))
            continue
        if n < 0:  # a router: float32
            writer.add_tensor(f"{name}.weight", (rng.standard_normal((-n, k)) * k**-0.5).astype(np.float32))
            continue
        kind = name.split(".")[-1].removesuffix("_exps")
        qtype = recipe.get(kind, recipe["default"])
        spread = 0.02 if kind == "token_embd" else k**-0.5
        e = experts[0] if experts else 1
        data = random_blocks(qtype, n * e, k, spread, rng)
        shape = (e, n, data.shape[1]) if experts else data.shape
        writer.add_tensor(f"{name}.weight", data.reshape(shape), raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
