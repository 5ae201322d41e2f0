"""A .gguf file read as stored: its metadata as a Hugging Face config, its tokenizer, and its tensors as
memory-mapped rows of blocks (the `gguf` package's reader; nothing is dequantized here).

`prepare_stored` writes a small cached directory (config.json, the tokenizer, a link to the file) that
the rest of the engine reads like any model directory; the weights stay in the .gguf file."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from typing import Any

GGUF_LINK = "model.gguf"  # in a prepared directory: the file the weights are read from
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def open_gguf(path: str) -> Any:
    """The gguf package's reader over a copy-on-write map: tensors are views of the file's pages (shared
    with the page cache, read on first touch), writable in memory, the file never written."""
    try:
        import gguf
    except ImportError:
        raise ValueError("reading a .gguf file needs the package 'gguf': pip install gguf") from None
    return gguf.GGUFReader(path, "c")


def field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_config(reader: Any) -> dict[str, Any]:
    """The config.json of the model in the file, from its llama.cpp metadata keys."""
    arch = field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported as stored (supported: {', '.join(_ARCHITECTURES)})"
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names or field(reader, f"{arch}.rope.scaling.type", "none") != "none":
        raise ValueError("GGUF files with rope scaling are not supported as stored")

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
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
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
    for name in ("bos", "eos", "padding"):
        token = field(reader, f"tokenizer.ggml.{name}_token_id")
        if token is not None:
            config["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(token)
    return config


def prepare_stored(gguf_path: str, out: str) -> str:
    """Write `out` (config, tokenizer, a link to the file) once; later starts find it."""
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(out, "config.json")):
            return out
        reader = open_gguf(gguf_path)
        tmp = out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        if field(reader, "tokenizer.ggml.model") is not None:  # test files may have none
            from transformers import AutoTokenizer

            folder, fname = os.path.split(os.path.abspath(gguf_path))
            AutoTokenizer.from_pretrained(folder, gguf_file=fname).save_pretrained(tmp)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config(reader), f, indent=2)
        os.symlink(os.path.abspath(gguf_path), os.path.join(tmp, GGUF_LINK))
        os.replace(tmp, out)
    return out
