"""Loading weights as stored: a .gguf file's tensors (each projection, the embedding and an untied
LM head become a kernel.StoredWeight over the file's blocks; norms and biases are dequantized), or all
dequantized into the float parameters (on a GPU); and a safetensors checkpoint's bf16/fp16 matrices kept
in half precision.

llama.cpp's converter permutes the rows of a Llama q/k projection for its interleaved rotary; the rows
are put back in Hugging Face's order here (whole rows of blocks move, nothing is requantized)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from minisgl.kernel import stored
from minisgl.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from minisgl.moe import Experts
from minisgl.utils.gguf_file import field, open_gguf

from .weights import iter_safetensors, merged_name

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # a sparse layer (Qwen3-MoE, Mixtral): the router and every expert's projection in one 3-D tensor
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_STACKED_EXPERTS = re.compile(r"(?P<module>.*\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")


def hf_name(name: str) -> str:
    """A GGUF tensor name -> the Hugging Face one."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m is None or m.group(2) not in _BLOCK:
        raise ValueError(f"GGUF tensor {name!r} has no place in the model")
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (transformers' reverse_permute, on rows of any kind)."""
    n = rows.shape[0]
    idx = torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(-1)
    return rows[idx]


def iter_gguf(path: str, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, stored.StoredPart]]:
    """(HF name, the tensor as stored: rows of blocks [n, row_bytes], n = 1 for a vector) per tensor."""
    reader = open_gguf(path)
    permute = field(reader, "general.architecture") == "llama"
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # Llama 3's rope scaling, read into the config (utils/gguf_file.py)
            continue
        name = hf_name(t.name)
        shape = [int(s) for s in t.shape]  # GGUF order: the contiguous dim first
        k, n = shape[0], int(np.prod(shape[1:])) if len(shape) > 1 else 1
        rows = torch.from_numpy(np.asarray(t.data).view(np.uint8).reshape(n, -1))
        if permute and (".q_proj." in name or ".k_proj." in name):
            heads = num_heads if ".q_proj." in name else num_kv_heads
            rows = _unpermute(rows, heads) if n > 1 else _unpermute(rows.view(k, -1), heads).view(1, -1)
        yield name, stored.StoredPart(int(t.tensor_type), rows, n, k)


def _dense(part: stored.StoredPart, name: str) -> torch.Tensor:
    """The tensor dequantized to float32 (gguf.quants for types without a torch reference)."""
    if part.ggml_type in stored.STORED_TYPES:
        out = part.dequantize()
    else:
        import gguf

        out = torch.from_numpy(gguf.quants.dequantize(part.data.numpy(), part.ggml_type).copy())
    return out.reshape(part.n, part.k) if part.n > 1 else out.reshape(part.k)


def _keep_stored(module: nn.Module, attr: str, part: stored.StoredPart, name: str) -> bool:
    """Whether this tensor stays as stored: a matrix of a linear or embedding layer, not float32."""
    layers = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, Experts)
    if attr != "weight" or part.n == 1 or part.ggml_type == 0 or not isinstance(module, layers):
        return False
    if part.ggml_type not in stored.STORED_TYPES:
        import gguf

        kind = gguf.GGMLQuantizationType(part.ggml_type).name
        raise ValueError(
            f"GGUF tensor {name!r} is {kind}, which is not kept as stored "
            f"({', '.join(n for n, _, _ in stored.STORED_TYPES.values())} are); "
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
            module.load_shard(attr, _dense(part, hf), idx)
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
        dense = _dense(part, f"{name}.{proj}").reshape(num, part.n // num, part.k)
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
