"""The launcher: check the options and the port, resolve the model once, spawn the workers, wait until each
is ready, then serve.

Processes: this one (API server or shell), one scheduler per TP rank, and the tokenizer side (one worker
doing both with --num-tokenizer 0, else N tokenizers + 1 detokenizer). With --nnodes N the same command
runs on every node with its --node-rank: node 0 runs all of the above for its ranks, another node only its
--tp-size / N scheduler ranks (and no HTTP port); that node's launcher exits when rank 0 stops. Workers are started with `spawn`
(CUDA, threads and ZMQ contexts do not survive a fork), ignore Ctrl-C (the launcher stops them) and die
with the launcher (PR_SET_PDEATHSIG). A worker that dies takes the whole service down with a message.

Before any model work: the options (argparse, exit 2), the HTTP port (bound here and handed to uvicorn,
exit 1 when busy), the model path and architecture (exit 2). SIGTERM and Ctrl-C stop the service quietly:
uvicorn shuts down, every worker unwinds on a SIGTERM, exit status 0. A dead worker: exit status 1.
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import errno
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NoReturn

from minisgl.utils import init_logger
from minisgl.utils.net import free_port

from .args import ServerArgs, parse_args

logger = init_logger(__name__, "launcher")
IMPORT_TICK_S = 5.0  # the longest the launcher stays silent while its workers import


class WorkerDied(RuntimeError):
    """A worker process exited (or reported a startup error) while the service needed it."""


# ---- inside the worker processes ---------------------------------------------------------------------
def _child_init(parent_pid: int) -> None:
    # SIGINT is already ignored since the exec (the launcher ignores it while it starts us), so a Ctrl-C
    # during the imports prints no KeyboardInterrupt; the launcher stops us with a SIGTERM, which unwinds
    # the worker: its queues close and its finalizers run
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:  # die with the launcher, even if it is SIGKILLed
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        os._exit(1)
    # tqdm's default lock is a multiprocessing semaphore, useless under spawn; a worker that is killed
    # before it unlinks it makes the resource tracker report it as leaked when the service exits
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def _scheduler_config(args: ServerArgs, rank: int) -> ServerArgs:
    from minisgl.utils.hf import load_tokenizer

    eos: list[int] = []
    if any(
        os.path.exists(os.path.join(args.model_path, f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        eos_id = load_tokenizer(args.model_path).eos_token_id  # e.g. <|im_end|> ends a chat turn
        eos = [int(eos_id)] if eos_id is not None else []
    # ServerArgs is a SchedulerConfig: only what differs per rank is filled in here
    return replace(
        args,
        tp_rank=rank,
        show_progress=args.show_progress and rank == 0,
        extra_eos_token_ids=eos,
    )


def _start_scheduler(args: ServerArgs, rank: int, ack_queue: Any, name: str) -> Any:
    """Build rank `rank`'s scheduler and its queues, then report ready (or the error) to the launcher."""
    try:
        from minisgl.scheduler import Scheduler

        from .scheduler_io import SchedulerIO

        scheduler = Scheduler(_scheduler_config(args, rank))
        io = SchedulerIO(
            scheduler,
            args.backend_addr,
            args.detokenizer_addr,
            args.broadcast_addr,
            rank,
            args.tp_size,
            tcp_host=args.dist_init_addr.rpartition(":")[0] if args.nnodes > 1 else None,
            same_node=rank < args.ranks_per_node,
            silence_timeout=args.dist_timeout,
        )
        io.wait_for_ranks(args.dist_timeout)  # rank 0: every other rank has subscribed
    except SystemExit:  # stopped by the launcher
        raise
    except BaseException as e:
        ack_queue.put((name, {"error": f"{type(e).__name__}: {e}"}))
        raise
    ack_queue.put((name, {"max_seq_len": scheduler.max_seq_len}))
    return io


def _run_scheduler(args: ServerArgs, rank: int, ack_queue: Any, parent_pid: int) -> None:
    _child_init(parent_pid)
    name = f"scheduler-{rank}"
    ack_queue.put((name, {"stage": "imported"}))  # torch came with the arguments' classes
    try:
        io = _start_scheduler(args, rank, ack_queue, name)
        try:
            io.run_forever()
        finally:
            io.stop()
    except SystemExit as e:
        init_logger(__name__, name).info(f"{name} stopping")
        _exit_now(e.code)


