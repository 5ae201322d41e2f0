"""A first start says what it is doing: each slow step logs when it starts, a line every few seconds while
it runs, and how long it took (the default model's preparation, the C kernels' build).

References: the log records themselves, read from a handler on minisgl's logger; the steps are waited for
by events, never by the clock."""

from __future__ import annotations

import logging
import threading

import pytest

from minisgl.utils.logger import init_logger, logged_step


class Records(logging.Handler):
    """Every message minisgl logs while installed; `seen` is set once a message contains `wanted`."""

    def __init__(self, wanted: str = "") -> None:
        super().__init__()
        self.messages: list[str] = []
        self.wanted = wanted
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.messages.append(message)
        if self.wanted and self.wanted in message:
            self.seen.set()


@pytest.fixture
def records():
    init_logger(__name__)  # configures minisgl's logger (it does not propagate to pytest's handlers)
    handler = Records("still at it")
    logging.getLogger("minisgl").addHandler(handler)
    yield handler
    logging.getLogger("minisgl").removeHandler(handler)


def test_a_step_logs_its_start_a_line_while_it_runs_and_its_time(records):
    log = init_logger("tests.first_start")
    with logged_step(log, "Building the thing", "into /tmp/x", every=0.01):
        assert records.seen.wait(60), "no line while the step ran"
    lines = records.messages
    assert lines[0] == "Building the thing into /tmp/x ..."
    assert lines[1].startswith("Building the thing: still at it (")
    assert lines[-1].startswith("Building the thing: done in ")
    assert all("still at it" in m for m in lines[1:-1])


def test_a_step_that_fails_logs_no_time_and_its_ticker_stops(records):
    log = init_logger("tests.first_start")
    with pytest.raises(ValueError), logged_step(log, "Failing", every=0.01):
        assert records.seen.wait(60)
        raise ValueError("bad")
    assert not any("done in" in m for m in records.messages)
    assert not any(t.name == "minisgl-step-ticker" for t in threading.enumerate())


def test_preparing_the_default_model_logs_the_tokenizer_step_from_an_empty_cache(
    records, tmp_path, monkeypatch
):
    from minisgl.models.resolve import resolve_model_path

    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))
    try:
        out = resolve_model_path(None, "stored")
    except ValueError as e:  # pragma: no cover - ./run installs it
        pytest.skip(f"default model not installed: {e}")
    assert out.startswith(str(tmp_path))
    lines = records.messages
    first = next(i for i, m in enumerate(lines) if m.startswith("Preparing "))
    assert "first start only" in lines[first] and out in lines[first]
    assert lines[first + 1] == "Reading the tokenizer from the GGUF file (transformers) ..."
    assert lines[-1].startswith("Reading the tokenizer from the GGUF file (transformers): done in ")
    records.messages.clear()
    assert resolve_model_path(None, "stored") == out  # a second start finds it and says nothing
    assert records.messages == []
