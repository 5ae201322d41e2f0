"""EngineConfig: everything the Engine needs to build the model, the KV pool and the backends."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minisgl.distributed import DistributedInfo


@dataclass
class EngineConfig:
    model_path: str | None = None  # HF dir, hub id, .gguf file; None: the embedded default model
    dtype: torch.dtype | None = None  # None: float32 on a CPU, the checkpoint's dtype (or bf16) on a GPU
    device: str | None = None  # None: cuda when available, else cpu
    tp_info: DistributedInfo = field(default_factory=DistributedInfo)
    dist_init_method: str = "tcp://127.0.0.1:29517"
    max_running_req: int = 256
    page_size: int = 1
    num_pages: int | None = None  # None: sized from memory
    max_seq_len: int | None = None  # None: the model's max_position_embeddings
    attn: str = "auto"
    load_format: str = "auto"  # auto (safetensors) | dummy (random weights, real shapes)
    cuda_graph_max_bs: int | None = None  # None: automatic; 0 disables CUDA graphs
    cuda_graph_max_prefill: int | None = None  # tokens; None: automatic (GPU, decode graphs on); 0: off
    max_prefill_length: int = 8192  # the scheduler's token budget of a prefill step (set by the scheduler)
    mem_fraction: float = 0.88  # of total device memory the engine may use (weights + KV + graphs)
    cpu_kv_cache_bytes: int = 1 << 30  # KV pool size on a CPU when num_pages is not given
    show_progress: bool = True
    seed: int = 0
