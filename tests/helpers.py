"""Helpers shared by the tests: tiny random models of every supported architecture, the Hugging Face
reference and the token-for-token check against it, one LLM at a time, and the service in a subprocess.

Every equality test compares minisgl with Hugging Face transformers in float32, greedy, token for token.
The tiny models use a large initializer range so that the logits are far from ties."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

# CPU threads for the engines and references these helpers build. On a two-core machine shared with other
# processes, two OpenMP threads wait on each other at every op and run 5-10x slower than one; at these
# model sizes one thread loses little on a quiet machine. MINISGL_TEST_THREADS=0 keeps the engine's choice.
TEST_THREADS = int(os.environ.get("MINISGL_TEST_THREADS", "1"))


def use_test_threads() -> None:
    if TEST_THREADS > 0:
        torch.set_num_threads(TEST_THREADS)


@dataclass(frozen=True)
class TinySpec:
    """A tiny random model: the transformers config class and its (deliberately odd) sizes."""

    name: str
    architecture: str
    config_kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int = 0


# GQA everywhere; head_dim != hidden / heads where the architecture reads head_dim from the config.
TINY_SPECS: dict[str, TinySpec] = {
    spec.name: spec
    for spec in [
        TinySpec(
            "llama",
            "LlamaForCausalLM",
            {
                "vocab_size": 733,
                "hidden_size": 64,
                "intermediate_size": 136,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 24,
                "tie_word_embeddings": True,
            },
            seed=1,
        ),
        TinySpec(
            "llama3_rope",
            "LlamaForCausalLM",
            {
                "vocab_size": 611,
                "hidden_size": 96,
                "intermediate_size": 200,
                "num_hidden_layers": 3,
                "num_attention_heads": 6,
                "num_key_value_heads": 2,
                "head_dim": 20,
                "tie_word_embeddings": False,
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 50000.0,
                    "factor": 4.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            },
            seed=2,
        ),
        TinySpec(
            "qwen2",
            "Qwen2ForCausalLM",
            {
                "vocab_size": 901,
                "hidden_size": 96,
                "intermediate_size": 160,
                "num_hidden_layers": 2,
                "num_attention_heads": 6,
                "num_key_value_heads": 2,
                "tie_word_embeddings": False,
            },
            seed=3,
        ),
        TinySpec(
            "qwen3",
            "Qwen3ForCausalLM",
            {
                "vocab_size": 1000,
                "hidden_size": 64,
                "intermediate_size": 144,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 40,
                "tie_word_embeddings": True,
            },
            seed=4,
        ),
        TinySpec(
            "mistral",
            "MistralForCausalLM",
            {
                "vocab_size": 853,
                "hidden_size": 80,
                "intermediate_size": 152,
                "num_hidden_layers": 2,
                "num_attention_heads": 6,
                "num_key_value_heads": 3,
                "head_dim": 24,
                "tie_word_embeddings": False,
            },
            seed=5,
        ),
    ]
}
ARCH_NAMES = list(TINY_SPECS)

# Mixture-of-experts models, apart from TINY_SPECS (the dense tests stay as they are): odd sizes, a dense
# layer among the sparse ones (mlp_only_layers), top-k 1 of few experts for Mixtral-like routing spread.
MOE_SPECS: dict[str, TinySpec] = {
    spec.name: spec
    for spec in [
        TinySpec(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            {
                "vocab_size": 677,
                "hidden_size": 48,
                "intermediate_size": 88,
                "moe_intermediate_size": 20,
                "num_experts": 6,
                "num_experts_per_tok": 2,
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [1],
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "tie_word_embeddings": False,
            },
            seed=6,
        ),
        TinySpec(
            "qwen3_moe_unnormed",
            "Qwen3MoeForCausalLM",
            {
                "vocab_size": 541,
                "hidden_size": 40,
                "moe_intermediate_size": 28,
                "num_experts": 8,
                "num_experts_per_tok": 3,
                "norm_topk_prob": False,
                "decoder_sparse_step": 1,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 1,
                "head_dim": 12,
                "tie_word_embeddings": True,
            },
            seed=7,
        ),
        TinySpec(
            "mixtral",
            "MixtralForCausalLM",
            {
                "vocab_size": 619,
                "hidden_size": 56,
                "intermediate_size": 36,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 14,
                "tie_word_embeddings": False,
            },
            seed=8,
        ),
    ]
}
TINY_MAX_POSITIONS = 2048


def _config_class(architecture: str):
    import transformers

    return {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
        "MixtralForCausalLM": transformers.MixtralConfig,
    }[architecture]


def build_tiny_model(spec: TinySpec, out_dir: str, max_positions: int = TINY_MAX_POSITIONS) -> str:
    """Build a seeded random model from its transformers config and save it as safetensors."""
    from transformers import AutoModelForCausalLM

    config = _config_class(spec.architecture)(
        initializer_range=0.15,
        rms_norm_eps=1e-6,
        max_position_embeddings=max_positions,
        architectures=[spec.architecture],
        **spec.config_kwargs,
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


class HFReference:
    """A Hugging Face model in float32 and its greedy continuation, recomputed from scratch each step
    (no KV cache: the most direct reading of the model)."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        use_test_threads()
        self._memo: dict[tuple[tuple[int, ...], int], tuple[list[int], list[float]]] = {}

    @torch.no_grad()
    def greedy_with_margins(self, prompt: Sequence[int], n: int) -> tuple[list[int], list[float]]:
        """n greedy tokens (no EOS stop) and, per step, the gap between the two largest logits."""
        key = (tuple(prompt), n)
        if key not in self._memo:
            ids = torch.tensor([list(prompt)], dtype=torch.long)
            tokens: list[int] = []
            margins: list[float] = []
            for _ in range(n):
                logits = self.model(input_ids=ids, use_cache=False).logits[0, -1].float()
                top2 = logits.topk(2).values
                tok = int(logits.argmax())
                tokens.append(tok)
                margins.append(float(top2[0] - top2[1]))
                ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
            self._memo[key] = (tokens, margins)
        return self._memo[key]

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        return self.greedy_with_margins(prompt, n)[0]


