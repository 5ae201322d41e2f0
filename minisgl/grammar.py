"""Constrained decoding with xgrammar: checking a request's constraint, compiling it off the scheduler's
critical path, and the per-step token masks.

A request sets at most one of SamplingParams' `json_schema`, `regex`, `ebnf`, `structural_tag`.
`check_grammar` parses it (no tokenizer needed: the service's tokenizer process and `LLM.generate` call it,
so a bad constraint is refused before it reaches the scheduler). The scheduler compiles it against the
model's vocabulary on a worker thread (`GrammarCompiler`, one compilation per distinct constraint) and
gives the request a matcher (`new_matcher`), advanced with every token the request keeps. Each step,
`TokenMasks.fill` writes the allowed-token bitmask of the batch's constrained rows on the host and copies
it to the device; `apply_token_mask` sets the other logits of those rows to -inf before sampling.

JSON schemas compile with `any_whitespace=False` and the separators ", " and ": ": a model may put no
whitespace of its own choosing between the tokens, so a weak (or random) model cannot loop on spaces and
newlines, and the output reads as `json.dumps` writes it.

xgrammar is imported on first use: a process that never sees a constraint never loads it."""

from __future__ import annotations

import ctypes
import hashlib
import json
import multiprocessing as mp
import os
import re
import signal
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing import connection as mp_connection
from typing import TYPE_CHECKING, Any

import psutil
import torch

from minisgl.core import InvalidRequest, Req, SamplingParams
from minisgl.utils import init_logger
from minisgl.utils.device import HostRing
from minisgl.utils.hf import load_tokenizer

if TYPE_CHECKING:
    import xgrammar

logger = init_logger(__name__)

JSON_SEPARATORS = (", ", ": ")
MAX_GRAMMAR_CHARS = 1 << 20  # a constraint's text; far beyond any real schema or grammar
MAX_NESTING = 40  # brackets in a constraint's text: a body's 32 levels, and a forced tool call's wrapping
MAX_CHECKED = 256  # constraints remembered as parsed (by their hash)
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
BATCH_FILL_MIN = 8  # constrained rows from which a GPU step fills their masks on several threads
_WHAT = {
    "json_schema": "JSON schema",
    "regex": "regular expression",
    "ebnf": "EBNF grammar (with a 'root' rule)",
    "structural_tag": "structural tag",
}


def _xgr() -> Any:
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError(
            "structured output needs xgrammar: pip install 'xgrammar>=0.2' (the `grammar` extra; ./run "
            "installs it)"
        ) from e
    return xgrammar


def parse_grammar(kind: str, text: str) -> xgrammar.Grammar:
    """The xgrammar Grammar of one constraint (kind: a SamplingParams field name); raises on bad text."""
    xgr = _xgr()
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=JSON_SEPARATORS)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "ebnf":
        return xgr.Grammar.from_ebnf(text)
    if kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(text)
    raise ValueError(f"unknown constraint kind {kind!r}")


# what a nesting scan skips: JSON strings; in a regex or EBNF grammar escapes, character classes, literals
_OPAQUE = {
    "json": re.compile(r'"(?:[^"\\]|\\.)*"'),
    "text": re.compile(r'\\.|\[(?:\\.|[^\]\\])*\]|"(?:[^"\\]|\\.)*"'),
}
_OPEN, _CLOSE = frozenset("[{("), frozenset("]})")


def nesting_depth(kind: str, text: str) -> int:
    """How deep the brackets of a constraint's text nest, found without recursion (the parsers that read
    it next recurse once per level: too deep a text would exhaust their stack)."""
    skeleton = _OPAQUE["json" if kind in ("json_schema", "structural_tag") else "text"].sub("", text)
    depth = deepest = 0
    for c in re.sub(r"[^\[\]{}()]", "", skeleton):
        depth += 1 if c in _OPEN else -1
        deepest = max(deepest, depth)
    return deepest


def check_size(kind: str, text: str, param: str | None = None) -> None:
    """Bound a constraint's text before anything parses it: its length and its nesting depth (iterative,
    so a schema of arrays nested 1,000 deep is a 400, not a RecursionError). `param`: the name an error
    gives the field (default: `kind`)."""
    param = param or kind
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"'{param}' holds {len(text)} characters; at most {MAX_GRAMMAR_CHARS}", param)
    depth = nesting_depth(kind, text)
    if depth > MAX_NESTING:
        raise InvalidRequest(f"'{param}' nests {depth} levels deep; at most {MAX_NESTING}", param)


def _detail(e: Exception) -> str:
    """xgrammar's error, on one line, without its time and source-file prefix."""
    text = " ".join(str(e).split())
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)[:300] or type(e).__name__


def _digest(kind: str, text: str) -> bytes:
    return hashlib.sha256(f"{kind}\0{text}".encode("utf-8", "surrogatepass")).digest()


_checked: OrderedDict[bytes, None] = OrderedDict()  # digests of constraints that parsed (clients repeat them)


