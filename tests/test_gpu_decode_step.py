"""On a Hopper GPU with nvcc: the one-kernel decode step (kernel/step_kernel.py) gives the greedy tokens of
the reference path (torch attention, no graphs, no overlap), and tiny float32 models give Hugging Face's.
Each test counts the step kernel's launches, so a test cannot pass with the kernel silently off."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from helpers import TINY_SPECS, assert_tokens_equal_hf, build_tiny_model, make_llm, random_prompt

from minisgl import kernel
from minisgl.core import SamplingParams
from minisgl.kernel import step_kernel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not step_kernel.buildable(torch.device("cuda", 0)),
        reason="needs a Hopper GPU and nvcc",
    ),
]

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "minisgl", "benchmark", "configs")


def _count_step_calls(monkeypatch) -> list[int]:
    """A list that grows by the batch size at every kernel.decode_step call (eager steps and graph
    captures)."""
    calls: list[int] = []
    real = kernel.decode_step
    monkeypatch.setattr(
        kernel, "decode_step", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw)
    )
    return calls


@pytest.fixture
def step_launches(monkeypatch) -> list[int]:
    """Switches the kernel on (MINISGL_DECODE_STEP=1) and counts kernel.decode_step calls."""
    monkeypatch.setenv("MINISGL_DECODE_STEP", "1")
    return _count_step_calls(monkeypatch)


def _generate(model: str, prompts, params, **kwargs):
    with make_llm(model, show_progress=False, **kwargs) as llm:
        outs = llm.generate(prompts, params)
        llm.scheduler.check_integrity()
    return outs


def _generate_fast(model: str, prompts, params, page_size: int, pool_tokens: int, **kwargs):
    """The fast path: Triton attention, decode graphs of up to 8 requests, overlap, a pool of pool_tokens
    in pages of page_size."""
    pages = pool_tokens // page_size
    return _generate(
        model,
        prompts,
        params,
        attn="triton",
        cuda_graph_max_bs=8,
        overlap=True,
        page_size=page_size,
        num_page_override=pages,
        **kwargs,
    )


def _assert_same_greedy(fast, ref, tie: float) -> None:
    """Token for token, except a first difference where the reference's top two log-probabilities are
    within `tie` (bf16 rounding ties, as in test_gpu_e2e)."""
    for i, (f, r) in enumerate(zip(fast, ref)):
        if f["token_ids"] == r["token_ids"]:
            continue
        j = next(k for k, (a, b) in enumerate(zip(f["token_ids"], r["token_ids"])) if a != b)
        (_, lp1), (_, lp2) = r["top_logprobs"][j][:2]
        assert lp1 - lp2 < tie, (
            f"prompt {i}: first difference at token {j}, reference top-2 gap {lp1 - lp2:.3g}"
        )


def _assert_fp32_equals_hf(model: str, ref, prompts, what: str, batch: int = 1, **kwargs) -> None:
    """Greedy tokens, float32, through the decode graphs: ref's (HF's). batch 1: 8 tokens a prompt, one
    request at a time; more: up to `batch` at once, prompt i asking for 3 + 2 i tokens, so the batch
    shrinks as requests finish."""
    common = {
        "dtype": torch.float32,
        "attn": "triton",
        "cuda_graph_max_bs": batch,
        "max_running_req": batch,
        "num_page_override": 2048,
        "max_seq_len_override": 512,
    }
    if batch == 1:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
    else:
        params = [SamplingParams(max_tokens=3 + 2 * i, ignore_eos=True) for i in range(len(prompts))]
    outs = _generate(model, prompts, params, **common, **kwargs)
    for prompt, out in zip(prompts, outs):
        assert_tokens_equal_hf(out["token_ids"], ref, prompt, what)


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_step_equals_reference_one_request_qwen3_06b_bf16(page_size, step_launches):
    """Qwen3-0.6B shapes in bf16, one request at a time (every decode step one kernel), one prompt's
    context past 4,096 keys, page sizes 1 and 16: the reference path's greedy tokens."""
    model = os.path.join(CONFIGS, "qwen3-0.6b")
    prompts = [random_prompt(n, 151936, seed=n) for n in (128, 700, 4200)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=True, top_logprobs=2)
    common = {
        "dtype": torch.bfloat16,
        "load_format": "dummy",
        "max_seq_len_override": 4400,
        "max_running_req": 1,
    }
    ref = _generate(model, prompts, params, attn="torch", cuda_graph_max_bs=0, overlap=False, **common)
    assert not step_launches
    fast = _generate_fast(model, prompts, params, page_size, 20_000, **common)
    assert step_launches
    _assert_same_greedy(fast, ref, tie=0.5)


@pytest.mark.parametrize(
    "name,page_size,served",
    [("qwen3-0.6b", 1, {1, 2, 4, 8}), ("qwen3-0.6b", 16, {1, 2, 4, 8}), ("llama-3.2-1b", 16, {1, 2, 4})],
)
def test_decode_step_in_batches_shrinking_from_8_to_1_bf16(name, page_size, served, step_launches):
    """Eight requests at once, each asking for a different number of tokens, so the decode batch shrinks
    from 8 to 1 (graphs of 1, 2, 4 and 8 requests, with padding rows), one context past 4,096 keys, page
    sizes 1 and 16: the reference path's greedy tokens. Qwen3-0.6B's shapes are served at every size;
    Llama-3.2-1B's input rows (8,192 wide) leave too little weight ring at 8, where its layers run."""
    model = os.path.join(CONFIGS, name)
    vocab = 151936 if name.startswith("qwen") else 128256
    prompts = [random_prompt(n, vocab, seed=50 + n) for n in (9, 40, 4200, 300, 17, 64, 250, 5)]
    params = [
        SamplingParams(max_tokens=4 + 4 * i, ignore_eos=True, logprobs=True, top_logprobs=2) for i in range(8)
    ]
    common = {
        "dtype": torch.bfloat16,
        "load_format": "dummy",
        "max_running_req": 8,
        "max_seq_len_override": 4400,
    }
    ref = _generate(model, prompts, params, attn="torch", cuda_graph_max_bs=0, overlap=False, **common)
    fast = _generate_fast(model, prompts, params, page_size, 40_000, **common)
    assert set(step_launches) == served, step_launches
    _assert_same_greedy(fast, ref, tie=0.5)


