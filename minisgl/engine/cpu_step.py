"""The CPU decode step: every layer of a Llama-family model (Llama, SmolLM2, Mistral, Qwen2, Qwen3, and
Qwen3-MoE/Mixtral with GGUF experts as stored) in one call into the C kernels (kernel/cpu
`decode_step`), the CPU's counterpart of a decode graph.

The layers' Python issues about a dozen kernel calls per layer, each a few microseconds of dispatch: on a
small model that was as long as the GEMVs themselves (docs/BENCHMARKS.md). The step runs the same kernels
in the same order inside one parallel region, so it computes what the layers compute; the LM head and
sampling stay with the engine. A sparse layer routes in C (softmax, top k, renormalised as the reference)
and runs its stored experts through the same kernel as the layers (moe_stored). Models or settings it does
not cover (float experts, tensor parallelism, half precision, another attention backend) keep the
layer-by-layer path."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from minisgl import kernel
from minisgl.attention.cpu_backend import CpuAttnBackend
from minisgl.gguf.blocks import TYPE_IDS
from minisgl.gguf.stored import StoredWeight
from minisgl.kernel import cpu as cpu_kernels
from minisgl.kernel.cpu import layout
from minisgl.kernel.cpu.layout import Descriptor
from minisgl.models.llama import CPU_DECODE_STEP, LlamaAttention, LlamaMLP, declares
from minisgl.moe import SparseMoeBlock
from minisgl.utils import init_logger

if TYPE_CHECKING:
    from minisgl.core import Batch
    from minisgl.kvcache import KVPool

logger = init_logger(__name__)


class Unsupported(Exception):
    """Why the step does not cover this model or setting (the layers run instead)."""


def _linear_desc(module: torch.nn.Module, keep: list) -> Descriptor:
    """A linear layer's descriptor: its weight's parts (packed float32 panels or stored rows), its bias."""
    w, bias = module.weight, module.bias
    d = Descriptor(layout.LINEAR)
    if bias is not None:
        if bias.dtype != torch.float32:
            raise Unsupported("a bias not in float32")
        bias = bias.detach().contiguous()
        keep.append(bias)
        d["bias"] = bias.data_ptr()
    parts: list[Descriptor] = []
    if isinstance(w, StoredWeight):
        for p in w.parts:
            if not cpu_kernels.stored_type_supported(p.ggml_type) or p.data.stride(1) != 1:
                raise Unsupported(f"GGML type {p.ggml_type}")
            keep.append(p.data)
            part = Descriptor(layout.PART, kind=layout.PART_STORED, type=p.ggml_type, rows=p.n)
            part["data"], part["row_bytes"] = p.data.data_ptr(), p.data.stride(0)
            parts.append(part)
    else:
        if w.dtype != torch.float32:
            raise Unsupported(f"{w.dtype} weights")
        packed = kernel._cpu_packed_weight(w)  # the same panels kernel.linear multiplies by
        if packed is None:
            raise Unsupported("no packed float32 linear in this build")
        keep.append(packed)
        packed_part = Descriptor(layout.PART, kind=layout.PART_PACKED, rows=w.shape[0])
        packed_part["data"] = packed.data_ptr()
        parts.append(packed_part)
    room = layout.LINEAR.count("part")
    if len(parts) > room:
        raise Unsupported(f"a weight in {len(parts)} parts (the descriptor holds {room})")
    d["parts"] = len(parts)
    for i, part in enumerate(parts):
        d["part", i] = part
    return d


def _norm_ptr(norm: torch.nn.Module | None, keep: list) -> int:
    if norm is None:
        return 0
    w = norm.weight.detach()
    if w.dtype != torch.float32 or not w.is_contiguous():
        raise Unsupported("a norm weight not in contiguous float32")
    keep.append(w)
    return w.data_ptr()


def _sparse_fields(d: Descriptor, mlp: SparseMoeBlock, keep: list) -> None:
    """A sparse layer's fields of its descriptor: router, experts, top k, renormalize, the experts' C
    descriptors (GGUF experts as stored only) and their intermediate size."""
    experts = mlp.experts
    if experts.stored_desc is None:
        raise Unsupported("experts not stored as GGUF blocks")
    keep.append(experts.stored_desc)
    d["router"] = _linear_desc(SimpleNamespace(weight=mlp.gate.weight, bias=None), keep)
    d["experts"], d["top_k"], d["renormalize"] = experts.num_experts, mlp.top_k, int(mlp.renormalize)
    d["expert_desc"], d["expert_inter"] = experts.stored_desc.data_ptr(), experts.shard


def _layer_desc(layer: torch.nn.Module, kv_pool: KVPool, windows: tuple[int, ...], keep: list) -> Descriptor:
    sparse = isinstance(layer.mlp, SparseMoeBlock)
    if not declares(layer, CPU_DECODE_STEP):
        raise Unsupported(f"{type(layer).__name__} does not declare the C decode step")
    if not (sparse or type(layer.mlp) is LlamaMLP):
        raise Unsupported("an MLP other than Llama's")
    attn: LlamaAttention = layer.self_attn
    if attn.o_proj.tp_size != 1:
        raise Unsupported("tensor parallelism")
    lid = attn.attn.layer_id
    d = Descriptor(layout.LAYER, k_cache=kv_pool.k(lid).data_ptr(), v_cache=kv_pool.v(lid).data_ptr())
    d["input_norm"] = _norm_ptr(layer.input_layernorm, keep)
    d["post_norm"] = _norm_ptr(layer.post_attention_layernorm, keep)
    d["q_norm"], d["k_norm"] = _norm_ptr(attn.q_norm, keep), _norm_ptr(attn.k_norm, keep)
    d["qkv"], d["o"] = _linear_desc(attn.qkv_proj, keep), _linear_desc(attn.o_proj, keep)
    d["window"] = windows[lid] if windows else 0
    if sparse:
        _sparse_fields(d, layer.mlp, keep)
    else:
        d["gate_up"] = _linear_desc(layer.mlp.gate_up_proj, keep)
        d["down"] = _linear_desc(layer.mlp.down_proj, keep)
    return d


def _embed_fields(d: Descriptor, embed_tokens: torch.nn.Module, keep: list) -> None:
    """The model descriptor's embedding: GGUF rows as stored, or float32 rows."""
    embed = embed_tokens.weight
    if isinstance(embed, StoredWeight):
        if len(embed.parts) != 1 or not cpu_kernels.stored_type_supported(embed.parts[0].ggml_type):
            raise Unsupported("an embedding in several parts")
        p = embed.parts[0]
        d["embed_kind"], d["embed_type"] = layout.EMBED_STORED, p.ggml_type
        d["embed_data"], d["embed_row_bytes"] = p.data.data_ptr(), p.data.stride(0)
        keep.append(p.data)
    else:
        if embed.dtype != torch.float32 or embed_tokens.tp_size != 1:
            raise Unsupported("the embedding's dtype or sharding")
        d["embed_kind"] = layout.EMBED_F32
        d["embed_data"], d["embed_row_bytes"] = embed.data_ptr(), embed.stride(0) * 4