def _run_tokenizer(kwargs: dict[str, Any], ack_queue: Any, parent_pid: int) -> None:
    _child_init(parent_pid)
    from .tokenizer_worker import tokenize_worker

    name = kwargs["worker_name"]
    ack_queue.put((name, {"stage": "imported"}))
    try:
        tokenize_worker(ack_queue=ack_queue, **kwargs)
    except SystemExit as e:  # stopped by the launcher (the worker closed its queues on the way out)
        init_logger(__name__, name).info(f"{name} stopping")
        _exit_now(e.code)
    except BaseException as e:
        ack_queue.put((name, {"error": f"{type(e).__name__}: {e}"}))
        raise


def _exit_now(code: Any) -> NoReturn:
    """End a stopped worker without the interpreter's teardown, whose last garbage collection walks every
    object torch and transformers made: seconds on a busy machine, past the launcher's stop timeout. The
    worker's queues are closed already; the exit handlers (logging's flush, multiprocessing's finalizers)
    still run."""
    atexit._run_exitfuncs()  # what a normal exit runs first; the interpreter's own teardown is skipped
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)


# ---- in the launcher ---------------------------------------------------------------------------------
def _tokenizer_workers(a: ServerArgs) -> list[dict[str, Any]]:
    """The keyword arguments of each tokenizer-side worker (one doing both, or N tokenizers + 1 detokenizer)."""
    common = {
        "tokenizer_path": a.model_path,
        "backend_addr": a.backend_addr,
        "allow_special_tokens_in_content": a.allow_special_tokens_in_content,
    }

    def worker(role: str, name: str, **addrs: Any) -> dict[str, Any]:
        return dict(common, role=role, worker_name=name, **addrs)

    # the worker that detokenizes binds the detokenizer address and answers the API server
    replies = {"recv_addr": a.detokenizer_addr, "recv_create": True, "frontend_addr": a.frontend_addr}
    replies["stream_interval"] = a.stream_interval
    if a.num_tokenizer == 0:
        return [worker("both", "tokenizer", **replies)]
    tokenizers = [
        worker(
            "tokenizer",
            f"tokenizer-{i}",
            recv_addr=a.tokenizer_addr,
            recv_create=False,
            detokenizer_addr=a.detokenizer_addr,
        )
        for i in range(a.num_tokenizer)
    ]
    return [worker("detokenizer", "detokenizer", **replies), *tokenizers]


