"""Fixtures and hooks only (shared helpers live in helpers.py): the tiny models and their Hugging Face
references, the default model, and one private temporary directory per run that must end up empty."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import TINY_SPECS, HFReference, Service, build_tiny_model, serving, thinking_model_dir

# A KV leak found by the scheduler's idle integrity check fails loudly in tests.
os.environ.setdefault("MINISGL_STRICT_INTEGRITY", "1")

# Everything a test run writes to the temporary directory (pytest's tmp_path, the services' ZMQ sockets,
# multiprocessing's files, ...) goes into this one directory, set in pytest_configure: its subprocesses
# inherit it through TMPDIR. The run checks that nothing but pytest's own tree is left in it, then removes it.
_RUN_TMP: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _RUN_TMP
    _RUN_TMP = Path(tempfile.mkdtemp(prefix="minisgl-tests-"))
    os.environ["TMPDIR"] = str(_RUN_TMP)
    tempfile.tempdir = str(_RUN_TMP)  # gettempdir() caches its first answer


def pytest_unconfigure(config: pytest.Config) -> None:
    if _RUN_TMP is not None:
        shutil.rmtree(_RUN_TMP, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def nothing_is_left_in_the_temporary_directory() -> Iterator[None]:
    """After the last test: no socket, file or directory that a test or a service created remains."""
    yield
    assert _RUN_TMP is not None
    # pytest's tmp_path tree, and torch's compile cache (importing transformers creates it): both are removed
    # with the directory at the end of the run, like everything else in it
    left = sorted(
        p.name for p in _RUN_TMP.iterdir() if not p.name.startswith(("pytest-of-", "torchinductor_"))
    )
    assert not left, f"the tests left these in the temporary directory {_RUN_TMP}: {left}"


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """name -> directory of a saved tiny random model, for every architecture."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {name: build_tiny_model(spec, str(root / name)) for name, spec in TINY_SPECS.items()}


_HF_REFS: dict[str, HFReference] = {}


@pytest.fixture(scope="session")
def hf_reference(tiny_model_dirs) -> Callable[[str], HFReference]:
    """name -> HFReference of that tiny model (loaded once per session, greedy results memoised)."""

    def get(name: str) -> HFReference:
        if name not in _HF_REFS:
            _HF_REFS[name] = HFReference(tiny_model_dirs[name])
        return _HF_REFS[name]

    return get


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The converted directory of the embedded default model (SmolLM2-135M-Instruct GGUF)."""
    from minisgl.models.resolve import resolve_model_path

    try:
        return resolve_model_path(None)
    except ValueError as e:  # pragma: no cover - the README installs it
        pytest.skip(f"default model not installed: {e}")


THINKING_SERVICE_ARGS = ["--dtype", "float32", "--num-pages", "2048", "--max-seq-len-override", "1024"]


@pytest.fixture(scope="session")
def thinking_model(default_model_dir, tmp_path_factory) -> str:
    """The default model with a Qwen3-style thinking chat template (helpers.THINKING_TEMPLATE)."""
    return thinking_model_dir(default_model_dir, tmp_path_factory.mktemp("thinking_model") / "model")


@pytest.fixture(scope="session")
def shared_service(thinking_model, tmp_path_factory) -> Iterator[Service]:
    """The service on `thinking_model` (the default model), served as "m": one for the tests of the
    tokenizer endpoints, reasoning, the Responses API, prompt log-probabilities and embeddings."""
    args = ["--model", thinking_model, *THINKING_SERVICE_ARGS, "--served-model-name", "m"]
    with serving(args, tmp_path_factory.mktemp("shared_service") / "server.log") as service:
        yield service