class CpuDecodeStep:
    """Runs a decode batch's layers in one C call; `create` returns None where the model is not covered."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_pool: KVPool,
        page_table: torch.Tensor,
        windows: tuple[int, ...] = (),
        int8: bool = False,
    ) -> None:
        cfg, inner = model.config, model.model
        self._keep: list = []  # every tensor whose address the descriptors hold
        layers = [_layer_desc(layer, kv_pool, windows, self._keep) for layer in inner.layers]
        attn0 = inner.layers[0].self_attn
        norm_eps = {m.eps for layer in inner.layers for m in layer.modules() if hasattr(m, "eps")}
        norm_eps.add(inner.norm.eps)
        if len(norm_eps) != 1:
            raise Unsupported("norms with different eps")
        self.eps, self.scale = norm_eps.pop(), attn0.attn.scale
        cos_sin = attn0.rotary.cos_sin_cache  # every layer's table is the same (one config)
        self._keep += [cos_sin, page_table]
        self.hidden = cfg.hidden_size
        self.qkv = (attn0.num_heads + 2 * attn0.num_kv_heads) * cfg.head_dim
        self.q = attn0.num_heads * cfg.head_dim
        dense = [layer.mlp for layer in inner.layers if not isinstance(layer.mlp, SparseMoeBlock)]
        sparse = [layer.mlp for layer in inner.layers if isinstance(layer.mlp, SparseMoeBlock)]
        self.inter = max((mlp.down_proj.input_shard for mlp in dense), default=0)
        # a sparse layer's scratch a token (floats, int64): router logits, routing, the experts' rows
        h = cfg.hidden_size
        self._moe = [  # int8: then room for the experts' rows quantized
            max((m.experts.num_experts + 2 * m.top_k + m.top_k * (2 * h + 3 * m.experts.shard)
                 + (m.top_k * cpu_kernels.q8_row_floats(max(h, m.experts.shard)) if int8 else 0)
                 for m in sparse), default=0),
            max((m.top_k for m in sparse), default=0),
            max((m.experts.num_experts + 1 for m in sparse), default=0),
        ]  # fmt: skip
        d = Descriptor(layout.MODEL, layers=len(layers), hidden=cfg.hidden_size, head_dim=cfg.head_dim)
        d["q_heads"], d["kv_heads"], d["inter"] = attn0.num_heads, attn0.num_kv_heads, self.inter
        d["rot"], d["cos_sin"] = cos_sin.shape[1], cos_sin.data_ptr()
        d["final_norm"] = _norm_ptr(inner.norm, self._keep)
        d["page_table"], d["page_table_stride"] = page_table.data_ptr(), page_table.stride(0)
        _embed_fields(d, inner.embed_tokens, self._keep)
        d["int8"] = int(int8)  # the sparse layers' scratch (moe_floats, moe_ints): set by run()
        # int8: room a row for the widest linear input quantized (groups of up to four blocks of 32)
        widest = max(self.hidden, self.q, self.inter)
        self._q8_row = cpu_kernels.q8_row_floats(widest) if int8 else 0
        self.model_desc = d.tensor()
        self.layers_desc = layout.stack(layers).reshape(-1)
        self._scratch = torch.empty(0)
        self._moe_scratch = (torch.empty(0), torch.empty(0, dtype=torch.int64))

    @classmethod
    def create(
        cls, model, kv_pool, page_table, attn_backend, dtype: torch.dtype, stored_dot: str = "exact"
    ) -> CpuDecodeStep | None:
        """The step for this model, or None (logged) where the layers must run instead."""
        try:
            if dtype != torch.float32 or not isinstance(attn_backend, CpuAttnBackend):
                raise Unsupported(f"{dtype} with {type(attn_backend).__name__}")
            if not cpu_kernels.decode_step_available():
                raise Unsupported("a build without AVX2")
            step = cls(model, kv_pool, page_table, attn_backend.config.windows, int8=stored_dot == "int8")
        except (Unsupported, AttributeError) as e:
            logger.info(f"CPU decode step off ({e or 'not a Llama-family model'}): layer by layer")
            return None
        kq = "/Q4_K/Q5_K/Q6_K" if cpu_kernels.int8_dot_supported(TYPE_IDS["Q4_K"]) else ""
        dot = f", int8 activations for Q4_0/Q4_1/Q8_0{kq} weights" if stored_dot == "int8" else ""
        logger.info(f"CPU decode step on: each decode batch's layers in one C call{dot}")
        return step

    def run(self, batch: Batch) -> torch.Tensor:
        """The final hidden states [B, hidden] of a decode batch whose inputs and metadata are prepared."""
        meta = batch.attn_metadata
        B, H = batch.size, self.hidden
        need = B * (3 * H + self.qkv + self.q + 3 * self.inter + self._q8_row)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        floats, k, ints = self._moe
        if floats and self._moe_scratch[0].numel() < B * floats:
            self._moe_scratch = (torch.empty(B * floats), torch.empty(B * k + ints, dtype=torch.int64))
            self.model_desc[layout.MODEL["moe_floats"]] = self._moe_scratch[0].data_ptr()
            self.model_desc[layout.MODEL["moe_ints"]] = self._moe_scratch[1].data_ptr()
        i64 = torch.int64
        tokens = (
            batch.input_ids.to(i64).contiguous(),
            batch.positions.to(i64).contiguous(),
            batch.out_loc.to(i64).contiguous(),
            meta.rows.contiguous(),
            meta.lens.contiguous(),
        )
        out = torch.empty(B, H, dtype=torch.float32)
        cpu_kernels.decode_step(
            self.model_desc, self.layers_desc, tokens, self._scratch, out, self.eps, self.scale
        )
        return out