def test_decode_step_auto_times_both_ways_and_keeps_the_faster(monkeypatch):
    """MINISGL_DECODE_STEP unset (auto): the decode graphs of 1 and 2 requests are each captured both ways
    and timed; the faster is kept and the backend plans it from then on; the greedy tokens are the
    reference path's."""
    monkeypatch.delenv("MINISGL_DECODE_STEP", raising=False)
    calls = _count_step_calls(monkeypatch)
    model = os.path.join(CONFIGS, "qwen3-0.6b")
    prompts = [random_prompt(n, 151936, seed=70 + n) for n in (12, 300)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=True, top_logprobs=2)
    common = {
        "dtype": torch.bfloat16,
        "load_format": "dummy",
        "max_running_req": 2,
        "max_seq_len_override": 1024,
    }
    ref = _generate(model, prompts, params, attn="torch", cuda_graph_max_bs=0, overlap=False, **common)
    assert not calls
    with make_llm(model, show_progress=False, attn="triton", cuda_graph_max_bs=2, **common) as llm:
        engine = llm.scheduler.engine
        timed = engine.graph_runner.whole_step_ms
        assert set(timed) == {1, 2}, timed
        assert set(calls) == {1, 2}, "the one-kernel step was not captured at both sizes"
        for size, ms in timed.items():
            assert set(ms) == {True, False} and all(0.0 < t < 100.0 for t in ms.values()), ms
            assert (size in engine.attn_backend.step_sizes) == (ms[True] < ms[False])
        assert not engine.attn_backend.whole_step_undecided & {1, 2}
        fast = llm.generate(prompts, params)
    _assert_same_greedy(fast, ref, tie=0.5)


@pytest.mark.parametrize("arch", ["llama", "llama3_rope", "qwen2", "qwen3"])
def test_decode_step_tiny_fp32_equals_hf(arch, tmp_path, step_launches):
    """Tiny float32 models with 64-dim heads (the kernel serves 64 and 128): Llama with a tied head, Llama
    3 rope scaling with an untied one, Qwen2 (QKV bias, a GQA group of 3), Qwen3 (q/k norm, tied), one
    request at a time through the decode graph, page size 1 and 4: Hugging Face's greedy tokens."""
    from helpers import HFReference

    spec = TINY_SPECS[arch]
    overrides = {"head_dim": 64}
    if arch == "qwen2":  # Qwen2 takes head_dim as hidden / heads
        overrides["hidden_size"] = 64 * spec.config_kwargs["num_attention_heads"]
    spec = dataclasses.replace(spec, config_kwargs={**spec.config_kwargs, **overrides})
    model = build_tiny_model(spec, str(tmp_path / arch))
    ref = HFReference(model)
    vocab = spec.config_kwargs["vocab_size"]
    prompts = [random_prompt(n, vocab, seed) for n, seed in [(21, 4), (6, 5), (90, 6)]]
    for page_size in (1, 4):
        _assert_fp32_equals_hf(
            model, ref, prompts, f"the decode-step kernel, page size {page_size}", page_size=page_size
        )
    assert step_launches
    # eight at once, the batch shrinking to one: every request's tokens still Hugging Face's
    prompts = [random_prompt(n, vocab, seed) for n, seed in [(21, 4), (6, 5), (90, 6), (3, 7), (40, 8)] * 2]
    del step_launches[:]
    _assert_fp32_equals_hf(model, ref, prompts[:8], "the decode-step kernel, batches of 1-8", batch=8)
    assert {1, 2, 4, 8} <= set(step_launches), step_launches


def test_decode_step_many_small_layers_fp32_equals_hf(tmp_path, step_launches):
    """A float32 Llama of 24 layers small enough that four weight stages fit in a block's ring at once (hidden
    512): the copy warp takes each ring slot's last stage back before reusing the slot (it once lost that
    stage's bytes, and the ring filled up over the layers until the kernel trapped). Hugging Face's greedy
    tokens, one request at a time, then up to eight at once: there the smaller ring (the batch's input rows
    take more of the shared memory) has chunks that end exactly at the ring's end, after which the copy warp
    once placed the next chunk past it, over the input rows."""
    from helpers import HFReference

    spec = dataclasses.replace(
        TINY_SPECS["llama"],
        config_kwargs={
            **TINY_SPECS["llama"].config_kwargs,
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 24,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 64,
        },
    )
    model = build_tiny_model(spec, str(tmp_path / "llama24"))
    ref = HFReference(model)
    prompts = [random_prompt(n, spec.config_kwargs["vocab_size"], seed) for n, seed in [(33, 7), (120, 8)]]
    _assert_fp32_equals_hf(model, ref, prompts, "the decode-step kernel, 24 small layers")
    assert step_launches
    prompts = [
        random_prompt(n, spec.config_kwargs["vocab_size"], seed)
        for n, seed in zip(range(5, 85, 10), range(8))
    ]
    del step_launches[:]
    _assert_fp32_equals_hf(model, ref, prompts, "the decode-step kernel, 24 small layers, batches", batch=8)
    assert 8 in step_launches, step_launches
