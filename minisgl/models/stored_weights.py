"""Loading weights as stored into a model: a .gguf file's tensors (gguf/tensors.py: each projection, the
embedding and an untied LM head become a gguf.StoredWeight over the file's blocks; norms and biases are
dequantized), or all dequantized into the float parameters (on a GPU); and a safetensors checkpoint's
bf16/fp16 matrices kept in half precision."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn
from tqdm import tqdm

from minisgl.gguf import stored
from minisgl.gguf.blocks import STORED_TYPES, dequantize_any
from minisgl.gguf.tensors import iter_gguf
from minisgl.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from minisgl.moe import Experts

from .weights import iter_safetensors, merged_name

_STACKED_EXPERTS = re.compile(r"(?P<module>.*\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")


def _dense(part: stored.StoredPart) -> torch.Tensor:
    """The tensor dequantized to float32 ([n, k], or [k] for a vector)."""
    out = dequantize_any(part.ggml_type, part.data, part.k)
    return out if part.n > 1 else out.reshape(part.k)


def _keep_stored(module: nn.Module, attr: str, part: stored.StoredPart, name: str) -> bool:
    """Whether this tensor stays as stored: a matrix of a linear or embedding layer, not float32."""
    layers = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, Experts)
    if attr != "weight" or part.n == 1 or part.ggml_type == 0 or not isinstance(module, layers):
        return False
    if part.ggml_type not in STORED_TYPES:
        import gguf

        kind = gguf.GGMLQuantizationType(part.ggml_type).name
        raise ValueError(
            f"GGUF tensor {name!r} is {kind}, which is not kept as stored "
            f"({', '.join(n for n, _, _ in STORED_TYPES.values())} are); "
            "--weights-format float32 converts the file instead"
        )
    return True


def load_gguf(model: nn.Module, path: str, keep_stored: bool, show_progress: bool = True) -> int:
    """Load the file's tensors into `model`; returns the bytes of the weights kept as stored."""
    cfg = model.config
    tensors = iter_gguf(path, cfg.num_heads, cfg.num_kv_heads)
    return _load_parts(
        model, tqdm(tensors, desc="Loading GGUF", unit="tensor", disable=not show_progress), keep_stored
    )


def load_stored_safetensors(model: nn.Module, model_dir: str, show_progress: bool = True) -> int:
    """A safetensors checkpoint with its bf16/fp16 matrices kept in half precision (upcast inside the
    kernels); float32 tensors are copied as usual. Returns the bytes kept as stored."""
    half = {torch.float16: 1, torch.bfloat16: 30}

    def parts() -> Iterator[tuple[str, stored.StoredPart]]:
        for name, t in iter_safetensors(model_dir, show_progress):
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            t = t.contiguous()
            k, n = t.shape[-1], t.numel() // t.shape[-1] if t.dim() > 1 else 1
            if t.dtype in half:
                yield name, stored.StoredPart(half[t.dtype], t.view(torch.uint8).reshape(n, -1), n, k)
            else:
                yield name, stored.StoredPart(0, t.float().view(torch.uint8).reshape(n, -1), n, k)

    return _load_parts(model, parts(), keep_stored=True)


