"""The options of `python -m minisgl` (the service's fields on top of SchedulerConfig's) and the addresses the
service's processes talk over."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils import options
from minisgl.utils.options import OptionError, option

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded default model


@dataclass
class ServerArgs(SchedulerConfig):
    """Every option of the service: the scheduler's and the engine's (inherited) plus the service's own."""

    served_model_name: str = option(
        "",
        help="the model name /v1/models reports; several comma-separated names are aliases a request may "
        f"use, the first is the one reported (default: --model as given, or {DEFAULT_MODEL_NAME})",
    )
    api_key: str = option(
        "",
        help="clients must send `Authorization: Bearer <key>` on every endpoint but /health "
        "(default: $MINISGL_API_KEY; empty: no check)",
        metavar="KEY",
    )
    host: str = option("127.0.0.1", help="the HTTP server's address")
    allowed_hosts: str = option(
        "",
        help="without --api-key, the Host names (comma-separated; * for any) accepted besides loopback "
        "names and the --host address (any IP address and this machine's name when --host is 0.0.0.0); "
        "others get 403: a web page that re-points its own name at this server cannot use it",
        metavar="NAMES",
    )
    allowed_origins: str = option(
        "",
        help="without --api-key, the web pages (comma-separated origins such as https://app.example; * "
        "for any) that may call this server besides its own and this machine's; others get 403",
        metavar="ORIGINS",
    )
    port: int = option(1919, help="the HTTP server's port", min=1, max=65535)
    num_tokenizer: int = option(
        0, help="0: one process tokenizes and detokenizes; N: N tokenizers + 1 detokenizer", min=0
    )
    api_server_count: int = option(
        1,
        help="API server processes sharing the HTTP port (vLLM's option): more when one process's CPU is "
        "the limit, as with hundreds of streams on a GPU; /metrics sums over them",
        min=1,
    )
    stream_interval: int = option(
        1,
        help="a stream sends a request's new text with its first token, then every N tokens and at its "
        "end (SGLang's option): fewer, larger chunks for many streams",
        min=1,
    )
    allow_special_tokens_in_content: bool = option(
        False,
        help="the model's special tokens (<|im_start|>, ...) typed in a user's or a tool's message content "
        "are its control tokens, not text: a user could then write turns of other roles",
    )
    max_request_bytes: int = option(8 << 20, help="larger request bodies get HTTP 400", min=1)
    max_sequences_per_request: int = option(
        256, help="the most sequences (prompts x n) one request may ask for; more get HTTP 400", min=1
    )
    max_waiting_requests: int = option(
        1024,
        help="sequences that may wait beyond the --max-running-req that run; more get HTTP 429",
        min=0,
    )
    request_timeout: float = option(
        30.0,
        help="seconds a client has to send a request's headers (else the connection is closed) and its "
        "whole body (else HTTP 408); an idle keep-alive connection is closed after 5 s",
        min=0.1,
    )
    shutdown_timeout: float = option(
        30.0,
        help="on SIGTERM: seconds the running requests have to finish (new ones get 503) before they are "
        "ended (streams get a final chunk and [DONE]) and the service stops",
        min=0,
    )
    tool_call_parser: str = option(
        "auto",
        help="how the model writes tool calls (rendered for its chat template, parsed from its output): "
        "hermes (= qwen25, qwen3: <tool_call> JSON), llama3 (= llama3_json); auto: found from the chat "
        "template (a ChatML template without tool support gets hermes)",
        choices=["auto", "hermes", "qwen25", "qwen3", "llama3", "llama3_json"],
    )
    reasoning_parser: str = option(
        "auto",
        help="how the model marks its reasoning (sent as `reasoning_content`, apart from the answer): qwen3, "
        "deepseek-r1 (its output starts in the reasoning); auto: qwen3's where the chat template writes "
        "<think>; none: no parsing",
        choices=["auto", "none", "qwen3", "deepseek-r1"],
    )
    shell: bool = option(False, help="chat in the terminal instead of serving HTTP")
    dp_size: int = option(
        1,
        help="N > 1: N replicas of the service on this machine (ports --port+1..--port+N; one GPU per "
        "--tp-size GPUs each, or an Nth of the CPU cores) behind SGLang's cache-aware router on --port",
        min=1,
        aliases=["dp"],
    )
    router_args: str = option(
        "",
        help="with --dp: more options for `python -m sglang_router.launch_router`, in one quoted string "
        '(e.g. "--balance-abs-threshold 8" to spread a shared-prefix workload sooner)',
        metavar="ARGS",
    )
    ipc_dir: str = ""  # the launcher's private directory for the ZMQ sockets

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.served_model_name.strip(", "):
            self.served_model_name = self.model_path.rstrip("/") if self.model_path else DEFAULT_MODEL_NAME
        if not self.api_key:  # read here, not at import: a launcher may set it after importing minisgl
            self.api_key = os.environ.get("MINISGL_API_KEY", "")
        if self.dp_size > 1 and (self.shell or self.nnodes > 1):
            why = "--shell" if self.shell else "--nnodes > 1 (run the router in front of each node's service)"
            raise OptionError("dp_size", f"must be 1 with {why}")
        if self.api_server_count > 1 and self.shell:
            raise OptionError("api_server_count", "must be 1 with --shell (no HTTP server)")
        if self.dp_size > 1 and self.port + self.dp_size > 65535:
            raise OptionError("dp_size", f"the replicas' ports {self.port}+1..+{self.dp_size} pass 65535")

    @property
    def model_names(self) -> list[str]:
        """Every name a request's `model` may use (--served-model-name split at commas); the first is the
        one replies and /v1/models report."""
        return list(dict.fromkeys(n.strip() for n in self.served_model_name.split(",") if n.strip()))

    @property
    def model_name(self) -> str:
        """The name replies report."""
        return self.model_names[0]

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The TP ranks this node runs (rank = node_rank * ranks_per_node + local GPU index)."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)

    # ---- where each process listens (ipc sockets in `ipc_dir`) -----------------------------------
    def _addr(self, name: str) -> str:
        assert self.ipc_dir, "the launcher sets ipc_dir"
        return "ipc://" + os.path.join(self.ipc_dir, name)

    @property
    def frontend_addr(self) -> str:  # API server 0's PULL: replies from the detokenizer
        return self._addr("frontend")

    @property
    def frontend_addrs(self) -> list[str]:
        """Each API server's PULL; a reply goes to the one whose index is its uid modulo the count."""
        return [self.frontend_addr] + [self._addr(f"frontend-{i}") for i in range(1, self.api_server_count)]

    @property
    def tokenizer_addrs(self) -> list[str]:  # each of the N tokenizers' PULL (N > 0)
        return [self._addr(f"tokenizer-{i}") for i in range(self.num_tokenizer)]

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
    def request_addrs(self) -> list[str]:
        """Where an API server sends requests: every tokenizer (ZMQ spreads them in turn), or the one worker
        that does both."""
        return self.tokenizer_addrs if self.num_tokenizer > 0 else [self.detokenizer_addr]


def build_parser() -> argparse.ArgumentParser:
    """The parser of `python -m minisgl`: one flag per option of ServerArgs."""
    p = argparse.ArgumentParser(
        prog="python -m minisgl",
        description="Serve a model over an OpenAI-compatible HTTP API "
        "(or chat with it in the terminal with --shell).",
    )
    options.add_flags(p, ServerArgs)
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """ServerArgs from the command line; a bad value exits naming its flag."""
    parser = build_parser()
    given = options.given(parser.parse_args(argv), ServerArgs)
    if given.get("shell"):
        given.setdefault("max_running_req", 1)  # one user in the shell
    return options.build(ServerArgs, given, parser)
