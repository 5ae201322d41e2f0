"""`python -m minisgl --shell`, driven through a pseudo-terminal like a person at a keyboard: streaming
answers, a multi-turn conversation, /reset, Ctrl-C during an answer, /exit, and no process left behind."""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

pytest.importorskip("prompt_toolkit")

# the streamed answer: from the line after the (last) echo of the question to the next prompt; while the
# user types, prompt_toolkit redraws the line followed by blank lines, which this does not match
ANSWER = r"\n(\S[^>]*?)\n>>>"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\x1b[=>]|\r")


class Terminal:
    """A child process on a pty; `expect` reads its screen output (escape codes stripped). The child gets
    a temporary directory of its own (the service's ZMQ sockets live there), removed by `close`."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.tmp_dir = tempfile.mkdtemp(prefix="minisgl-shell-")
        env = dict(env, TMPDIR=self.tmp_dir)
        self.master, slave = pty.openpty()
        # A terminal's foreground job takes Ctrl-C by default. A background job (`pytest ... &`) ignores
        # SIGINT and a child inherits an ignored signal, but not a handled one: handle it while starting.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            self.proc = subprocess.Popen(
                argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True, close_fds=True
            )
        finally:
            signal.signal(signal.SIGINT, previous)
        os.close(slave)
        self.raw = ""
        self.seen = 0  # how much of the text `expect` has consumed

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw)

    def _read(self, timeout: float) -> None:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return
        try:
            data = os.read(self.master, 65536).decode(errors="replace")
        except OSError:  # the child closed the terminal
            return
        if "\x1b[6n" in data:  # prompt_toolkit asks where the cursor is: answer like a terminal would
            os.write(self.master, b"\x1b[1;1R")
        self.raw += data

    def expect(self, pattern: str, timeout: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            m = re.compile(pattern, re.DOTALL).search(self.text, self.seen)
            if m:
                self.seen = m.end()
                return m
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self._read(0.5)
                raise AssertionError(f"{pattern!r} not seen; the screen shows:\n{self.text[-3000:]}")
            self._read(0.2)

    def type(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\r")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        os.close(self.master)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)


def test_shell_streams_a_multi_turn_chat_resets_and_exits_cleanly():
    env = dict(os.environ, OMP_NUM_THREADS="1", TERM="xterm", MINISGL_STRICT_INTEGRITY="1")
    term = Terminal(
        [
            sys.executable,
            "-m",
            "minisgl",
            "--shell",
            "--dtype",
            "float32",
            "--num-pages",
            "2048",
            "--max-seq-len-override",
            "512",
        ],
        env,
    )
    try:
        term.expect(r"/reset clears the conversation", timeout=300)
        term.expect(r">>>")
        workers = psutil.Process(term.proc.pid).children(recursive=True)
        assert len(workers) >= 2  # a scheduler and a tokenizer worker

        term.type("What is the capital of France?")
        answer = term.expect(r"the capital of France\?" + ANSWER).group(1)
        assert "Paris" in answer

        term.type("Which country was my question about?")
        followup = term.expect(r"my question about\?" + ANSWER).group(1)
        assert "France" in followup  # the first turn reached the model

        term.type("/reset")
        term.expect(r"conversation cleared.*?>>>")
        term.type("Which country was my question about?")
        assert "France" not in term.expect(r"my question about\?" + ANSWER).group(1)  # forgotten

        term.type("Write a very long story about a dragon.")
        term.expect(r"about a dragon\.\n\S")  # the answer is streaming
        os.kill(term.proc.pid, signal.SIGINT)  # Ctrl-C
        term.expect(r"\[interrupted\]")
        term.seen = 0  # the scheduler logs to the same terminal, maybe before the shell's "[interrupted]"
        term.expect(r"Aborted request", timeout=30)  # the request was freed

        term.type("/exit")
        assert term.proc.wait(30) == 0
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"processes left behind: {alive}"
        left = [n for n in os.listdir(term.tmp_dir) if n.startswith("minisgl-")]
        assert left == [], left  # the launcher removed its ZMQ sockets and their directory
    finally:
        term.close()
