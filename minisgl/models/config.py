"""ModelConfig: the fields of a Hugging Face config.json that the engine needs, normalised."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


# architectures whose HF attention slides on every layer once the config has a window
_SLIDE_ALL = ("mistral", "mixtral", "qwen3_moe")


def _attn_windows(hf: Any) -> tuple[int, ...]:
    """Each layer's attention window (0: full attention), () where no layer slides, as HF's models apply
    them: Mistral, Mixtral and Qwen3-MoE slide on every layer once `sliding_window` is set (Qwen3-MoE's
    config drops it without `use_sliding_window`); Qwen2/Qwen3 on the layers that `layer_types` names
    `sliding_attention` (from `max_window_layers` on)."""
    window = getattr(hf, "sliding_window", None)
    if not window:
        return ()
    types = getattr(hf, "layer_types", None)
    if getattr(hf, "model_type", None) in _SLIDE_ALL or types is None:
        if not getattr(hf, "use_sliding_window", True):
            return ()
        types = ["sliding_attention"] * hf.num_hidden_layers
    windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


@dataclass
class MoEConfig:
    """The sparse layers of a mixture-of-experts model: E experts of intermediate size
    `intermediate_size`, top_k of them per token, their weights renormalised to sum 1 when `renormalize`."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: frozenset[int]

    @classmethod
    def from_hf(cls, hf: Any, num_layers: int) -> MoEConfig | None:
        """Qwen3-MoE (`num_experts`, `decoder_sparse_step`, `mlp_only_layers`) and Mixtral
        (`num_local_experts`, every layer sparse, always renormalised); None for a dense model."""
        num = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None)
        if not num:
            return None
        if getattr(hf, "model_type", None) == "mixtral":
            return cls(num, hf.num_experts_per_tok, hf.intermediate_size, True, frozenset(range(num_layers)))
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        dense = set(getattr(hf, "mlp_only_layers", None) or [])
        sparse = frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        return cls(num, hf.num_experts_per_tok, hf.moe_intermediate_size, bool(hf.norm_topk_prob), sparse)


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    attn_windows: tuple[int, ...] = ()  # each layer's attention window (0: full), () where none slides
    eos_token_ids: list = field(default_factory=list)
    moe: MoEConfig | None = None
    hf_config: Any = None

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        archs = getattr(hf, "architectures", None)
        model_type = getattr(hf, "model_type", "?")
        arch = archs[0] if archs else _BY_MODEL_TYPE.get(model_type, f"<none; model_type {model_type!r}>")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        rope = getattr(hf, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        scaling = getattr(hf, "rope_scaling", None)
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=getattr(hf, "intermediate_size", 0),
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=getattr(hf, "rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=getattr(hf, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)) or arch.startswith("Qwen2"),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            attn_windows=_attn_windows(hf),
            eos_token_ids=eos_ids,
            moe=MoEConfig.from_hf(hf, hf.num_hidden_layers),
            hf_config=hf,
        )

    def check_tp(self, tp_size: int, ep_size: int = 1) -> None:
        """Refuse a TP size the model's heads and MLP cannot be split by, or an EP size its experts cannot
        (before any weight loads)."""
        self._check_ep(tp_size, ep_size)
        if tp_size == 1:
            return
        problems = []
        if self.num_heads % tp_size:
            problems.append(f"num_attention_heads={self.num_heads}")
        kv = self.num_kv_heads
        if (kv % tp_size if kv >= tp_size else tp_size % kv) != 0:  # fewer KV heads than ranks: replicated
            problems.append(f"num_key_value_heads={kv} (the TP size must divide it or be a multiple of it)")
        dense = self.moe is None or len(self.moe.sparse_layers) < self.num_layers
        if dense and self.intermediate_size and self.intermediate_size % tp_size:
            problems.append(f"intermediate_size={self.intermediate_size}")
        if self.moe is not None and self.moe.intermediate_size % (tp_size // ep_size):
            problems.append(
                f"the experts' intermediate size {self.moe.intermediate_size} (over --ep {ep_size})"
            )
        if problems:
            raise ValueError(
                f"{self.architecture} cannot be split over {tp_size} tensor-parallel ranks: "
                f"{', '.join(problems)} not divisible by {tp_size}; choose a --tp-size that divides them"
            )

    def _check_ep(self, tp_size: int, ep_size: int) -> None:
        """--ep N: an MoE model, N dividing the TP size and at most its number of experts (which N need not
        divide: the first ranks hold one expert more, moe/layer.py)."""
        if ep_size == 1:
            return
        if self.moe is None:
            raise ValueError(f"--ep {ep_size}: {self.architecture} has no experts")
        if tp_size % ep_size:
            raise ValueError(f"--ep {ep_size} must divide the TP size ({tp_size})")
        if self.moe.num_experts < ep_size:
            raise ValueError(
                f"--ep {ep_size} exceeds the number of experts ({self.moe.num_experts}): every EP rank "
                "needs at least one"
            )
