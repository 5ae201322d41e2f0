"""The Llama family: Llama 2/3, SmolLM2, Mistral and Qwen2 (the same decoder; Qwen2 adds a QKV bias), and
Mixtral (Mistral's decoder with a mixture of experts for the MLP).

Qwen3 and Qwen3-MoE reuse these blocks with a per-head RMSNorm on q and k (models/qwen3.py)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from minisgl import kernel
from minisgl.layers import (
    AttentionLayer,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from minisgl.layers.context import get_global_ctx
from minisgl.layers.linear import ColumnParallelLinear
from minisgl.moe import SparseMoeBlock

from .config import ModelConfig


class LlamaAttention(nn.Module):
    qk_norm = False

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, bias=cfg.attention_bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        # Llama's and Qwen3's attention_bias also covers o_proj; Qwen2's bias is on q/k/v only
        o_bias = cfg.attention_bias and not cfg.architecture.startswith("Qwen2")
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=o_bias)
        # Qwen3 normalises each head of q and k before rotary
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if self.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if self.qk_norm else None
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.attn = AttentionLayer(layer_id, self.num_heads, self.num_kv_heads, cfg.head_dim)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm):
        """attention(norm(x + residual)) and the new residual x + residual (x on the first layer)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv, residual = self.qkv_proj.forward_prenorm(x, residual, norm)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        # q/k norm, rotary, the KV store and attention; the attention backend's plan for the batch decides
        # which of them share a kernel (layers/attention.py)
        out = self.attn(q, k, v, self.rotary, self.q_norm, self.k_norm)
        return self.o_proj(out), residual


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm):
        """mlp(norm(x + residual)) and the new residual x + residual."""
        gate_up, residual = self.gate_up_proj.forward_prenorm(x, residual, norm)
        # down(silu(gate) * up): the activation runs inside the down projection's kernel where one exists
        return self.down_proj(gate_up, gated=True), residual


# The fused kernels that compute a whole decoder layer the Llama way (pre-norm RMSNorm, rotary attention
# with an optional per-head q/k norm, a SiLU-gated MLP or experts): the C decode step of a CPU batch
# (engine/cpu_step.py), the Triton layer kernel (kernel.decode_layer) and the CUDA kernel of a whole
# decode step of 1-8 requests (kernel.decode_step).
CPU_DECODE_STEP = "cpu_decode_step"
TRITON_LAYER = "triton_layer"
CUDA_STEP = "cuda_step"


