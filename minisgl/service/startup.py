"""What the launcher checks before any worker starts, and the signals it stops on: the HTTP port (bound at
once, so a busy one fails before any model work), the model's path and architecture, and a SIGTERM that
unwinds the launcher like Ctrl-C. Shared by the one-service launcher (launch.py) and the replicas'
launcher (dp.py)."""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import replace
from typing import Any

from .args import ServerArgs


class StopRequested(BaseException):
    """SIGTERM in the launcher: unwinds like Ctrl-C's KeyboardInterrupt into the cleanup of `launch`."""


def on_launcher_sigterm(signum: int, frame: Any) -> None:
    raise StopRequested


class StartupError(Exception):
    """A problem found before any worker starts: the launcher logs the message and exits with `code`."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def bind_port(host: str, port: int) -> socket.socket:
    """The HTTP port, bound before any model work so that a busy one fails at once; uvicorn listens on
    it once the workers are ready (until then a client is refused, not left hanging)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # the protocol named: asyncio sets TCP_NODELAY only on accepted sockets whose protocol is TCP, and an
    # accepted socket takes the listener's. Without it Nagle's algorithm held a reply's body back until the
    # client's delayed ACK, 40 ms on every request of a kept-alive connection (and on every SSE chunk).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # as uvicorn does: a port whose old connections linger in TIME_WAIT is free (one that is listening
    # is still refused)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            fix = f"another server is using port {port}: stop it or choose another port with --port"
        else:
            fix = "check --host and --port"
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror or e}; {fix}", code=1) from None
    sock.set_inheritable(False)
    return sock


def check_model(model_dir: str, tp_size: int = 1, ep_size: int = 1) -> None:
    """Refuse an architecture no model class implements, or a TP (EP) size its heads (experts) cannot be
    split by, from config.json alone (before any worker starts)."""
    import json
    from types import SimpleNamespace

    from minisgl.models import MODELS, ModelConfig

    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return  # the engine's own loading reports a missing or broken config
    archs = hf.get("architectures") or []
    unknown = [a for a in archs[:1] if a not in MODELS]
    if unknown:
        raise StartupError(
            f"{model_dir}: unsupported model architecture {unknown[0]!r}; "
            f"supported: {', '.join(MODELS.names())}"
        )
    try:
        model_config = ModelConfig.from_hf(SimpleNamespace(**hf))
    except (AttributeError, TypeError):
        return  # a config.json of another shape (e.g. nested): the engine checks once it has loaded it
    try:
        model_config.check_tp(tp_size, ep_size)
    except ValueError as e:
        raise StartupError(f"{model_dir}: {e}") from None


def prepare(args: ServerArgs) -> tuple[ServerArgs, socket.socket | None]:
    """Everything checked before a worker starts: the port first (instant), then the model (a .gguf is
    converted here, once)."""
    from minisgl.models.resolve import resolve_model_path

    sock = None if args.shell or args.node_rank > 0 else bind_port(args.host, args.port)
    try:
        try:
            args = replace(args, model_path=resolve_model_path(args.model_path, args.weights_format))
        except ValueError as e:  # a path that does not exist, a hub id that does not resolve
            raise StartupError(str(e)) from None
        check_model(args.model_path, args.tp_size, args.ep_size)
    except BaseException:  # Ctrl-C during a conversion too
        if sock is not None:
            sock.close()
        raise
    return args, sock