def check_grammar(params: SamplingParams, parse: bool = True) -> None:
    """Check the request's constraint, if any: its type, size and nesting (`check_size`), a JSON one's
    syntax, and (`parse`) whether xgrammar parses it; raise InvalidRequest naming the field (`json_schema`,
    `regex`, `ebnf`, `structural_tag`) when it is not valid. The service leaves the parse to its compile
    processes (xgrammar's warnings on a large schema would flood its log otherwise)."""
    params.validate()
    grammar = params.grammar
    if grammar is None:
        return
    kind, text = grammar
    digest = _digest(kind, text)
    if digest in _checked:
        return
    check_size(kind, text)
    if kind in ("json_schema", "structural_tag"):
        try:
            value = json.loads(text)  # safe: the depth is bounded
        except ValueError as e:
            raise InvalidRequest(f"'{kind}' is not valid JSON: {e}", kind) from None
        if not isinstance(value, (dict, bool) if kind == "json_schema" else dict):
            raise InvalidRequest(f"'{kind}' must be a JSON object, got {type(value).__name__}", kind)
    if not parse:
        return
    try:
        parse_grammar(kind, text)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError or its own types
        raise InvalidRequest(f"'{kind}' is not a valid {_WHAT[kind]}: {_detail(e)}", kind) from None
    if len(_checked) >= MAX_CHECKED:
        _checked.popitem(last=False)
    _checked[digest] = None


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
            refused = self._refused.get(_digest(kind, text))
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
            self._info = _xgr().TokenizerInfo.from_huggingface(
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
        compiled = _xgr().CompiledGrammar.deserialize_json(payload, self._info)
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
            self._refused[_digest(*key)] = error
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
        self.proc = ctx.Process(
            target=_compile_process,
            args=(self.info_json, child, os.getpid()),
            name="minisgl-grammar",
            daemon=True,
        )
        self.proc.start()
        try:  # compiling is background work: the model's steps (and the streams) come first
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, COMPILE_NICENESS)
        except OSError:
            pass
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
    xgr = _xgr()
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
            reply = ("refused", f"is not a valid {_WHAT[kind]}: {_detail(e)}")
        conn.send((*reply, _take_lines(warnings)))


def _take_lines(f: Any) -> tuple[int, str]:
    """How many lines the file holds and its first one; then empties it."""
    f.seek(0)
    lines = f.read().decode("utf-8", "replace").splitlines()
    f.seek(0)
    f.truncate()
    return len(lines), _detail(Exception(lines[0])) if lines else ""


class _Refused(Exception):
    """A constraint that compiled but cannot be used (the rest of the sentence naming its field)."""


def _compile_checked(compiler: Any, info: Any, kind: str, text: str, max_bytes: int) -> str:
    xgr = _xgr()
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
        raise _Refused(f"is a {_WHAT[kind]} that no output can satisfy")
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


def new_matcher(compiled: Any) -> Any:
    """A fresh matcher (xgrammar GrammarMatcher) of a compiled grammar, for one request."""
    return _xgr().GrammarMatcher(compiled)


@dataclass
class TokenMask:
    """A batch's allowed tokens on the device: `bits` [n, ceil(V/32)] int32, one row per constrained
    sampled row; `rows` [n] their indices among the sampled rows (None: every sampled row, in order),
    on the device and (`host_rows`) as a list."""

    bits: torch.Tensor
    rows: torch.Tensor | None
    host_rows: list[int]


class TokenMasks:
    """Fills the token bitmasks of a batch's constrained rows on the host, through pinned buffers. With
    a GPU, many rows are filled by xgrammar's thread pool (on a CPU the cores run the model)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.width = (vocab_size + 31) // 32
        self.device = device
        self._ring = HostRing(device)
        self.threads = 1 if device.type == "cpu" else min(8, max(1, (os.cpu_count() or 2) // 2))
        self._batch: Any = None  # xgrammar BatchGrammarMatcher, made at the first large batch

    def fill(self, reqs: list[Req], rows: list[int], num_sampled: int) -> TokenMask:
        """The mask of sampled rows `rows` (their requests `reqs`, in order) of a batch sampling
        `num_sampled` rows. A finished request's row (its token will be discarded) allows everything."""
        n = len(rows)
        buf, slot = self._ring.take(n * self.width)
        bits = buf[: n * self.width].view(n, self.width)
        live = []
        for k, req in enumerate(reqs):
            if req.finished or req.grammar is None:
                bits[k].fill_(-1)
            else:
                live.append(k)
        if self.threads > 1 and len(live) >= BATCH_FILL_MIN:
            if self._batch is None:
                self._batch = _xgr().BatchGrammarMatcher(self.threads)
            self._batch.batch_fill_next_token_bitmask([reqs[k].grammar for k in live], bits, live)
        else:
            for k in live:
                reqs[k].grammar.fill_next_token_bitmask(bits, k)
        dev = bits.to(self.device, non_blocking=True)
        self._ring.used(slot)  # the buffer is handed out again once this copy is done
        every = n == num_sampled  # rows are ascending and distinct: all of them means 0..n-1
        index = None
        if not every and self.device.type != "cpu":
            index = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        return TokenMask(dev, index, list(range(n)) if every else rows)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """Set the logits of the tokens a constrained row may not take to -inf, in place (xgrammar's kernel:
    Triton on a GPU, C++ on a CPU); the other rows are untouched."""
    apply, width = _xgr().apply_token_bitmask_inplace, logits.shape[-1]
    if len(mask.host_rows) == logits.shape[0]:
        apply(logits, mask.bits, vocab_size=width)
    elif logits.device.type == "cpu":  # row by row on views: no copy of the logits
        for k, row in enumerate(mask.host_rows):
            apply(logits[row], mask.bits[k], vocab_size=width)
    else:  # one kernel over the constrained rows, gathered
        sub = logits.index_select(0, mask.rows)
        apply(sub, mask.bits, vocab_size=width)
        logits.index_copy_(0, mask.rows, sub)