# Two float32 implementations may legitimately differ where the top two logits are this close.
TIE_TOLERANCE = 1e-4


def assert_tokens_equal_hf(
    ours: Sequence[int], ref: HFReference, prompt: Sequence[int], what: str = ""
) -> None:
    """minisgl's greedy tokens equal Hugging Face's, token for token; a first difference is excused only
    at an exact float32 near-tie of Hugging Face's top two logits."""
    expected, margins = ref.greedy_with_margins(prompt, len(ours))
    ours = list(ours)
    if ours == expected:
        return
    first = next(i for i, (a, b) in enumerate(zip(ours, expected)) if a != b)
    if margins[first] < TIE_TOLERANCE:
        return
    raise AssertionError(
        f"{what}: minisgl and Hugging Face differ first at generated token {first} "
        f"(ours {ours[first]}, HF {expected[first]}, HF top-2 logit gap {margins[first]:.3g})\n"
        f"ours: {ours}\nHF:   {expected}"
    )


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


def tiny_llm_kwargs(**overrides: Any) -> dict[str, Any]:
    """LLM arguments for a tiny model on a CPU: float32, torch attention, a small pool."""
    kwargs: dict[str, Any] = {
        "dtype": torch.float32,
        "attn": "torch",
        "num_page_override": 4096,
        "max_running_req": 32,
        "show_progress": False,
    }
    kwargs.update(overrides)
    if "page_size" in overrides and "num_page_override" not in overrides:
        kwargs["num_page_override"] = 4096 // overrides["page_size"] + 64
    return kwargs


def shutdown_llm(llm: Any) -> None:
    if llm is not None:
        llm.shutdown()
    gc.collect()


@contextlib.contextmanager
def make_llm(model_path: Any, **kwargs: Any) -> Iterator[Any]:
    """An LLM that is shut down afterwards (only one LLM may live in a process at a time)."""
    from minisgl.llm import LLM

    llm = LLM(model_path, **kwargs)
    use_test_threads()  # the engine set its own thread count
    try:
        yield llm
    finally:
        shutdown_llm(llm)


def assert_all_kv_free(llm: Any) -> None:
    """Idle: every page is free or held by the prefix cache, every request slot is free."""
    sched = llm.scheduler
    assert not sched.has_work, "the scheduler still has work after generate returned"
    sched.check_integrity()
    stats = sched.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    cached = sched.cache.cache.cached_pages
    assert sched.num_free_pages() + cached == sched.num_total_pages, (
        f"{sched.num_free_pages()} free + {cached} cached != {sched.num_total_pages} pages"
    )


# ---- the service in a subprocess ----------------------------------------------------------------------
def free_port(span: int = 4) -> int:
    """A TCP port that was free a moment ago, with the three after it (a --dp service's replicas take
    --port + 1 + i), below the kernel's ephemeral range (minisgl.utils.net says why)."""
    from minisgl.utils.net import free_port as below_ephemeral

    return below_ephemeral(span)


def wait_answering(
    url: str, alive: Callable[[], bool], output: Callable[[], str], timeout: float = 300
) -> None:
    """Block until GET `url` answers 200; raise with the output's tail if the process exits first."""
    import httpx  # the service's extra: the offline tests run without it

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the service exited:\n{output()[-3000:]}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the service did not start:\n{output()[-3000:]}")