def _load_parts(model: nn.Module, tensors: Iterator[tuple[str, stored.StoredPart]], keep_stored: bool) -> int:
    """Matrices of linear/embedding layers become StoredWeights (keep_stored), the rest float parameters."""
    cfg = model.config
    modules: dict[str, nn.Module] = dict(model.named_modules())
    pending: dict[str, dict[int, stored.StoredPart]] = {}
    experts: dict[str, dict[str, stored.StoredPart]] = {}  # per Experts module, its three stacked tensors
    loaded: set[str] = set()
    for hf, part in tensors:
        m = _STACKED_EXPERTS.fullmatch(hf)
        if m is not None and isinstance(modules.get(m["module"]), Experts):
            experts.setdefault(m["module"], {})[m["proj"]] = part
            continue
        name, idx = merged_name(hf)
        module_name, _, attr = name.rpartition(".")
        module = modules.get(module_name)
        if module is None:
            raise ValueError(f"checkpoint tensor {hf!r} has no place in {type(model).__name__}")
        if keep_stored and _keep_stored(module, attr, part, hf):
            pending.setdefault(module_name, {})[idx] = part
        else:
            module.load_shard(attr, _dense(part), idx)
        loaded.add(name)
    for module_name, parts in pending.items():
        _install(modules[module_name], [parts[i] for i in sorted(parts)])
    stored_bytes = sum(p.data.numel() for parts in pending.values() for p in parts.values())
    for module_name, projs in experts.items():
        stored_bytes += _load_experts(modules[module_name], projs, keep_stored, module_name)
        loaded |= {f"{module_name}.w13", f"{module_name}.w2"}
    if cfg.tie_word_embeddings and "lm_head.weight" not in loaded and "lm_head" in modules:
        head, embed = modules["lm_head"], modules["model.embed_tokens"]
        if isinstance(embed.weight, stored.StoredWeight):
            del head.weight  # still the embedding's float Parameter
            head.weight = embed.weight  # the tied head reads the same blocks
        loaded.add("lm_head.weight")
    expected = {n for n, _ in model.named_parameters()} | {f"{m}.weight" for m in pending}
    missing = expected - loaded - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
    return stored_bytes


def _load_experts(module: Experts, projs: dict[str, stored.StoredPart], keep_stored: bool, name: str) -> int:
    """A sparse layer's three stacked tensors ([E x out] rows of blocks each): every expert's rows kept as
    stored StoredWeights (gate | up, down) where all three are of a kept type, else dequantized into the
    float parameters; returns the bytes kept as stored."""
    if set(projs) != {"gate_proj", "up_proj", "down_proj"}:
        raise ValueError(
            f"the checkpoint lacks {name}'s {sorted({'gate_proj', 'up_proj', 'down_proj'} - set(projs))}"
        )
    num = module.num_experts

    def per_expert(part: stored.StoredPart) -> list[stored.StoredPart]:
        if part.n % num:
            raise ValueError(f"{name}: {part.n} rows are not {num} experts' worth")
        n = part.n // num
        return [
            stored.StoredPart(part.ggml_type, part.data[e * n : (e + 1) * n], n, part.k) for e in range(num)
        ]

    if keep_stored and all(_keep_stored(module, "weight", p, f"{name}.{proj}") for proj, p in projs.items()):
        gate, up, down = (per_expert(projs[p]) for p in ("gate_proj", "up_proj", "down_proj"))
        module.keep_stored(
            [stored.StoredWeight([g, u]) for g, u in zip(gate, up)], [stored.StoredWeight([d]) for d in down]
        )
        return sum(p.data.numel() for p in projs.values())
    for proj, part in projs.items():
        dense = _dense(part).reshape(num, part.n // num, part.k)
        for e in range(num):
            module.load_expert(e, proj, dense[e])
    return 0


def _install(module: nn.Module, parts: list[stored.StoredPart]) -> None:
    """Replace the module's float weight by the stored parts (one part where they share a type)."""
    if getattr(module, "tp_size", 1) != 1:
        raise ValueError("stored GGUF weights run on one rank; --weights-format float32 shards them")
    if len(parts) > 1 and len({p.ggml_type for p in parts}) == 1:
        data = torch.cat([p.data for p in parts])
        parts = [stored.StoredPart(parts[0].ggml_type, data, data.shape[0], parts[0].k)]
    weight = stored.StoredWeight(parts)
    if tuple(weight.shape) != tuple(module.weight.shape):
        raise ValueError(f"a stored weight of shape {tuple(weight.shape)} for {tuple(module.weight.shape)}")
    del module.weight  # the float Parameter, never touched, so never resident
    module.weight = weight
