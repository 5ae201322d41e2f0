"""A target for minisgl.utils.niced.run_niced in the tests: what this module found when a spawned process
imported it (its priority then, and whether torch was loaded before it), reported over a pipe."""

import os
import sys

PRIORITY_AT_IMPORT = os.getpriority(os.PRIO_PROCESS, 0)
TORCH_BEFORE = "torch" in sys.modules


def report(conn) -> None:
    conn.send((PRIORITY_AT_IMPORT, TORCH_BEFORE, os.getpriority(os.PRIO_PROCESS, 0)))
    conn.close()
