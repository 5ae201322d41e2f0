"""`python -m minisgl [--model PATH] [--port 1919] [--shell] ...`: serve a model (default: the embedded one)."""

from __future__ import annotations

import signal
import sys


def _stop_while_importing(signum: int, frame: object) -> None:
    raise SystemExit(0)  # the launcher installs its own handler once its imports are done


def main(argv: list[str] | None = None) -> int:
    # importing torch takes seconds: a SIGTERM or Ctrl-C meanwhile stops quietly, with no import traceback
    signal.signal(signal.SIGTERM, _stop_while_importing)
    try:
        from minisgl.service.launch import main as launch_main
    except KeyboardInterrupt:
        return 0
    return launch_main(argv)


if __name__ == "__main__":
    sys.exit(main())
