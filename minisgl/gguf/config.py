"""The Hugging Face config of a .gguf file's model, from its llama.cpp metadata keys: the architecture and
shapes, the expert layout, the rope scaling (llama.cpp's `rope.scaling.*` keys, or a Llama 3.1+
`rope_freqs` tensor read back as HF's llama3 scaling) and the special tokens."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .reader import field

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
_MODEL_TYPES = {"qwen3moe": "qwen3_moe"}  # llama.cpp's architecture names that are not HF's model_type


def hf_config(reader: Any) -> dict[str, Any]:
    """The config.json of the model in the file, from its llama.cpp metadata keys."""
    arch = field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported as stored (supported: {', '.join(_ARCHITECTURES)})"
        )
    names = {t.name for t in reader.tensors}

    def key(name: str, default: Any = None) -> Any:
        value = field(reader, f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"the GGUF file has no {arch}.{name}")
        return value

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    config = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": _MODEL_TYPES.get(arch, arch),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length", field(reader, f"{arch}.expert_feed_forward_length")),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", hidden // heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length"),
        "vocab_size": key("vocab_size", int(embd.shape[1])),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    experts = field(reader, f"{arch}.expert_count", 0)
    if experts:  # llama.cpp normalizes the top-k routing weights of both (Mixtral's HF config always does)
        moe = {"num_experts_per_tok": key("expert_used_count")}
        expert_ffn = key("expert_feed_forward_length", config["intermediate_size"])
        if arch == "qwen3moe":
            moe |= {"num_experts": experts, "moe_intermediate_size": expert_ffn, "norm_topk_prob": True}
            moe |= {"decoder_sparse_step": 1, "mlp_only_layers": []}
        elif arch == "llama":  # Mixtral is written as a Llama with experts
            moe |= {"num_local_experts": experts, "intermediate_size": expert_ffn}
            config |= {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
        else:
            raise ValueError(f"GGUF architecture {arch!r} with experts is not supported as stored")
        config |= moe
    scaling = rope_scaling(reader, config["head_dim"], config["rope_theta"])
    if scaling is not None:
        config["rope_scaling"] = scaling
    for name in ("bos", "eos", "padding"):
        token = field(reader, f"tokenizer.ggml.{name}_token_id")
        if token is not None:
            config["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(token)
    return config


# the rope.scaling keys read (llama.cpp's converter writes them from the HF config's rope scaling), each
# with the HF key it becomes and, for keys HF has no counterpart of, the only value the file may give
_YARN_KEYS = {
    "yarn_attn_factor": "attention_factor",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}
_NEUTRAL_KEYS = {"attn_factor": 1.0, "yarn_ext_factor": 1.0, "yarn_log_multiplier": 0.0, "finetuned": None}


def rope_scaling(reader: Any, head_dim: int, theta: float) -> dict[str, Any] | None:
    """The HF rope scaling of the file: llama.cpp's `rope.scaling.*` metadata (linear or YaRN), or a Llama
    3.1+ `rope_freqs.weight` tensor (llama3); None without either. Other types and keys that change the
    rotation beyond what HF's config expresses are refused by name."""
    arch = field(reader, "general.architecture")
    prefix = f"{arch}.rope.scaling."
    kind = field(reader, prefix + "type", "none")
    if kind == "none":
        if any(t.name == "rope_freqs.weight" for t in reader.tensors):
            return llama3_scaling(reader, {"head_dim": head_dim, "rope_theta": theta})
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"the GGUF file's rope scaling type {kind!r} is not supported (linear and yarn are)")
    factor = field(reader, prefix + "factor")
    if not factor:
        raise ValueError(f"the GGUF file's {kind} rope scaling has no {prefix}factor")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    for key in (k[len(prefix) :] for k in reader.fields if k.startswith(prefix)):
        value = field(reader, prefix + key)
        if key in ("type", "factor", "original_context_length") or (kind == "yarn" and key in _YARN_KEYS):
            if key in _YARN_KEYS:
                scaling[_YARN_KEYS[key]] = float(value)
        elif key not in _NEUTRAL_KEYS or (_NEUTRAL_KEYS[key] is not None and value != _NEUTRAL_KEYS[key]):
            raise ValueError(f"the GGUF file's {prefix}{key} = {value!r} is not supported")
    if kind == "yarn":
        old_len = field(reader, prefix + "original_context_length")
        if not old_len:
            raise ValueError(f"the GGUF file's yarn rope scaling has no {prefix}original_context_length")
        scaling["original_max_position_embeddings"] = int(old_len)
    return scaling


def llama3_factors(
    head_dim: int, theta: float, factor: float, low: float, high: float, old_len: int
) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as rope_freqs.weight for a llama3 rope scaling
    (1 for short wavelengths, `factor` for long ones, a smooth blend between)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def llama3_scaling(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The llama3 rope scaling whose factors the file holds: the factor is their largest; the low/high
    frequency factors and the original context are those of Llama 3.1-3.3 (1, 4) at the power of two that
    reproduces the file's factors. Another set of factors is refused: no HF config would say it."""
    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    stored_factors = np.asarray(t.data, dtype=np.float32).reshape(-1)
    factor = float(stored_factors.max())
    for exp in range(4, 21):
        cand = llama3_factors(config["head_dim"], config["rope_theta"], factor, 1.0, 4.0, 2**exp)
        if cand.shape == stored_factors.shape and np.allclose(cand, stored_factors, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 2**exp}  # fmt: skip
    raise ValueError("the GGUF file's rope_freqs.weight matches no llama3 rope scaling; it is not supported")


def complete_config(reader: Any, config: Any) -> None:
    """Put back into a transformers config read from the file (`AutoConfig(..., gguf_file=...)`) what
    transformers' GGUF reader leaves out, as `hf_config` reads it: the rope scaling (llama.cpp's
    rope.scaling metadata, a Llama 3.1+ rope_freqs tensor), and a Qwen3-MoE's expert width and routing
    (expert_feed_forward_length; top-k weights renormalised, as llama.cpp computes them, where HF's
    default does not)."""
    if getattr(config, "model_type", None) == "qwen3_moe":
        ours = hf_config(reader)
        config.moe_intermediate_size = ours["moe_intermediate_size"]
        config.norm_topk_prob = ours["norm_topk_prob"]
    rope = getattr(config, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    scaling = rope_scaling(reader, head_dim, theta)
    if scaling is not None:
        config.rope_parameters = {"rope_theta": theta, **scaling}
