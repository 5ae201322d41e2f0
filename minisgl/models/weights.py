"""Weight loading: map Hugging Face tensor names onto the merged, TP-sharded parameters."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch
from torch import nn
from tqdm import tqdm

from minisgl.moe import EXPERT_WEIGHT, Experts

# HF name fragment -> (merged parameter fragment, part index)
_MERGED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def merged_name(name: str) -> tuple[str, int]:
    """An HF tensor name -> (the name of the parameter it is loaded into, its part index there)."""
    for frag, (merged, idx) in _MERGED.items():
        if frag in name:
            return name.replace(frag, merged), idx
    return name, 0


def iter_safetensors(model_dir: str, show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir!r}")
    for path in tqdm(
        files, desc="Loading weights", unit="file", disable=not show_progress or len(files) == 1
    ):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                yield name, f.get_tensor(name)


def load_weights(
    model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]], show_progress: bool = True
) -> None:
    """Copy every HF tensor into its (possibly merged and sharded) parameter; fail on anything missing."""
    modules: dict[str, nn.Module] = dict(model.named_modules())
    expected = {n for n, _ in model.named_parameters(remove_duplicate=True)}
    loaded = set()
    experts = [m for m in modules.values() if isinstance(m, Experts)]
    # a checkpoint holds each expert's three projections apart, where the model stacks them in two tensors
    total = len(expected) + sum(3 * m.num_experts - 2 for m in experts)
    bar = tqdm(desc="Loading weights", unit="tensor", total=total, disable=not show_progress)
    renames = getattr(model, "checkpoint_renames", {})
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        for frag, new in renames.items():
            name = name.replace(frag, new)
        if _load_expert(modules, name, tensor):  # one expert's projection into its layer's stacked tensor
            if name not in loaded:
                loaded.add(name)
                bar.update(1)
            continue
        name, part = merged_name(name)
        module_name, _, attr = name.rpartition(".")
        module = modules.get(module_name)
        stacked = isinstance(module, Experts)  # all experts in one tensor: gate_up_proj, down_proj
        if (
            module is None
            or not hasattr(module, "load_shard")
            or (getattr(module, attr, None) is None and not stacked)
        ):
            if name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
                continue
            raise ValueError(
                f"checkpoint tensor {name!r} has no place in {type(model).__name__} as its config.json "
                f"describes it (a bias the config does not announce, or a layer it does not have)"
            )
        module.load_shard(attr, tensor, part)
        if name not in loaded:
            loaded.add(name)
            bar.update(1)
    bar.close()
    missing = expected - loaded
    for module_name, module in modules.items():
        if isinstance(module, Experts):
            missing.update(f"{module_name}.{m}" for m in module.missing())
            missing -= {f"{module_name}.w13", f"{module_name}.w2"}
    if getattr(model.config, "tie_word_embeddings", False):
        missing.discard("lm_head.weight")
        if "model.embed_tokens.weight" in missing and "lm_head.weight" in loaded:
            missing.discard("model.embed_tokens.weight")
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")


def _load_expert(modules: dict[str, nn.Module], name: str, tensor: torch.Tensor) -> bool:
    """`...experts.<e>.<proj>.weight`: copied by the MoE layer (its rank's experts and shard only)."""
    m = EXPERT_WEIGHT.match(name)
    module = modules.get(m["module"]) if m else None
    if not isinstance(module, Experts):
        return False
    module.load_expert(int(m["expert"]), m["proj"], tensor)
    return True


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights with the real shapes (`--load-format dummy`): matrices scaled by 1/sqrt(fan_in) so
    activations keep their size through the layers and the greedy output is not degenerate."""
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif p.dim() >= 2:  # a matrix [out, in], or stacked experts [E, out, in]
            bound = (3.0 / p.shape[-1]) ** 0.5
            p.data.uniform_(-bound, bound)
        else:
            p.data.uniform_(-0.02, 0.02)
