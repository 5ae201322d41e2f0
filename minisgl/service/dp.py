"""`python -m minisgl --dp N`: N replicas of the service on this machine behind SGLang's cache-aware router.

Each replica is a normal `python -m minisgl` (its own launcher, schedulers and tokenizer side) on 127.0.0.1,
port --port + 1 + i, with --tp-size GPUs of its own on a GPU host (CUDA_VISIBLE_DEVICES) or an Nth of the
CPU cores (OMP_NUM_THREADS and the CPU affinity) on a CPU. Once every replica answers /health, the router
(`python -m sglang_router.launch_router`, policy cache_aware) listens on --host:--port with the replicas'
URLs. A request goes to the replica whose prefix cache the router expects to hold its prompt's prefix.

Stopping: SIGTERM or Ctrl-C stops the router, then every replica (each stops its own workers); children
die with this launcher (PR_SET_PDEATHSIG) even if it is SIGKILLed. A replica that dies is logged and left
to the router, which takes it out; the service stops (exit 1) when the router or every replica is gone.
"""

from __future__ import annotations

import ctypes
import http.client
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from minisgl.utils import init_logger
from minisgl.utils.options import flag, given

from .args import ServerArgs, build_parser
from .startup import StartupError, StopRequested, on_launcher_sigterm, prepare

logger = init_logger(__name__, "dp")

ROUTER_POLICY = "cache_aware"
# options the launcher sets per replica (the rest of the command line goes to every replica as given)
PER_REPLICA = ("dp_size", "router_args", "host", "port", "model_path", "served_model_name")


@dataclass
class Child:
    """A replica or the router: its name, where it answers, and its process."""

    name: str
    url: str
    proc: subprocess.Popen


def _die_with_parent() -> None:
    # in the child between fork and exec: a SIGTERM (not a SIGKILL) when this launcher dies, so a
    # replica's own launcher still stops its workers
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def replica_argv(argv: list[str], args: ServerArgs, port: int) -> list[str]:
    """The command line of one replica: the options given here, but its own port on loopback, the model
    resolved once by this launcher and the name the router's clients use."""
    out = []
    for name, value in given(build_parser().parse_args(argv), ServerArgs).items():
        if name in PER_REPLICA:
            continue
        if isinstance(value, bool):
            out.append(flag(name) if value else "--no-" + flag(name)[2:])
        else:
            out += [flag(name), str(value)]
    out += ["--model", args.model_path, "--served-model-name", args.served_model_name]
    return [sys.executable, "-m", "minisgl", *out, "--host", "127.0.0.1", "--port", str(port)]


def _gpus() -> list[str]:
    """The GPUs this launcher may hand out: CUDA_VISIBLE_DEVICES's, else every one the driver lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def replica_devices(args: ServerArgs) -> list[dict[str, str]]:
    """Per replica, the environment that gives it its share of the machine: --tp-size GPUs each (shared
    round-robin when there are fewer GPUs than replicas need), or an Nth of the CPU cores."""
    n, tp, gpus = args.dp_size, args.tp_size, _gpus()
    if gpus:
        if len(gpus) < n * tp:
            share = -(-n * tp // len(gpus))  # replicas per GPU
            logger.warning(
                f"{n} replicas x {tp} GPUs > the {len(gpus)} GPUs visible: {share} replicas share each GPU; "
                f"each sizes its memory from the whole GPU, so give them --mem-fraction "
                f"{args.mem_fraction / share:.2f} (or --num-pages)"
            )
        return [
            {"CUDA_VISIBLE_DEVICES": ",".join(gpus[(i * tp + r) % len(gpus)] for r in range(tp))}
            for i in range(n)
        ]
    from minisgl.utils.device import physical_cores

    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, physical_cores() // n))
    return [{"OMP_NUM_THREADS": threads} for _ in range(n)]


def _cpu_share(i: int, n: int) -> set[int] | None:
    """Replica i's cores on a CPU host (None when there are fewer cores than replicas: no pinning)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < n:
        return None
    per = len(cores) // n
    return set(cores[i * per : (i + 1) * per])


def router_argv(args: ServerArgs, urls: list[str]) -> list[str]:
    """The router's command line: cache-aware, the replicas as its workers, quick startup checks."""
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", args.host, "--port", str(args.port)]
    cmd += ["--worker-urls", *urls, "--policy", ROUTER_POLICY, "--log-level", "warn"]
    # the replicas answer /health already: the router's first check passes, and a dead one is found fast
    cmd += ["--worker-startup-check-interval", "1", "--health-check-interval-secs", "5"]
    if args.api_key:  # the router checks its clients' key and sends it on to the replicas
        cmd += ["--api-key", args.api_key]
    return cmd + shlex.split(args.router_args)  # the router's argparse: a later flag wins


