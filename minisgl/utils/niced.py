"""A background process at a low priority from its first import on."""

from __future__ import annotations

import importlib
import os
from typing import Any


def run_niced(niceness: int, target: str, *args: Any) -> None:
    """A spawned process's target: lower this process's priority to `niceness` (never raise it), then
    import `target` ("package.module:function") and call it with `args`.

    A function given to multiprocessing as the target is imported while the child unpickles it, at the
    parent's priority, before anything of the child's runs; for a target in a module that imports torch
    that is seconds of CPU on a core the service's processes need. This module imports nothing heavy."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(niceness, os.getpriority(os.PRIO_PROCESS, 0)))
    except OSError:  # not allowed here: it runs at the parent's priority
        pass
    module, name = target.split(":")
    getattr(importlib.import_module(module), name)(*args)
