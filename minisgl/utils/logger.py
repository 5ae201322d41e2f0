"""Process-aware logging: every line says which process wrote it."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator

_CONFIGURED = False


def init_logger(name: str, role: str | None = None) -> logging.Logger:
    """Return a logger; the first call configures the root handler (level from MINISGL_LOG_LEVEL)."""
    global _CONFIGURED
    if not _CONFIGURED:
        level = os.environ.get("MINISGL_LOG_LEVEL", "INFO").upper()
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter(
                "[%(asctime)s %(process)d %(name)s] %(levelname)s %(message)s", datefmt="%H:%M:%S"
            )
        )
        root = logging.getLogger("minisgl")
        root.addHandler(handler)
        root.setLevel(level)
        root.propagate = False
        _CONFIGURED = True
    if not name.startswith("minisgl"):
        name = f"minisgl.{name}"
    if role:
        name = f"{name}:{role}"
    return logging.getLogger(name)


@contextlib.contextmanager
def logged_step(logger: logging.Logger, what: str, detail: str = "", every: float = 5.0) -> Iterator[None]:
    """Log `what` (and `detail`, the first time), a line every `every` seconds while it runs (a first start
    never sits silent), and how long it took."""
    logger.info(f"{what} {detail} ..." if detail else f"{what} ...")
    t0 = time.monotonic()
    done = threading.Event()

    def tick() -> None:
        while not done.wait(every):
            logger.info(f"{what}: still at it ({time.monotonic() - t0:.0f} s)")

    ticker = threading.Thread(target=tick, name="minisgl-step-ticker", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
    logger.info(f"{what}: done in {time.monotonic() - t0:.1f} s")
