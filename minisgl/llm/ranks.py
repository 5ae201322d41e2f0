"""The offline API's tensor-parallel ranks: rank 0 runs in the caller's process, the other ranks of this
node in spawned follower processes that build the same Scheduler and apply rank 0's requests in the same
order before every step, so every rank makes the same decisions (as the service's ranks do).

Rank 0 sends each step's commands over torch.distributed (the gloo control group, also there when the
model's group is NCCL), so the offline path needs neither ZMQ nor a server. A follower dies with its
parent: it watches a pipe from rank 0 (end of file: the parent is gone) and asks the kernel for SIGKILL
when the parent exits. A follower that fails sends its traceback over that pipe and exits; rank 0 then
raises RankFailed naming the rank. With --nnodes N, LLM on node k > 0 runs that node's ranks until rank
0 stops them (`follow_rank0`).

A follower is a fresh interpreter (`python -c`, started with subprocess), not a multiprocessing child:
multiprocessing's spawn re-imports the caller's `__main__`, so a script that calls LLM(tp_size=2) without
an `if __name__ == "__main__":` guard would start its LLM again in every follower. The follower gets its
arguments over the pipe instead, after the caller's sys.path (which it takes, as spawn does).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from minisgl.core import SamplingParams
from minisgl.distributed import all_gather_object, broadcast_object
from minisgl.scheduler import Scheduler, SchedulerConfig
from minisgl.utils import init_logger

logger = init_logger(__name__)

JOIN_TIMEOUT = 30.0  # seconds a follower has to stop after rank 0's stop command before it is killed


class RankFailed(RuntimeError):
    """A tensor-parallel rank process died or raised; the message names the rank and its error."""


# ---- in a follower process -----------------------------------------------------------------------------
def _die_with_parent(conn: Any, parent_pid: int) -> None:
    try:  # the kernel's SIGKILL when the parent (thread) exits ...
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:  # ... and the pipe's end of file, whichever thread of the parent made us
        try:
            while True:
                conn.recv()
        except (EOFError, OSError):
            os._exit(1)

    threading.Thread(target=watch, name="minisgl-parent-watch", daemon=True).start()
    # tqdm's default lock is a multiprocessing semaphore that this process, ending with os._exit, would
    # leave to the resource tracker to report as leaked
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def rank_state(scheduler: Scheduler) -> dict[str, Any]:
    """What rank 0 asks every rank for: its KV pages, its integrity check (when idle) and its memory."""
    problem = None
    if not scheduler.has_work:
        try:
            scheduler.check_integrity()
        except AssertionError as e:
            problem = str(e)
    return {
        "free_pages": scheduler.num_free_pages(),
        "cached_pages": scheduler.cache.cache.cached_pages,
        "total_pages": scheduler.num_total_pages,
        "integrity_error": problem,
        "memory": dict(scheduler.engine.memory),
    }


def _apply(scheduler: Scheduler, commands: list[tuple]) -> bool:
    """Apply one broadcast of rank 0's commands; False once told to stop."""
    for cmd in commands:
        op = cmd[0]
        if op == "add":
            scheduler.add_request(cmd[1], cmd[2], cmd[3])
        elif op == "abort":
            scheduler.abort_request(cmd[1])
        elif op == "step":
            scheduler.step()
        elif op == "state":
            all_gather_object(rank_state(scheduler))
        elif op == "stop":
            return False
        else:
            raise AssertionError(f"unknown command {op!r}")
    return True


