"""llama.cpp's tensor names in a .gguf file -> the Hugging Face names the models load."""

from __future__ import annotations

import re

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
# tensors that are not weights of a module: Llama 3's rope scaling, read into the config (gguf/config.py)
NOT_WEIGHTS = frozenset({"rope_freqs.weight"})


def hf_name(name: str) -> str:
    """A GGUF tensor name -> the Hugging Face one."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m is None or m.group(2) not in _BLOCK:
        raise ValueError(f"GGUF tensor {name!r} has no place in the model")
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
