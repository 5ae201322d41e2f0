"""Compiling constraints against the model's vocabulary in a few killable worker processes, each compile
within a budget of CPU time, the compiled grammars cached within a budget of bytes."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing import connection as mp_connection
from typing import Any

import psutil

from minisgl.core import InvalidRequest
from minisgl.utils import init_logger
from minisgl.utils.hf import load_tokenizer
from minisgl.utils.niced import run_niced

logger = init_logger(__name__)

from .checks import MAX_CHECKED, WHAT, constraint_digest, detail, load_xgrammar, parse_grammar

DEFAULT_COMPILE_TIMEOUT = 20.0  # seconds one constraint may take to compile (--grammar-compile-timeout)
DEFAULT_CACHE_MB = 256  # compiled grammars kept, in MiB of token tables (--grammar-cache-mb)
COMPILE_PROCESSES = 2  # compile workers: a slow compile leaves the other free for everyone else
MAX_TRANSFER = 512 << 20  # a compiled grammar's serialized form, sent back to the scheduler
SERIALIZED_RATIO = 16  # at least this many bytes of serialized form per byte of token tables (measured 22)
COMPILE_NICENESS = 10  # the compile processes' priority below the scheduler's
# a compile's budget is the CPU time its process spends (at its low priority a busy machine gives it a
# small share of a core: a wall-clock budget refused valid constraints there); this many times the budget
# in wall time ends it whatever its CPU time
WALL_BUDGETS = 3
POLL_S = 0.02  # the compile dispatcher's wake-up when nothing arrives


class GrammarCompiler:
    """Compiles constraints against the model's vocabulary in a few worker processes, each compile within
    a time budget, and keeps the compiled grammars in a cache bounded in bytes.

    xgrammar cannot interrupt a compilation, and one can take minutes (a 20,000-value enum, thousands of
    optional properties): in a thread it would hold its core and its place in the queue long after its
    request was refused or gone. A worker process is killed instead, when its compile passes `timeout`
    seconds of CPU time (or WALL_BUDGETS times that in wall time) or every request waiting for it was
    aborted, and a fresh one takes its place; so one request delays another's compile by at most its own
    budget. A compiled grammar comes back
    serialized (xgrammar's JSON form). The vocabulary is the logits' width (ids beyond the tokenizer's
    are never allowed); `stop_ids` are the tokens that may end a complete output. Errors a client can fix
    (a bad or impossible constraint, a compile over its budget of time or bytes) are the future's
    InvalidRequest naming the constraint's field."""

    def __init__(
        self,
        tokenizer_path: str,
        vocab_size: int,
        stop_ids: Callable[[], list[int]],
        timeout: float = DEFAULT_COMPILE_TIMEOUT,
        cache_bytes: int = DEFAULT_CACHE_MB << 20,
        processes: int = COMPILE_PROCESSES,
    ) -> None:
        self.tokenizer_path, self.vocab_size, self._stop_ids = tokenizer_path, vocab_size, stop_ids
        self.timeout, self.cache_bytes = timeout, cache_bytes
        self._info: Any = None  # xgrammar TokenizerInfo, built at the first constraint
        self._workers: list[_CompileWorker] = []
        self._num_workers = processes
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()  # most recently used last
        self._cached_bytes = 0
        self._refused: OrderedDict[bytes, InvalidRequest] = OrderedDict()  # by digest: over a budget
        self._jobs: dict[tuple[str, str], _Job] = {}  # compiling or queued, by constraint
        self._queue: deque[_Job] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    # ---- the scheduler's side -------------------------------------------------------------------------
    def submit(self, kind: str, text: str, uid: int = -1) -> Future:
        """A future of the compiled grammar (an xgrammar CompiledGrammar) for request `uid`; a repeated
        constraint shares its compile and its cache entry."""
        key = (kind, text)
        with self._lock:
            refused = self._refused.get(constraint_digest(kind, text))
            if refused is not None:  # a client repeating a constraint that timed out does not retry it
                future = Future()
                future.set_exception(refused)
                return future
            if key in self._cache:
                self._cache.move_to_end(key)
                future: Future = Future()
                future.set_result(self._cache[key])
                return future
            job = self._jobs.get(key)
            if job is None:
                job = self._jobs[key] = _Job(key)
                self._queue.append(job)
            job.waiters.add(uid)
        self._start()
        self._wake.set()
        return job.future

    def cancel(self, uid: int) -> None:
        """Request `uid` was aborted: a compile nobody waits for any more is dropped (its worker killed)."""
        with self._lock:
            for job in self._jobs.values():
                job.waiters.discard(uid)
        self._wake.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(2.0)
        for w in self._workers:
            w.kill()

    # ---- the dispatcher thread ------------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="minisgl-grammar", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._info = load_xgrammar().TokenizerInfo.from_huggingface(
                load_tokenizer(self.tokenizer_path),
                vocab_size=self.vocab_size,
                stop_token_ids=sorted(self._stop_ids()),
            )
            info_json = self._info.serialize_json()
            self._workers = [_CompileWorker(info_json) for _ in range(self._num_workers)]
        except Exception as e:  # noqa: BLE001 - every waiting request learns why, none hangs
            self._fail_all(RuntimeError(f"the grammar compiler did not start: {e}"))
            return
        while not self._stopped:
            try:
                self._round()
            except Exception:  # a bug here must not leave every later constraint waiting forever
                logger.exception("the grammar compile dispatcher failed; it carries on")
                time.sleep(POLL_S)

    def _round(self) -> None:
        self._dispatch()
        busy = {w.conn: w for w in self._workers if w.job is not None}
        if busy:
            for conn in mp_connection.wait(list(busy), timeout=POLL_S):
                self._receive(busy[conn])  # type: ignore[index]
        else:
            self._wake.wait(POLL_S)
        self._wake.clear()
        self._expire()

    def _dispatch(self) -> None:
        with self._lock:
            while self._queue and (idle := next((w for w in self._workers if w.job is None), None)):
                job = self._queue.popleft()
                if not job.waiters:
                    self._jobs.pop(job.key, None)
                    job.future.cancel()
                    continue
                try:
                    idle.start(job, self.cache_bytes)
                except OSError:  # its process died while idle: a fresh one, and this job fails
                    idle.restart()
                    self._jobs.pop(job.key, None)
                    job.future.set_exception(RuntimeError("the grammar compiler process died"))

    def _receive(self, w: _CompileWorker) -> None:
        job = w.job
        assert job is not None
        try:
            status, payload, (num_warnings, first) = w.conn.recv()
        except (EOFError, OSError):  # the worker died (out of memory?): a fresh one replaces it
            w.restart()
            self._finish(job, error=RuntimeError("the grammar compiler process died"))
            return
        w.job = None
        if num_warnings:
            logger.warning(
                f"xgrammar warned {num_warnings} times on a {job.key[0]} constraint; first: {first}"
            )
        if status != "ok":  # the constraint's fault, for good: refused at once when sent again
            kind = job.key[0]
            self._finish(job, error=self._refuse(job.key, f"'{kind}' {payload}"))
            return
        compiled = load_xgrammar().CompiledGrammar.deserialize_json(payload, self._info)
        self._finish(job, compiled)

    def _expire(self) -> None:
        now = time.monotonic()
        for w in self._workers:
            job = w.job
            if job is None:
                continue
            if not job.waiters:  # every request waiting for it was aborted
                w.restart()
                self._finish(job, error=None)
            elif w.cpu_seconds() > self.timeout or now - w.started > WALL_BUDGETS * self.timeout:
                w.restart()
                kind = job.key[0]
                message = (
                    f"'{kind}' did not compile within {self.timeout:g} s of CPU time (--grammar-compile-timeout); "
                    "simplify it (fewer alternatives, properties or tools)"
                )
                self._finish(job, error=self._refuse(job.key, message))

    def _refuse(self, key: tuple[str, str], message: str) -> InvalidRequest:
        error = InvalidRequest(message, key[0])
        with self._lock:
            self._refused[constraint_digest(*key)] = error
            if len(self._refused) > MAX_CHECKED:
                self._refused.popitem(last=False)
        return error

    def _finish(self, job: _Job, compiled: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            self._jobs.pop(job.key, None)
            if compiled is not None:
                self._cache_put(job.key, compiled)
        if error is not None:
            job.future.set_exception(error)
        elif compiled is not None:
            job.future.set_result(compiled)
        else:
            job.future.cancel()

    def _cache_put(self, key: tuple[str, str], compiled: Any) -> None:
        size = compiled.memory_size_bytes
        self._cache[key] = compiled
        self._cached_bytes += size
        while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:  # the newest stays: in use
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.memory_size_bytes

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            jobs, self._jobs = list(self._jobs.values()), {}
            self._queue.clear()
        for job in jobs:
            job.future.set_exception(error)


@dataclass
class _Job:
    """One constraint being compiled (or queued), and the requests that wait for it."""

    key: tuple[str, str]
    future: Future = field(default_factory=Future)
    waiters: set[int] = field(default_factory=set)


class _CompileWorker:
    """One compile process and the job it runs."""

    def __init__(self, info_json: str) -> None:
        self.info_json = info_json
        self.job: _Job | None = None
        self.started = 0.0  # when the job started: wall clock, and the process's CPU time
        self.cpu_started = 0.0
        self._spawn()

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        # compiling is background work: the model's steps (and the streams) come first, from the child's
        # imports on (torch's among them: seconds of CPU, which at the service's priority paused streams)
        self.proc = ctx.Process(
            target=run_niced,
            args=(COMPILE_NICENESS, f"{__name__}:_compile_process", self.info_json, child, os.getpid()),
            name="minisgl-grammar",
            daemon=True,
        )
        self.proc.start()
        self.ps = psutil.Process(self.proc.pid)
        child.close()

    def _cpu(self) -> float:
        try:
            t = self.ps.cpu_times()
            return t.user + t.system
        except psutil.Error:  # gone: its pipe says so
            return 0.0

    def cpu_seconds(self) -> float:
        """The CPU time the process has spent on its current job."""
        return self._cpu() - self.cpu_started

    def start(self, job: _Job, max_bytes: int) -> None:
        self.job, self.started, self.cpu_started = job, time.monotonic(), self._cpu()
        self.conn.send((job.key[0], job.key[1], max_bytes))

    def restart(self) -> None:
        """Kill the process (its compile cannot be interrupted) and start a fresh one."""
        self.kill()
        self.job = None
        self._spawn()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def _compile_process(info_json: str, conn: Any, parent_pid: int) -> None:
    """A compile worker's loop: (kind, text, max_bytes) in, ("ok", serialized grammar) or ("refused",
    why) out, until the scheduler closes the pipe or kills it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # die with the scheduler, even if it is killed
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(1)
    # xgrammar writes a warning to stderr per unsupported part of a schema (3,000 lines for a schema
    # of 3,000 such properties): they go to a file here, and the scheduler logs one line per compile
    warnings = tempfile.TemporaryFile(mode="w+b")  # noqa: SIM115 - open for the process's whole life
    os.dup2(warnings.fileno(), 2)
    xgr = load_xgrammar()
    info = xgr.TokenizerInfo.deserialize_json(info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    while True:
        try:
            kind, text, max_bytes = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple[str, str] = ("ok", _compile_checked(compiler, info, kind, text, max_bytes))
        except _Refused as e:
            reply = ("refused", str(e))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError or its own types
            reply = ("refused", f"is not a valid {WHAT[kind]}: {detail(e)}")
        conn.send((*reply, _take_lines(warnings)))


def _take_lines(f: Any) -> tuple[int, str]:
    """How many lines the file holds and its first one; then empties it."""
    f.seek(0)
    lines = f.read().decode("utf-8", "replace").splitlines()
    f.seek(0)
    f.truncate()
    return len(lines), detail(Exception(lines[0])) if lines else ""


class _Refused(Exception):
    """A constraint that compiled but cannot be used (the rest of the sentence naming its field)."""


def _compile_checked(compiler: Any, info: Any, kind: str, text: str, max_bytes: int) -> str:
    xgr = load_xgrammar()
    compiled = compiler.compile_grammar(parse_grammar(kind, text))
    size = compiled.memory_size_bytes
    if size > max_bytes:
        raise _Refused(
            f"compiles to {size / 2**20:.0f} MiB of token tables, more than the {max_bytes / 2**20:.0f} MiB "
            "of --grammar-cache-mb; simplify it"
        )
    matcher = xgr.GrammarMatcher(compiled)
    bits = xgr.allocate_token_bitmask(1, info.vocab_size)
    matcher.fill_next_token_bitmask(bits)
    if not bool(bits.any()):  # not even a stop token: no output can satisfy it
        raise _Refused(f"is a {WHAT[kind]} that no output can satisfy")
    # the serialized form is some 20x the tables (a 194 MiB enum of 20,000 values would be ~4 GiB of
    # JSON): refused before it is made
    if size * SERIALIZED_RATIO > MAX_TRANSFER:
        raise _Refused(
            f"compiles to {size / 2**20:.0f} MiB of token tables, more than the "
            f"{MAX_TRANSFER / SERIALIZED_RATIO / 2**20:.0f} MiB a compile process can hand over; simplify it"
        )
    serialized = compiled.serialize_json()
    if len(serialized) > MAX_TRANSFER:
        raise _Refused(f"compiles to {len(serialized) >> 20} MiB of serialized tables; simplify it")
    return serialized
