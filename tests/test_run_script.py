"""The `./run` script: the totals of `./run test` whatever verbosity the command line adds, and pip's
output condensed into progress lines (references: pytest's own total line, hand-written pip output)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _set_up_venv() -> str | None:
    """The environment `./run test` would use, if its set-up is complete (as in CI); else None."""
    venv = os.environ.get("MINISGL_VENV", ".venv")
    venv_path = Path(venv) if os.path.isabs(venv) else ROOT / venv
    return venv if (venv_path / ".minisgl-test").is_file() else None


COLLECT = ["--collect-only", "-p", "no:cacheprovider", "tests/test_message.py"]


@pytest.fixture(scope="module")
def collected() -> int:
    """pytest's own count of COLLECT (default verbosity), in the environment `./run test` set up."""
    venv = _set_up_venv()
    if venv is None:
        pytest.skip("no environment set up by `./run test` here (CI has one)")
    out = subprocess.run(
        [f"{venv}/bin/python", "-m", "pytest", *COLLECT], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    count = re.search(r"(\d+) tests? collected", out)
    assert count is not None
    return int(count.group(1))


@pytest.mark.parametrize("extra", [[], ["-q"], ["-v"]])
def test_run_test_prints_the_total_whatever_the_verbosity_given(collected, extra):
    cmd = ["./run", "test", *extra, *COLLECT]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
    assert re.search(rf"\b{collected} tests? collected", out.strip().splitlines()[-1])


PIP_OUTPUT = """\
Looking in indexes: https://pypi.org/simple
Collecting msgpack
  Downloading msgpack-1.2.4-cp311-cp311-manylinux2014_x86_64.whl (480 kB)
Collecting typing-extensions
  Downloading typing_extensions-4.15.0-py3-none-any.whl (44 kB)
Requirement already satisfied: numpy in ./venv/lib/python3.11/site-packages (2.3.4)
Installing collected packages: typing-extensions, msgpack, minisgl
Successfully installed minisgl-0.1.0 msgpack-1.2.4 typing-extensions-4.15.0
"""


def test_pip_output_becomes_progress_lines():
    functions = subprocess.run(
        ["sed", "-n", "/^say()/p;/^show_pip()/,/^}/p", "run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    r = subprocess.run(
        ["bash", "-c", f"{functions}\nshow_pip"], input=PIP_OUTPUT, capture_output=True, text=True, check=True
    )
    lines = r.stderr.splitlines()
    assert lines[:3] == [
        "[setup]   downloading msgpack-1.2.4 (480 kB)",
        "[setup]   downloading typing_extensions-4.15.0 (44 kB)",
        "[setup]   installing 3 packages",
    ]
    assert len(lines) == 3  # its time is pip_install's to say, once pip succeeded