def _follower_main(config: SchedulerConfig, rank: int, conn: Any, parent_pid: int) -> None:
    _die_with_parent(conn, parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches rank 0, which stops us
    scheduler = None
    try:
        scheduler = Scheduler(replace(config, tp_rank=rank, show_progress=False))
        while _apply(scheduler, broadcast_object()):
            pass
        scheduler.shutdown()
    except BaseException as e:  # noqa: BLE001 (everything goes to rank 0, which raises it)
        try:
            conn.send(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:
            os._exit(1)
    os._exit(0)  # no interpreter teardown: rank 0 joins us and torch's teardown takes seconds


def follower_entry(fd: int) -> None:
    """A follower's `python -c` entry: its arguments come over the pipe at file descriptor `fd`."""
    conn = Connection(fd)
    sys.path[:] = conn.recv()  # the caller's, before anything it names is unpickled
    config, rank, parent_pid = conn.recv()
    _follower_main(config, rank, conn, parent_pid)


def follow_rank0(config: SchedulerConfig, rank: int) -> None:
    """Run rank `rank` in this process until rank 0 stops it (a node other than node 0)."""
    scheduler = Scheduler(replace(config, tp_rank=rank, show_progress=False))
    try:
        while _apply(scheduler, broadcast_object()):
            pass
    finally:
        scheduler.shutdown()


# ---- in rank 0 ---------------------------------------------------------------------------------------
class FollowerProcess:
    """One follower's process (a fresh interpreter, never a fork: CUDA and torch's threads do not survive
    one), with the few methods of multiprocessing.Process that rank 0 uses."""

    def __init__(self, rank: int, conn: Connection) -> None:
        self.name = f"minisgl-rank-{rank}"
        # where this package is, for the first import; the caller's whole sys.path follows over the pipe
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        code = f"from minisgl.llm.ranks import follower_entry; follower_entry({conn.fileno()})"
        # a session of its own: a terminal's Ctrl-C reaches rank 0 only, which stops the followers
        self.popen = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=[conn.fileno()], env=env, start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()


class FollowerRanks:
    """Rank 0's side: starts this node's other ranks, sends them each step's commands, reports their
    failures, stops them."""

    def __init__(self, config: SchedulerConfig, first_rank: int = 1) -> None:
        self.pending: list[tuple] = []
        self.procs: list[tuple[int, FollowerProcess, Connection]] = []  # (rank, process, rank 0's end)
        per_node = config.tp_size // config.nnodes
        for rank in range(first_rank, first_rank + per_node - 1):
            ours, theirs = mp.Pipe()
            p = FollowerProcess(rank, theirs)
            theirs.close()
            ours.send(sys.path)
            ours.send((config, rank, os.getpid()))
            self.procs.append((rank, p, ours))
        if self.procs:
            logger.info(f"Started ranks {', '.join(f'{r} (pid {p.pid})' for r, p, _ in self.procs)}")

    # ---- the commands ------------------------------------------------------------------------------
    def add_request(self, uid: int, input_ids: list[int], params: SamplingParams) -> None:
        self.pending.append(("add", uid, input_ids, params))

    def abort_request(self, uid: int) -> None:
        self.pending.append(("abort", uid))

    def before_step(self) -> None:
        """Send the requests added and aborted since the last step, then the step itself."""
        self.check()
        commands, self.pending = [*self.pending, ("step",)], []
        with self.guard():
            broadcast_object(commands)

    def states(self, scheduler: Scheduler) -> list[dict[str, Any]]:
        """Every rank's `rank_state`, in rank order (rank 0's included)."""
        self.check()
        commands, self.pending = [*self.pending, ("state",)], []
        assert not any(c[0] == "add" for c in commands), "requests are sent before a step"
        with self.guard():  # rank 0 applied its own commands already
            broadcast_object(commands)
            return all_gather_object(rank_state(scheduler))

    # ---- failures ----------------------------------------------------------------------------------
    def failure(self) -> str | None:
        """The first follower that died or reported an error, with its error, or None."""
        for rank, p, conn in self.procs:
            error = None
            try:
                if conn.poll():
                    error = conn.recv()
            except (EOFError, OSError):
                pass
            if error is not None or not p.is_alive():
                p.join(1.0)
                why = error.strip() if error else f"exited with code {p.exitcode}"
                return f"tensor-parallel rank {rank} (pid {p.pid}) failed: {why}"
        return None

    def check(self) -> None:
        """The watchdog before each collective: raise RankFailed if a follower is gone."""
        problem = self.failure()
        if problem:
            raise RankFailed(problem)

    @contextmanager
    def guard(self, grace: float = 5.0) -> Iterator[None]:
        """Turn a collective that failed because a follower died into RankFailed naming it (the follower
        may need a moment to report and exit after the collective broke)."""
        try:
            yield
        except Exception as e:
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                problem = self.failure()
                if problem:
                    raise RankFailed(problem) from e
                time.sleep(0.1)
            raise

    def shutdown(self, kill: bool = False) -> None:
        """Tell the followers to stop and join them (killing any that does not stop); `kill`: the group
        never formed or broke, kill them at once."""
        if kill:
            pass
        elif self.failure() is None:
            try:
                broadcast_object([("stop",)])
            except Exception as e:  # noqa: BLE001 (a follower died meanwhile: it is joined below)
                logger.warning(f"could not tell the ranks to stop: {e}")
        else:  # the group is broken: the others cannot take a command any more
            kill = True
        for _, p, _ in self.procs if kill else []:
            p.kill()
        deadline = time.monotonic() + JOIN_TIMEOUT
        for _, p, conn in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                logger.warning(f"{p.name} did not stop; killing it")
                p.kill()
                p.join(5.0)
            conn.close()
        self.procs = []