def declares(layer: nn.Module, fast_path: str) -> bool:
    """Whether the layer's own class declares `fast_path` in its body. A subclass does not inherit the
    declaration: one whose math differs (another norm, another activation) would otherwise be computed as
    Llama's by the fused kernel without a word; it declares the paths it has checked it matches."""
    return fast_path in vars(type(layer)).get("fast_paths", ())


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention
    fast_paths: ClassVar[tuple[str, ...]] = (CPU_DECODE_STEP, TRITON_LAYER, CUDA_STEP)

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(cfg, layer_id)
        self.mlp = self.make_mlp(cfg, layer_id)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        """A dense MLP, or in the sparse layers of an MoE model (Qwen3-MoE, Mixtral) its experts."""
        moe = cfg.moe
        if moe is None or layer_id not in moe.sparse_layers:
            return LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        return SparseMoeBlock(
            cfg.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k, moe.renormalize
        )

    def layer_weights(self, fast_path: str = TRITON_LAYER) -> kernel.LayerWeights | None:
        """The tensors kernel.decode_layer (or kernel.decode_step, CUDA_STEP) reads, or None where that
        kernel does not serve this layer: a class that does not declare it, a mixture of experts, tensor
        parallelism, an output-projection or MLP bias, weights kept as stored blocks, widths past the
        kernel's tile."""
        attn, mlp = self.self_attn, self.mlp
        if not declares(self, fast_path):
            return None
        if not isinstance(mlp, LlamaMLP) or attn.qkv_proj.tp_size > 1:
            return None
        if any(p.bias is not None for p in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return None
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(type(p.weight) is nn.Parameter for p in projections):
            return None
        norms = [self.input_layernorm, self.post_attention_layernorm]
        if attn.q_norm is not None:
            norms += [attn.q_norm, attn.k_norm]
        if len({n.eps for n in norms}) > 1:
            return None
        weights = kernel.LayerWeights(
            self.input_layernorm.weight,
            attn.qkv_proj.weight,
            attn.qkv_proj.bias,
            None if attn.q_norm is None else attn.q_norm.weight,
            None if attn.k_norm is None else attn.k_norm.weight,
            attn.o_proj.weight,
            self.post_attention_layernorm.weight,
            mlp.gate_up_proj.weight,
            mlp.down_proj.weight,
            self.input_layernorm.eps,
        )
        if fast_path == CUDA_STEP:
            return weights if kernel.decode_step_fits(weights, attn.num_heads, attn.num_kv_heads) else None
        return weights if kernel.decode_layer_fits(weights) else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None):
        """A pre-norm block on the stream x + residual (x alone on the first layer): adds attention, then
        the MLP. Each residual add and RMSNorm runs in the projection that follows it (forward_prenorm),
        so the block's output is (mlp output, residual) with the add still pending. Where the attention
        backend's plan says whole_layer, the layer kernel runs all of it in one launch."""
        ctx = get_global_ctx()
        if ctx.attn_backend.fusion_plan(ctx.batch).whole_layer:
            weights = self.layer_weights()
            if weights is not None:
                attn = self.self_attn
                inputs = ctx.attn_backend.layer_inputs(ctx.batch, attn.attn.layer_id)
                return kernel.decode_layer(
                    x, residual, weights, attn.num_heads, attn.num_kv_heads, attn.rotary.cos_sin_cache, inputs
                )
        x, residual = self.self_attn(x, residual, self.input_layernorm)
        return self.mlp(x, residual, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([self.layer_cls(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self) -> torch.Tensor:
        ctx = get_global_ctx()
        x = self.embed_tokens(ctx.batch.input_ids)
        step = self.step_weights() if ctx.attn_backend.fusion_plan(ctx.batch).whole_step else None
        if step is not None and kernel.decode_step_serves(step, x.shape[0]):  # every layer in one launch
            x, residual = kernel.decode_step(x, step, **ctx.attn_backend.step_inputs(ctx.batch))
        else:
            residual = None
            for layer in self.layers:
                x, residual = layer(x, residual)
        x, _ = self.norm(x, residual)
        return x

    def step_weights(self) -> kernel.StepWeights | None:
        """Every layer's tensors for kernel.decode_step (made once), or None where some layer is not
        served: then the layers run one by one."""
        if not hasattr(self, "_step_weights"):
            layers = [layer.layer_weights(CUDA_STEP) for layer in self.layers]
            attn = self.layers[0].self_attn
            cache = attn.rotary.cos_sin_cache  # the kernel reads one table: every layer's must be this
            same = all(torch.equal(layer.self_attn.rotary.cos_sin_cache, cache) for layer in self.layers)
            served = all(lw is not None for lw in layers) and same
            self._step_weights = (
                kernel.step_weights(layers, attn.num_heads, attn.num_kv_heads, attn.head_dim, cache)
                if served
                else None
            )
        return self._step_weights


class LlamaForCausalLM(nn.Module):
    """forward() reads the batch from the Context and returns final hidden states [num_tokens, hidden];
    compute_logits() applies the LM head to the rows the engine samples from."""

    model_cls = LlamaModel

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.model_cls(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self) -> torch.Tensor:
        return self.model()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class MixtralForCausalLM(LlamaForCausalLM):
    """Mistral's decoder with experts; its checkpoints call the sparse block `block_sparse_moe`."""

    checkpoint_renames: ClassVar[dict[str, str]] = {".block_sparse_moe.": ".mlp."}