class Service:
    """`python -m minisgl` in its own session, logging to a file, with a temporary directory of its own
    (the launcher's socket directory `minisgl-*` lives there), removed by `stop` however the service ended."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - open for the service's whole life
        self.tmp_dir = tempfile.mkdtemp(prefix="minisgl-service-")
        full_env = dict(os.environ, MINISGL_STRICT_INTEGRITY="1", TMPDIR=self.tmp_dir, **(env or {}))
        # one compute thread: on a 2-core machine shared with the test client (and maybe other jobs), two
        # spinning OpenMP threads slow every step down several times
        full_env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minisgl", "--port", str(self.port), *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 300, path: str = "/v1/models") -> None:
        """Block until GET `path` answers; raise with the log's tail if the service exits first."""
        wait_answering(f"{self.url}{path}", lambda: self.proc.poll() is None, self.log_text, timeout)

    def log_text(self) -> str:
        """Everything the service printed so far."""
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def socket_dirs(self) -> list[str]:
        """The launcher's socket directories still in the service's temporary directory."""
        return sorted(n for n in os.listdir(self.tmp_dir) if n.startswith("minisgl-"))

    def workers(self) -> list[psutil.Process]:
        """The launcher's worker processes (and their children)."""
        return psutil.Process(self.proc.pid).children(recursive=True)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the whole process group; the temporary directory goes too."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # never leave anything behind, whatever the test did
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)


@contextlib.contextmanager
def serving(
    args: list[str], log_path: Path, env: dict[str, str] | None = None, ready_path: str = "/v1/models"
) -> Iterator[Service]:
    """A running Service for the `with` block (ready once GET `ready_path` answers), stopped however the
    block ends."""
    service = Service(args, log_path, env)
    try:
        service.wait_ready(path=ready_path)
        yield service
    finally:
        service.stop()


def metrics(url: str) -> dict[str, float]:
    """The service's Prometheus metrics, name (with labels) -> value."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        k: float(v)
        for k, v in re.findall(r"^(minisgl_\w+(?:\{[^}]*\})?) ([-+\d.e]+|NaN)$", text, re.MULTILINE)
    }


def wait_idle(url: str, after_checks: float, timeout: float = 60) -> dict[str, float]:
    """Metrics once the scheduler went idle and ran its integrity check (after `after_checks` earlier ones)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (
            m.get("minisgl_integrity_checks", 0) > after_checks
            and m.get("minisgl_num_requests_running") == 0
            and m.get("minisgl_num_requests_waiting") == 0
        ):
            return m
        assert time.monotonic() < deadline, f"the scheduler never went idle: {m}"
        time.sleep(0.3)


# builds of the C kernels for CPUs with less than this one: (extra compiler flags, CPU flags they need)
CPU_KERNEL_VARIANTS = {
    "256-bit VNNI or AVX2": (("-mno-avx512f",), {"avx2", "fma", "f16c"}),
    "AVX2": (("-march=haswell",), {"avx2", "fma", "f16c", "bmi2", "movbe"}),
    "scalar": (("-march=x86-64",), set()),
}


def cpu_kernel_variant(name: str):
    """The C kernels built as for an older CPU (CPU_KERNEL_VARIANTS; cached like the default build, seconds
    the first time), with their argument types set; skips the test where that build cannot run here."""
    import platform

    import pytest

    from minisgl.kernel import cpu as cpu_kernels

    flags, needs = CPU_KERNEL_VARIANTS[name]
    try:
        with open("/proc/cpuinfo") as f:
            have = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        have = set()
    if platform.machine() not in ("x86_64", "AMD64") or not needs <= have:
        pytest.skip(f"the {name} build does not run here")
    lib = cpu_kernels.load_variant(flags)
    if lib is None:
        pytest.skip("no C compiler")
    return lib


# ---- stored GGUF blocks ------------------------------------------------------------------------------
def random_stored_rows(name: str, n: int, k: int, seed: int) -> torch.Tensor:
    """n rows of k values of GGML type `name` as stored bytes: random quants, scales of about 1/64."""
    import numpy as np

    from minisgl.gguf.blocks import SCALE_OFFSETS, STORED_TYPES, TYPE_IDS

    rng = np.random.default_rng(seed)
    t = TYPE_IDS[name]
    _, qk, nbytes = STORED_TYPES[t]
    if name in ("F16", "BF16", "F32"):
        vals = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32))
        dtype = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}[name]
        return vals.to(dtype).view(torch.uint8).reshape(n, -1).clone()
    blocks = rng.integers(0, 256, size=(n * k // qk, nbytes), dtype=np.uint8)
    for off in SCALE_OFFSETS[name]:
        scales = (rng.standard_normal(blocks.shape[0]) / 64).astype(np.float16)
        blocks[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(n, k // qk * nbytes))


# ---- a reasoning model: the default model with a Qwen3-style chat template ----------------------------
# ChatML as the default model's, with Qwen3's thinking switch (`enable_thinking: false` writes a closed,
# empty block into the prompt) and `open_thinking` (the prompt opens the block: the reply starts inside)
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif open_thinking is defined and open_thinking %}<think>\n{% endif %}{% endif %}"
)


def thinking_model_dir(default_model_dir: str, out_dir: Path) -> str:
    """The default model's files (linked) with THINKING_TEMPLATE as its chat template."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(default_model_dir):
        if name != "chat_template.jinja":
            os.symlink(os.path.join(default_model_dir, name), out_dir / name)
    (out_dir / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return str(out_dir)
