"""A .gguf file as a Hugging Face model directory, written once and cached under a key of the file's
contents: prepared as stored (config.json from the metadata, the tokenizer, a link to the file whose
weights the engine then reads as they are), or converted to float32 safetensors through transformers."""

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
from minisgl.utils.logger import init_logger, logged_step

from .config import complete_config, hf_config
from .reader import open_gguf
from .tokenizer import has_tokenizer, load_tokenizer

logger = init_logger(__name__)

GGUF_LINK = "model.gguf"  # in a directory prepared as stored: the file the weights are read from
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


def cache_dir(gguf_path: str) -> str:
    """Where the file's converted directory is cached (its stored one: this + "-stored")."""
    name = os.path.basename(gguf_path).rsplit(".", 1)[0]
    return os.path.join(ENV.cache_dir, "gguf", f"{name}-{_content_key(gguf_path)[:16]}")


def prepare_stored(gguf_path: str) -> str:
    """The file's directory as stored (config, tokenizer, a link to the file), written on the first
    start; later starts find it, and point its link at `gguf_path` (the same contents may have been
    prepared from another path, since removed)."""
    out = cache_dir(gguf_path) + "-stored"
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(out, "config.json")):
            link = os.path.join(out, GGUF_LINK)
            if os.readlink(link) != os.path.abspath(gguf_path):
                if os.path.lexists(link + ".tmp"):
                    os.remove(link + ".tmp")
                os.symlink(os.path.abspath(gguf_path), link + ".tmp")
                os.replace(link + ".tmp", link)
            return out
        logger.info(f"Preparing {gguf_path} (first start only): its config and tokenizer into {out}")
        reader = open_gguf(gguf_path)
        tmp = out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        if has_tokenizer(reader):
            with logged_step(logger, "Reading the tokenizer from the GGUF file (transformers)"):
                load_tokenizer(gguf_path).save_pretrained(tmp)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config(reader), f, indent=2)
        os.symlink(os.path.abspath(gguf_path), os.path.join(tmp, GGUF_LINK))
        os.replace(tmp, out)
    return out


def convert_gguf(gguf_path: str) -> str:
    """The file dequantized once through transformers, cached as safetensors + config + tokenizer."""
    out = cache_dir(gguf_path)
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
            from transformers import AutoConfig, AutoModelForCausalLM
        folder, fname = os.path.split(os.path.abspath(gguf_path))
        with logged_step(logger, "Step 2/4: reading the tokenizer from the GGUF file"):
            tok = load_tokenizer(gguf_path)
        with logged_step(logger, "Step 3/4: reading and dequantizing the weights"):
            config = AutoConfig.from_pretrained(folder, gguf_file=fname)
            complete_config(open_gguf(gguf_path), config)
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
