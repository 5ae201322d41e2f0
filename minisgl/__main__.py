"""`python -m minisgl [--model PATH] [--port 1919] [--shell] ...`: serve a model (default: the embedded one)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from minisgl.service.launch import main as launch_main

    return launch_main(argv)


if __name__ == "__main__":
    sys.exit(main())
