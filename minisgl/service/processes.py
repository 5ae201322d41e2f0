"""The service's worker processes: what runs inside each (a scheduler rank, a tokenizer-side worker), and
the launcher's handle on them all (`ServiceProcesses`: start, wait for their ready messages, watch, stop).

Workers are started with `spawn` (CUDA, threads and ZMQ contexts do not survive a fork), ignore Ctrl-C
(the launcher stops them) and die with the launcher (PR_SET_PDEATHSIG). A worker that dies takes the
whole service down with a message."""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NoReturn

from minisgl.utils import init_logger

from .args import ServerArgs

logger = init_logger(__name__, "launcher")
IMPORT_TICK_S = 5.0  # the longest the launcher stays silent while its workers import


class WorkerDied(RuntimeError):
    """A worker process exited (or reported a startup error) while the service needed it."""


# ---- inside the worker processes ---------------------------------------------------------------------
def child_init(parent_pid: int) -> None:
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


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # in a worker: unwinds it, its `finally` blocks close its queues


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
    child_init(parent_pid)
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
        exit_now(e.code)


def _run_tokenizer(kwargs: dict[str, Any], ack_queue: Any, parent_pid: int) -> None:
    child_init(parent_pid)
    from .tokenizer_worker import tokenize_worker

    name = kwargs["worker_name"]
    ack_queue.put((name, {"stage": "imported"}))
    try:
        tokenize_worker(ack_queue=ack_queue, **kwargs)
    except SystemExit as e:  # stopped by the launcher (the worker closed its queues on the way out)
        init_logger(__name__, name).info(f"{name} stopping")
        exit_now(e.code)
    except BaseException as e:
        ack_queue.put((name, {"error": f"{type(e).__name__}: {e}"}))
        raise


def exit_now(code: Any) -> NoReturn:
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
    replies = {"recv_addr": a.detokenizer_addr, "recv_create": True, "frontend_addrs": a.frontend_addrs}
    replies["stream_interval"] = a.stream_interval
    if a.num_tokenizer == 0:
        return [worker("both", "tokenizer", **replies)]
    tokenizers = [
        worker(
            "tokenizer",
            f"tokenizer-{i}",
            recv_addr=addr,
            recv_create=True,  # each binds its own; the API servers connect to every one
            detokenizer_addr=a.detokenizer_addr,
        )
        for i, addr in enumerate(a.tokenizer_addrs)
    ]
    return [worker("detokenizer", "detokenizer", **replies), *tokenizers]


class ServiceProcesses:
    """The worker processes: start, wait for their ready messages, watch them, stop them."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.ctx = mp.get_context("spawn")
        self.ack_queue = self.ctx.Queue()
        self.procs: list[Any] = []
        self.api_procs: list[Any] = []  # API servers 1..K-1 (also in procs)
        self.stopping = False
        self.draining = False  # a graceful stop is under way (the API servers end their requests)
        self.failed = self.ctx.Event()  # a worker died: the other API servers' /health says so
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

    def start_api_servers(self, target: Callable[..., None], sock: socket.socket, max_seq_len: int) -> None:
        """API servers 1..K-1 of --api-server-count K (`target`: http_server.run_api_server), on the
        launcher's listening socket (the launcher's own uvicorn is server 0)."""
        a, pid = self.args, os.getpid()
        for i in range(1, a.api_server_count):
            p = self.ctx.Process(
                target=target,
                args=(a, i, sock, max_seq_len, self.failed, pid),
                name=f"minisgl-api-{i}",
            )
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in start()
            try:
                p.start()
            finally:
                signal.signal(signal.SIGINT, previous)
            self.api_procs.append(p)
            self.procs.append(p)
        names = ", ".join(f"{p.name} (pid {p.pid})" for p in self.api_procs)
        logger.info(f"Started {len(self.api_procs)} more API server processes on the same port: {names}")

    def begin_drain(self) -> None:
        """A graceful stop began in the launcher's API server: the others begin theirs too (SIGTERM), and
        an API server that ends is no longer a failure."""
        self.draining = True
        for p in self.api_procs:
            if p.is_alive():
                p.terminate()

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
            while not (self.stopping or self.draining):
                problem = self.dead()
                if problem and not (self.stopping or self.draining):
                    self.failure = problem
                    self.failed.set()
                    on_death(problem)
                    return
                time.sleep(0.5)

        threading.Thread(target=loop, name="minisgl-watchdog", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every worker, SIGKILL what is left after `timeout` seconds (a worker's interpreter takes
        seconds to tear torch down on a busy machine; a killed one leaves its semaphores to be reported)."""
        self.stopping = True
        self._stop_api_servers()
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

    def _stop_api_servers(self) -> None:
        """Before the workers they talk to: after a graceful stop the other API servers are ending their
        requests (they began with the launcher's); otherwise they stop at once (SIGINT)."""
        if not self.draining:
            for p in self.api_procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGINT)
        deadline = time.monotonic() + 10.0
        for p in self.api_procs:
            p.join(max(0.0, deadline - time.monotonic()))
