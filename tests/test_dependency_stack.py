"""The one-way dependency stack of docs/ARCHITECTURE.md holds: import-linter checks the layers contract in
pyproject.toml ([tool.importlinter]) over every import in minisgl, type-only ones included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

pytest.importorskip("importlinter", reason="import-linter is in the dev extra: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[1]
LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def _lint_imports(config: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on `config` from the repository root (no cache written into the tree)."""
    return subprocess.run(
        [sys.executable, "-c", LINT, "--config", str(config), "--no-cache"],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_no_module_imports_a_module_above_it_in_the_stack():
    r = _lint_imports(ROOT / "pyproject.toml")
    assert r.returncode == 0, f"a lower module imports a higher one:\n{r.stdout}{r.stderr}"
    assert "0 broken" in r.stdout, r.stdout


def test_the_check_sees_the_imports_a_reversed_stack_is_broken(tmp_path):
    """The same contract upside down must fail: the check reads the real import graph."""
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contract = options["contracts"][0]
    lines = [
        "[importlinter]",
        f"root_package = {options['root_package']}",
        "[importlinter:contract:reversed]",
        "name = reversed stack",
        "type = layers",
        "unmatched_ignore_imports_alerting = none",
        "layers =",
        *(f"    {layer}" for layer in reversed(contract["layers"])),
    ]
    config = tmp_path / "reversed.ini"
    config.write_text("\n".join(lines) + "\n")
    r = _lint_imports(config)
    assert r.returncode != 0 and "BROKEN" in r.stdout, r.stdout + r.stderr