class ServiceProcesses:
    """The worker processes: start, wait for their ready messages, watch them, stop them."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.ctx = mp.get_context("spawn")
        self.ack_queue = self.ctx.Queue()
        self.procs: list[Any] = []
        self.stopping = False
        self.failure: str | None = None

    def start(self) -> None:
        a, pid = self.args, os.getpid()
        for rank in a.node_ranks:
            self.procs.append(
                self.ctx.Process(
                    target=_run_scheduler,
                    args=(a, rank, self.ack_queue, pid),
                    name=f"minisgl-scheduler-{rank}",
                )
            )
        for kw in _tokenizer_workers(a) if a.node_rank == 0 else []:
            self.procs.append(
                self.ctx.Process(
                    target=_run_tokenizer, args=(kw, self.ack_queue, pid), name=f"minisgl-{kw['worker_name']}"
                )
            )
        # a spawned worker inherits an ignored SIGINT through the exec, so a Ctrl-C during its imports
        # (before _child_init) does not print a KeyboardInterrupt traceback
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for p in self.procs:
                p.start()
        finally:
            signal.signal(signal.SIGINT, previous)
        names = ", ".join(f"{p.name} (pid {p.pid})" for p in self.procs)
        logger.info(f"Started {len(self.procs)} worker processes: {names}")
        logger.info(
            f"Loading {self.args.model_path}: the workers import torch, then the scheduler builds the model"
        )

    def _errors(self) -> list[str]:
        out = []
        while True:
            try:
                name, info = self.ack_queue.get_nowait()
            except (queue.Empty, OSError, ValueError):  # nothing waiting, or the queue is already closed
                return out
            if "error" in info:
                out.append(f"{name}: {info['error']}")

    def dead(self) -> str | None:
        """A description of the first dead worker (with the error it reported, if any), or None."""
        for p in self.procs:
            if not p.is_alive():
                errors = self._errors()
                why = f" ({'; '.join(errors)})" if errors else " (see its traceback above)"
                return f"worker process {p.name} (pid {p.pid}) exited with code {p.exitcode}{why}"
        return None

    def all_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def wait_ready(self) -> dict[str, dict[str, Any]]:
        """Block until every worker reported ready; raise WorkerDied if one failed instead. While the
        workers import torch (silent, seconds on a busy machine) a line every IMPORT_TICK_S says so."""
        ready: dict[str, dict[str, Any]] = {}
        imported: set[str] = set()
        start = last = time.monotonic()
        while len(ready) < len(self.procs):
            try:
                name, info = self.ack_queue.get(timeout=0.5)
            except queue.Empty:  # check that nobody died meanwhile
                problem = self.dead()
                if problem:
                    raise WorkerDied(problem) from None
                if len(imported) < len(self.procs) and time.monotonic() - last >= IMPORT_TICK_S:
                    logger.info(f"The workers are still importing torch ({time.monotonic() - start:.0f} s)")
                    last = time.monotonic()
                continue
            if info.get("stage") == "imported":
                imported.add(name)
                continue
            if "error" in info:
                raise WorkerDied(f"{name} failed to start: {info['error']}")
            ready[name] = info
            logger.info(f"{name} is ready")
        return ready

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call `on_death(message)` (from a thread) if a worker dies while the service runs."""

        def loop() -> None:
            while not self.stopping:
                problem = self.dead()
                if problem and not self.stopping:
                    self.failure = problem
                    on_death(problem)
                    return
                time.sleep(0.5)

        threading.Thread(target=loop, name="minisgl-watchdog", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every worker, SIGKILL what is left after `timeout` seconds (a worker's interpreter takes
        seconds to tear torch down on a busy machine; a killed one leaves its semaphores to be reported)."""
        self.stopping = True
        running = [p for p in self.procs if p.is_alive()]
        if running:
            logger.info(f"Stopping {len(running)} worker processes")
        for p in running:
            p.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                logger.warning(f"{p.name} did not stop; killing it")
                p.kill()
                p.join(1.0)
        self.ack_queue.close()
        self.ack_queue.join_thread()


class StopRequested(BaseException):
    """SIGTERM in the launcher: unwinds like Ctrl-C's KeyboardInterrupt into the cleanup of `launch`."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # in a worker: unwinds it, its `finally` blocks close its queues


def _on_launcher_sigterm(signum: int, frame: Any) -> None:
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


def _serve_http(args: ServerArgs, service: ServiceProcesses, sock: socket.socket) -> int:
    import uvicorn  # imported while the workers load

    class GracefulServer(uvicorn.Server):
        """uvicorn's server whose first SIGTERM first lets the running requests end (`stop_gracefully`,
        openai/draining.py); a second one, or Ctrl-C, stops at once."""

        def __init__(self, config: uvicorn.Config, stop_gracefully: Callable[[], Any]) -> None:
            super().__init__(config)
            self.stop_gracefully = stop_gracefully
            self.draining = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if sig != signal.SIGTERM or self.draining or self.should_exit:
                return super().handle_exit(sig, frame)
            try:
                loop = asyncio.get_running_loop()  # the handler runs on the loop's (main) thread
            except RuntimeError:
                return super().handle_exit(sig, frame)
            self.draining = True
            self._captured_signals.append(sig)  # raised again once uvicorn has stopped
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

        async def _drain(self) -> None:
            try:
                await self.stop_gracefully()
            finally:
                self.should_exit = True

    from .http_protocol import HeaderDeadlineProtocol
    from .openai import create_app

    ready = service.wait_ready()
    max_seq_len = int(ready.get("scheduler-0", {}).get("max_seq_len", 0))
    app = create_app(args, max_seq_len, health=service.all_alive)
    server = GracefulServer(
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
        ),
        app.state.stop_gracefully,
    )

    def on_death(problem: str) -> None:
        logger.error(f"{problem}; shutting the service down")
        server.should_exit = True

    service.watch(on_death)
    logger.info(
        f"Serving {args.served_model_name} (context {max_seq_len}) on http://{args.host}:{args.port}/v1"
    )
    # a SIGTERM drains the requests first (GracefulServer); then uvicorn shuts down and raises the signal
    # again: it lands in `launch` as KeyboardInterrupt / StopRequested
    try:
        server.run(sockets=[sock])
    except OSError as e:  # listen() failed: another server bound the port while the model loaded
        logger.error(f"cannot listen on {args.host}:{args.port}: {e}; stop the other server or use --port")
        return 1
    return 1 if service.failure else 0


