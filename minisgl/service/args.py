"""Command-line arguments of `python -m minisgl` and the addresses the service's processes talk over."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded default model


@dataclass
class ServerArgs:
    model: str | None = None  # HF dir, hub id or .gguf file; None: the embedded default model
    model_path: str = ""  # `model` resolved to a local HF directory, once, by the launcher
    served_model_name: str = ""
    host: str = "127.0.0.1"
    port: int = 1919
    dtype: str = "auto"
    tp: int = 1
    attn: str = "auto"
    cache: str = "radix"
    page_size: int = 1
    max_prefill_length: int = 8192
    num_pages: int | None = None
    max_seq_len_override: int | None = None
    max_running_requests: int = 256
    num_tokenizer: int = 0
    cuda_graph_max_bs: int | None = None
    cuda_graph_max_prefill: int | None = None
    load_format: str = "auto"
    shell: bool = False
    max_request_bytes: int = 8 << 20
    ipc_dir: str = ""  # the launcher's private directory for the ZMQ sockets
    dist_init_method: str = "tcp://127.0.0.1:29517"

    # ---- where each process listens (ipc sockets in `ipc_dir`) -----------------------------------
    def _addr(self, name: str) -> str:
        assert self.ipc_dir, "the launcher sets ipc_dir"
        return "ipc://" + os.path.join(self.ipc_dir, name)

    @property
    def frontend_addr(self) -> str:  # API server PULL: replies from the detokenizer
        return self._addr("frontend")

    @property
    def tokenizer_addr(self) -> str:  # API server PUSH -> the N tokenizers (N > 0)
        return self._addr("tokenizer")

    @property
    def detokenizer_addr(self) -> str:  # the detokenizer (or the single tokenizer worker) PULL
        return self._addr("detokenizer")

    @property
    def backend_addr(self) -> str:  # scheduler rank 0 PULL
        return self._addr("backend")

    @property
    def broadcast_addr(self) -> str:  # scheduler rank 0 PUB -> the other ranks
        return self._addr("broadcast")

    @property
    def request_addr(self) -> str:
        """Where the API server sends requests: the tokenizers, or the one worker that does both."""
        return self.tokenizer_addr if self.num_tokenizer > 0 else self.detokenizer_addr


def _positive(name: str, value: int | None, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise SystemExit(f"error: --{name} must be >= {minimum}, got {value}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minisgl",
        description="Serve a model over an OpenAI-compatible HTTP API "
        "(or chat with it in the terminal with --shell).",
    )
    p.add_argument(
        "--model",
        default=None,
        help="a Hugging Face model directory, a hub id or a .gguf file "
        f"(default: the embedded {DEFAULT_MODEL_NAME})",
    )
    p.add_argument("--served-model-name", default=None, help="the model name /v1/models reports")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=1919)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: float32 on a CPU, the checkpoint's dtype (or bfloat16) on a GPU",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (one scheduler process per rank)")
    p.add_argument("--attn", default="auto", help="attention backend (auto, torch, triton, ...)")
    p.add_argument("--cache", default="radix", help="prefix cache: radix or naive")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument(
        "--max-prefill-length",
        type=int,
        default=8192,
        help="token budget of one prefill step; longer prompts are chunked",
    )
    p.add_argument("--num-pages", type=int, default=None, help="KV pool size in pages (default: from memory)")
    p.add_argument(
        "--max-seq-len-override",
        type=int,
        default=None,
        help="context length (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--max-running-requests", type=int, default=None, help="request slots (default 256; 1 with --shell)"
    )
    p.add_argument(
        "--num-tokenizer",
        type=int,
        default=0,
        help="0: one process tokenizes and detokenizes; N: N tokenizers + 1 detokenizer",
    )
    p.add_argument(
        "--cuda-graph-max-bs", type=int, default=None, help="largest captured decode batch; 0: off"
    )
    p.add_argument(
        "--cuda-graph-max-prefill",
        type=int,
        default=None,
        help="largest captured prefill step in tokens (default: min(8192, --max-prefill-length) on a GPU "
        "while decode graphs are on); 0: off",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "dummy"],
        help="dummy: random weights with the real shapes",
    )
    p.add_argument(
        "--max-request-bytes", type=int, default=8 << 20, help="larger request bodies get HTTP 400"
    )
    p.add_argument("--shell", action="store_true", help="chat in the terminal instead of serving HTTP")
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    ns = build_parser().parse_args(argv)
    for name in (
        "tp",
        "page_size",
        "max_prefill_length",
        "num_pages",
        "max_seq_len_override",
        "max_running_requests",
        "max_request_bytes",
    ):
        _positive(name.replace("_", "-"), getattr(ns, name))
    _positive("num-tokenizer", ns.num_tokenizer, 0)
    _positive("cuda-graph-max-bs", ns.cuda_graph_max_bs, 0)
    _positive("cuda-graph-max-prefill", ns.cuda_graph_max_prefill, 0)
    if not 0 < ns.port < 65536:
        raise SystemExit(f"error: --port must be in 1..65535, got {ns.port}")
    running = ns.max_running_requests or (1 if ns.shell else 256)  # one user in the shell
    name = ns.served_model_name or (ns.model.rstrip("/") if ns.model else DEFAULT_MODEL_NAME)
    return ServerArgs(
        model=ns.model,
        served_model_name=name,
        host=ns.host,
        port=ns.port,
        dtype=ns.dtype,
        tp=ns.tp,
        attn=ns.attn,
        cache=ns.cache,
        page_size=ns.page_size,
        max_prefill_length=ns.max_prefill_length,
        num_pages=ns.num_pages,
        max_seq_len_override=ns.max_seq_len_override,
        max_running_requests=running,
        num_tokenizer=ns.num_tokenizer,
        cuda_graph_max_bs=ns.cuda_graph_max_bs,
        cuda_graph_max_prefill=ns.cuda_graph_max_prefill,
        load_format=ns.load_format,
        shell=ns.shell,
        max_request_bytes=ns.max_request_bytes,
    )
