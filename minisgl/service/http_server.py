"""The HTTP side: uvicorn serving the OpenAI app on the launcher's listening socket, with a graceful stop
on SIGTERM, in the launcher (API server 0) and in the K-1 more API server processes of
--api-server-count K."""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Callable
from typing import Any

from minisgl.utils import init_logger

from .args import ServerArgs
from .processes import ServiceProcesses, child_init, exit_now

logger = init_logger(__name__, "launcher")


def run_api_server(
    args: ServerArgs, index: int, sock: socket.socket, max_seq_len: int, failed: Any, parent_pid: int
) -> None:
    """API server `index` (1..K-1) of --api-server-count K: the same app on the launcher's listening socket
    (the kernel hands each new connection to one of the K processes), for its own uids."""
    child_init(parent_pid)
    from .openai import create_app
    from .openai.tools import preload

    preload()
    app = create_app(args, max_seq_len, health=lambda: not failed.is_set(), index=index)
    try:
        # uvicorn handles SIGTERM (a graceful stop, as in the launcher) and SIGINT (at once) while it runs,
        # then raises them again: SIGINT is ignored here, SIGTERM unwinds
        graceful_server(args, app).run(sockets=[sock])
    except SystemExit:
        pass
    exit_now(0)


def graceful_server(args: ServerArgs, app: Any, on_drain: Callable[[], None] = lambda: None) -> Any:
    """uvicorn's server for `app` whose first SIGTERM first lets the running requests end
    (`app.state.stop_gracefully`, openai/draining.py; `on_drain` is told when that begins); a second one,
    or Ctrl-C, stops at once."""
    import uvicorn

    from .http_protocol import HeaderDeadlineProtocol

    class GracefulServer(uvicorn.Server):
        def __init__(self, config: uvicorn.Config) -> None:
            super().__init__(config)
            self.draining = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if sig != signal.SIGTERM or self.draining or self.should_exit:
                return super().handle_exit(sig, frame)
            try:
                loop = asyncio.get_running_loop()  # the handler runs on the loop's (main) thread
            except RuntimeError:
                return super().handle_exit(sig, frame)
            self.draining = True
            on_drain()
            self._captured_signals.append(sig)  # raised again once uvicorn has stopped
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

        async def _drain(self) -> None:
            try:
                await app.state.stop_gracefully()
            finally:
                self.should_exit = True

    return GracefulServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="info",
            access_log=False,
            timeout_graceful_shutdown=2,
            timeout_keep_alive=5,  # an idle keep-alive connection is closed (uvicorn's default, stated)
            # ... and one that never finishes its headers too
            http=HeaderDeadlineProtocol.with_timeout(args.request_timeout),
        )
    )


def serve_http(args: ServerArgs, service: ServiceProcesses, sock: socket.socket) -> int:
    import uvicorn  # noqa: F401 - imported while the workers load

    from .openai import create_app
    from .openai.tools import preload

    preload()

    ready = service.wait_ready()
    max_seq_len = int(ready.get("scheduler-0", {}).get("max_seq_len", 0))
    if args.api_server_count > 1:
        service.start_api_servers(run_api_server, sock, max_seq_len)
    app = create_app(args, max_seq_len, health=service.all_alive)
    server = graceful_server(args, app, on_drain=service.begin_drain)

    def on_death(problem: str) -> None:
        logger.error(f"{problem}; shutting the service down")
        server.should_exit = True

    service.watch(on_death)
    servers = f" ({args.api_server_count} API server processes)" if args.api_server_count > 1 else ""
    logger.info(
        f"Serving {args.served_model_name} (context {max_seq_len}) on http://{args.host}:{args.port}/v1"
        + servers
    )
    # a SIGTERM drains the requests first (GracefulServer); then uvicorn shuts down and raises the signal
    # again: it lands in `launch` as KeyboardInterrupt / StopRequested
    try:
        server.run(sockets=[sock])
    except OSError as e:  # listen() failed: another server bound the port while the model loaded
        logger.error(f"cannot listen on {args.host}:{args.port}: {e}; stop the other server or use --port")
        return 1
    return 1 if service.failure else 0