def _follow_node0(args: ServerArgs, service: ServiceProcesses) -> int:
    """A node other than node 0: its ranks follow rank 0 until it stops (they stop with it: exit 0) or one of
    them fails (exit 1)."""
    service.wait_ready()
    ranks = f"{args.node_ranks.start}..{args.node_ranks.stop - 1}"
    logger.info(f"Node {args.node_rank}: ranks {ranks} follow rank 0 at {args.dist_init_addr}")
    while True:
        stopped = [p for p in service.procs if not p.is_alive()]
        if stopped and all(p.exitcode == 0 for p in stopped):
            logger.info(f"Rank 0 stopped the service; node {args.node_rank} stops too")
            return 0
        if stopped:
            raise WorkerDied(service.dead() or "a worker exited")
        time.sleep(0.5)


def _prepare(args: ServerArgs) -> tuple[ServerArgs, socket.socket | None]:
    """Everything checked before a worker starts: the port first (instant), then the model (a .gguf is
    converted here, once)."""
    from minisgl.utils.hf import resolve_model_path

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


def launch(args: ServerArgs) -> int:
    """Start the whole service and block until it stops. Exit code: 0 after a stop asked for by SIGTERM or
    Ctrl-C, 1 when a worker died or the port is busy, 2 for a bad model path or model."""
    signal.signal(signal.SIGTERM, _on_launcher_sigterm)
    try:
        args, sock = _prepare(args)
    except StartupError as e:
        logger.error(f"{e}")
        return e.code
    except (KeyboardInterrupt, StopRequested):
        logger.info("Stopped before the service started")
        return 0
    args = replace(args, ipc_dir=tempfile.mkdtemp(prefix="minisgl-"))
    if args.dist_init_addr:
        args = replace(args, dist_init_method=f"tcp://{args.dist_init_addr}")
    elif args.tp_size > 1:
        args = replace(args, dist_init_method=f"tcp://127.0.0.1:{free_port()}")
    # OpenMP threads that spin while waiting collapse when another process needs the same cores, and here
    # the API server and the tokenizer worker always do (docs/BENCHMARKS.md, W4). Sleeping waiters cost
    # little. Inherited by the spawned workers (read when their OpenMP runtime starts).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # ...but a short spin (~50 us) before sleeping still pays: the gaps between a step's parallel regions are
    # shorter than a wake-up (the spin counts measured: docs/BENCHMARKS.md, W4).
    os.environ.setdefault("GOMP_SPINCOUNT", "5000")
    service = ServiceProcesses(args)
    code = 0
    try:
        service.start()
        if args.node_rank > 0:
            code = _follow_node0(args, service)
        elif args.shell:
            from .shell import run_shell

            service.wait_ready()
            code = run_shell(args, service)
        else:
            code = _serve_http(args, service, sock)
    except WorkerDied as e:
        logger.error(f"{e}; shutting the service down")
        code = 1
    except (KeyboardInterrupt, StopRequested) as e:
        signame = "SIGTERM" if isinstance(e, StopRequested) else "SIGINT"
        logger.info(f"{signame} received; stopping the service")
    finally:
        # a second Ctrl-C or SIGTERM must not cut the cleanup short (stop() is bounded: it kills stragglers)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        service.stop()
        if sock is not None:
            sock.close()
        shutil.rmtree(args.ipc_dir, ignore_errors=True)
        logger.info("All processes stopped")
    return code


def main(argv: list[str] | None = None) -> int:
    """`python -m minisgl`: parse the command line (a bad option exits 2, argparse's way) and launch."""
    try:
        args = parse_args(argv)
    except KeyboardInterrupt:  # a name check may import an optional backend: a Ctrl-C then stops quietly
        return 0
    if args.dp_size > 1:
        from .dp import launch_dp

        return launch_dp(args, sys.argv[1:] if argv is None else argv)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
