"""Process-aware logging: every line says which process wrote it."""

from __future__ import annotations

import logging
import os
import sys

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