def _answers(url: str) -> bool:
    """Whether GET `url` answers 200. Anything else, a reply that is not HTTP included, means "not yet":
    while a replica is starting nothing listens on its port, and a connection to it can be given that
    very port as its source (the kernel's ephemeral range holds it), so the request reads itself back."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):
        return False


def _wait_until(children: list[Child], path: str, check: Callable[[], None]) -> None:
    """Block until GET `path` answers 200 on every child; `check` raises if something died meanwhile."""
    waiting = list(children)
    while waiting:
        check()
        waiting = [c for c in waiting if not _answers(c.url + path)]
        if waiting:
            time.sleep(0.5)


class DataParallelService:
    """The replicas and the router: start them, wait until they serve, watch them, stop them."""

    def __init__(self, args: ServerArgs, argv: list[str]) -> None:
        self.args, self.argv = args, argv
        self.replicas: list[Child] = []
        self.router: Child | None = None
        self.gone: set[str] = set()  # replicas already reported dead

    def start_replicas(self) -> None:
        a = self.args
        for i, env in enumerate(replica_devices(a)):
            port = a.port + 1 + i
            proc = subprocess.Popen(
                replica_argv(self.argv, a, port),
                env=dict(os.environ, **env),
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - this launcher runs no threads
            )
            if "CUDA_VISIBLE_DEVICES" not in env and (cores := _cpu_share(i, a.dp_size)) is not None:
                os.sched_setaffinity(proc.pid, cores)  # before it imports torch: its threads inherit it
            self.replicas.append(Child(f"replica-{i}", f"http://127.0.0.1:{port}", proc))
            where = ", ".join(f"{k}={v}" for k, v in env.items())
            logger.info(f"Started replica-{i} (pid {proc.pid}) on port {port} with {where}")

    def start_router(self) -> None:
        proc = subprocess.Popen(
            router_argv(self.args, [r.url for r in self.replicas]),
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - this launcher runs no threads
        )
        self.router = Child("router", f"http://127.0.0.1:{self.args.port}", proc)
        logger.info(f"Started the router (pid {proc.pid}, policy {ROUTER_POLICY}) on port {self.args.port}")

    def check(self, starting: bool = False) -> None:
        """Raise StartupError if the router died, or (while starting) any replica, or (serving) every one."""
        if self.router is not None and self.router.proc.poll() is not None:
            raise StartupError(f"the router exited with code {self.router.proc.returncode}", 1)
        for r in self.replicas:
            if r.proc.poll() is not None and r.name not in self.gone:
                self.gone.add(r.name)
                if starting:
                    raise StartupError(
                        f"{r.name} exited with code {r.proc.returncode} (see its log above)", 1
                    )
                logger.warning(
                    f"{r.name} (pid {r.proc.pid}) exited with code {r.proc.returncode}; "
                    "the router sends its requests to the other replicas"
                )
                self.take_out(r)
        if len(self.gone) == len(self.replicas):
            raise StartupError("every replica exited", 1)

    def take_out(self, replica: Child) -> None:
        """Remove a dead replica from the router at once (its own health checks take seconds, and the
        requests it routes there meanwhile fail)."""
        if self.router is None:
            return
        # with --api-key the router's worker API wants the key too
        auth = {"Authorization": f"Bearer {self.args.api_key}"} if self.args.api_key else {}
        try:
            listing = urllib.request.Request(self.router.url + "/workers", headers=auth)
            with urllib.request.urlopen(listing, timeout=5) as r:
                workers = json.load(r).get("workers", [])
            for w in workers:
                if w.get("url") == replica.url:
                    url = f"{self.router.url}/workers/{w['id']}"
                    urllib.request.urlopen(
                        urllib.request.Request(url, headers=auth, method="DELETE"), timeout=5
                    ).close()
        except (urllib.error.URLError, OSError, ValueError) as e:  # the router's health checks remain
            logger.warning(f"could not take {replica.name} out of the router: {e}")

    def wait_ready(self) -> None:
        _wait_until(self.replicas, "/health", lambda: self.check(starting=True))

    def wait_router(self) -> None:
        assert self.router is not None
        _wait_until([self.router], "/readiness", lambda: self.check(starting=True))

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the router (no new requests), then the replicas; SIGKILL what is left after `timeout`."""
        children = [c for c in [self.router, *self.replicas] if c is not None and c.proc.poll() is None]
        for c in children:
            c.proc.terminate()
        deadline = time.monotonic() + timeout
        for c in children:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning(f"{c.name} did not stop; killing it")
                c.proc.kill()
                c.proc.wait()


def launch_dp(args: ServerArgs, argv: list[str]) -> int:
    """Start the replicas and the router, and block until a signal stops them (exit 0) or the router or
    every replica dies (exit 1); a bad option or model exits 2 before anything starts."""
    signal.signal(signal.SIGTERM, on_launcher_sigterm)
    service = DataParallelService(args, argv)
    code = 0
    try:
        if importlib.util.find_spec("sglang_router") is None:  # before any model work
            raise StartupError("--dp needs SGLang's router: pip install sglang-router (or '.[router]')", 1)
        args, sock = prepare(args)  # the router's port checked, the model resolved once for every replica
        service.args = args
        assert sock is not None
        service.start_replicas()
        service.wait_ready()
        sock.close()  # the router binds it now
        service.start_router()
        service.wait_router()
        urls = " ".join(r.url for r in service.replicas)
        logger.info(
            f"Serving {args.served_model_name} on http://{args.host}:{args.port}/v1 through the router ({urls})"
        )
        while True:
            service.check()
            time.sleep(0.5)
    except StartupError as e:
        logger.error(f"{e}")
        code = e.code
    except (KeyboardInterrupt, StopRequested) as e:
        logger.info(
            f"{'SIGTERM' if isinstance(e, StopRequested) else 'SIGINT'} received; stopping the router and the replicas"
        )
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        service.stop()
        logger.info("All replicas and the router stopped")
    return code
