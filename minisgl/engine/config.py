"""EngineConfig: everything the Engine needs to build the model, the KV pool and the backends.

The root of the option chain `EngineConfig <- SchedulerConfig <- ServerArgs`: each option is one field here
or in a subclass, and `python -m minisgl`'s flags, `LLM(**kw)` and the benchmark CLIs are derived from the
fields (minisgl/utils/options.py). Adding an option means adding one field and using it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.attention import KV_CACHE_DTYPES, check_attn_name, kv_dtype_problem
from minisgl.distributed import DistributedInfo
from minisgl.gguf.stored import STORED_DOTS
from minisgl.utils.options import OptionError, check, option

_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(name: str) -> torch.dtype | None:
    return _DTYPES[name]


@dataclass
class EngineConfig:
    """The engine's options (model, precision, KV pool, graphs) and the rank it runs as."""

    model_path: str | None = option(
        None,
        help="a Hugging Face model directory, a hub id or a .gguf file (default: the embedded model)",
        aliases=["model"],
        metavar="PATH",
    )
    dtype: torch.dtype | None = option(  # noqa: RUF009 (an option field, like dataclasses.field)
        None,
        help="auto (the default): float32 on a CPU, the checkpoint's dtype (or bfloat16) on a GPU",
        choices=list(_DTYPES),
        parse=_dtype,
    )
    device: str | None = option(None, help="cpu, cuda, cuda:1, ... (default: cuda when available, else cpu)")
    attn: str = option("auto", help="attention backend (auto, torch, triton, ...; or prefill,decode)")
    load_format: str = option(
        "auto", help="dummy: random weights with the real shapes", choices=["auto", "safetensors", "dummy"]
    )
    page_size: int = option(1, help="tokens per KV page", min=1)
    kv_cache_dtype: str = option(
        "auto",
        help="auto: K/V stored in the model's dtype (float32 under the cpu attention backend); fp8_e4m3: "
        "one byte a value (no scale; half of bf16's bytes, approximate), with the triton or torch backend",
        choices=list(KV_CACHE_DTYPES),
    )
    num_pages: int | None = option(
        None, help="KV pool size in pages (default: from memory)", min=1, aliases=["num_page_override"]
    )
    max_seq_len_override: int | None = option(
        None,
        help="context length (default: the model's max_position_embeddings)",
        min=1,
        aliases=["max_seq_len"],
    )
    max_running_req: int = option(
        256,
        help="request slots, the most requests running at once (default 256; 1 with --shell)",
        min=1,
        aliases=["max_running_requests"],
    )
    max_prefill_length: int = option(
        8192, help="token budget of one prefill step; longer prompts are chunked", min=1
    )
    cuda_graph_max_bs: int | None = option(
        None, help="largest captured decode batch (default: automatic); 0: off", min=0
    )
    cuda_graph_max_prefill: int | None = option(
        None,
        help="largest captured prefill step in tokens (default: min(8192, --max-prefill-length) on a GPU "
        "while decode graphs are on); 0: off",
        min=0,
    )
    mem_fraction: float = option(
        0.88, help="of total device memory the engine may use (weights + KV + graphs)"
    )
    cpu_kv_cache_bytes: int = option(1 << 30, help="KV pool size on a CPU when --num-pages is not given")
    show_progress: bool = option(True, help="log weight loading and graph capture progress")
    seed: int = option(0, help="torch's seed at start-up (dummy weights, unseeded sampling)")
    moe_backend: str = option(
        "auto",
        help="MoE experts: fused (Triton), torch (the reference) or auto (fused on CUDA, torch elsewhere)",
        choices=["auto", "fused", "torch"],
    )
    sampler: str = option(
        "auto",
        help="fused: one sampling kernel for the batch (Triton on a GPU), captured in the decode graphs; "
        "torch: its torch reference, after the graph (auto: fused on CUDA, torch elsewhere)",
        choices=["auto", "fused", "torch"],
    )
    pooling: str = option(
        "auto",
        help="how an embedding pools the prompt's final hidden states: last (token), mean, cls (the first "
        "token); auto: what the model's sentence-transformers config names, else last",
        choices=["auto", "last", "mean", "cls"],
    )
    ep_size: int = option(
        1, help="expert parallelism: MoE experts split over this many of the TP ranks", min=1, aliases=["ep"]
    )
    tp_size: int = option(1, help="tensor-parallel ranks in all (one process each)", min=1, aliases=["tp"])
    nnodes: int = option(1, help="machines the ranks are spread over, --tp-size / --nnodes each", min=1)
    node_rank: int = option(0, help="this machine's index; node 0 serves HTTP", min=0)
    dist_init_addr: str = option(
        "",
        help="node 0's HOST:PORT that every rank joins at (default: a free local port)",
        metavar="HOST:PORT",
    )
    dist_timeout: float = option(
        120.0, help="seconds to wait for every rank to join, and for one collective", min=0.1
    )
    cpu_decode_step: str = option(
        "auto",
        help="auto: a decode batch's layers run in one C call on a CPU where the model is covered (dense "
        "Llama-family, float32, one rank); off: layer by layer",
        choices=["auto", "off"],
    )
    stored_dot: str = option(
        "exact",
        help="exact: float32 activations times each block dequantized with the reference arithmetic; "
        "int8: for Q4_0/Q4_1/Q8_0 weights as stored, activations quantized to 8-bit blocks of 32 "
        "(llama.cpp's arithmetic) in prefill and decode (the CPU decode step, its LM head, the layers): "
        "faster, approximate",
        choices=list(STORED_DOTS),
    )
    weights_format: str = option(
        "auto",
        help="stored: a .gguf file's blocks (or bf16/fp16 weights) kept as they are on a CPU; float32: "
        "converted (auto: stored for a .gguf on a CPU)",
        choices=["auto", "stored", "float32"],
    )
    # set per process by the launcher (or LLM), not options
    tp_rank: int = 0
    dist_init_method: str = "tcp://127.0.0.1:29517"

    @property
    def tp_info(self) -> DistributedInfo:
        """This process's rank in the tensor-parallel group."""
        return DistributedInfo(self.tp_rank, self.tp_size, self.ep_size)

    def __post_init__(self) -> None:
        check(self)  # every option of the chain, the subclasses' too
        check_parallel(self)
        try:  # a registry name, refused here so that a typo fails before any model work
            check_attn_name(self.attn)
        except ValueError as e:
            raise OptionError("attn", str(e)) from None
        named = [n.strip() for n in self.attn.split(",") if n.strip() != "auto"]  # auto: when resolved
        problem = kv_dtype_problem(self.kv_cache_dtype, named)
        if problem is not None:
            raise OptionError("kv_cache_dtype", problem)


def check_parallel(c: EngineConfig) -> None:
    """Refuse a TP layout the nodes cannot hold (OptionError naming the field)."""
    if c.tp_size % c.nnodes:
        raise OptionError("tp_size", f"must be a multiple of --nnodes {c.nnodes}, got {c.tp_size}")
    if c.node_rank >= c.nnodes:
        raise OptionError("node_rank", f"must be < --nnodes {c.nnodes}, got {c.node_rank}")
    if c.nnodes > 1 and not c.dist_init_addr:
        raise OptionError("dist_init_addr", "is needed with --nnodes > 1 (node 0's HOST:PORT)")
    if c.dist_init_addr:
        host, _, port = c.dist_init_addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise OptionError("dist_init_addr", f"must be HOST:PORT, got {c.dist_init_addr!r}")
