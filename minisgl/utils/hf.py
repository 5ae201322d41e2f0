"""A Hugging Face model directory: its config, its tokenizer, and how an embedding pools its hidden states
(finding the directory of a model given by path, hub id or .gguf file is models/resolve.py)."""

from __future__ import annotations

import json
import os
from typing import Any


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
