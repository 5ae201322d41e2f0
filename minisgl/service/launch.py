"""The launcher: check the options and the port, resolve the model once (startup.py), spawn the workers
and wait until each is ready (processes.py), then serve (http_server.py).

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

import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import replace

from minisgl.utils import init_logger
from minisgl.utils.net import free_port

from .args import ServerArgs, parse_args
from .processes import ServiceProcesses, WorkerDied
from .startup import StartupError, StopRequested, on_launcher_sigterm, prepare

logger = init_logger(__name__, "launcher")


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


def launch(args: ServerArgs) -> int:
    """Start the whole service and block until it stops. Exit code: 0 after a stop asked for by SIGTERM or
    Ctrl-C, 1 when a worker died or the port is busy, 2 for a bad model path or model."""
    signal.signal(signal.SIGTERM, on_launcher_sigterm)
    try:
        args, sock = prepare(args)
    except StartupError as e:
        logger.error(f"{e}")
        return e.code
    except (KeyboardInterrupt, StopRequested):
        logger.info("Stopped before the service started")
        return 0
    args = replace(args, ipc_dir=tempfile.mkdtemp(prefix="minisgl-"))
    if args.api_server_count > 1:  # each API server counts in files there; /metrics sums them
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(args.ipc_dir, "metrics")
        os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"])
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
            from .http_server import serve_http

            code = serve_http(args, service, sock)
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
