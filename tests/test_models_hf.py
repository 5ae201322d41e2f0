"""Every supported architecture equals Hugging Face's greedy output token for token in float32.

For each tiny random model (GQA, head_dim != hidden / heads where allowed, tied and untied embeddings,
attention bias, llama3 rope scaling), page sizes 1 and 4 and the torch and cpu attention backends: four prompts of different lengths generated
together equal Hugging Face; each prompt alone equals the batched result; every KV slot is free afterwards.
"""

from __future__ import annotations

import pytest
from helpers import (
    ARCH_NAMES,
    TINY_SPECS,
    assert_all_kv_free,
    assert_tokens_equal_hf,
    make_llm,
    random_prompt,
    tiny_llm_kwargs,
)

from minisgl.core import SamplingParams
from minisgl.kernel import cpu as cpu_kernels

PROMPT_LENS = [5, 17, 33, 60]
# Different lengths: shorter requests leave the batch while the others keep decoding.
MAX_TOKENS = [40, 32, 48, 36]


def prompts_for(arch: str):
    vocab = TINY_SPECS[arch].config_kwargs["vocab_size"]
    return [random_prompt(n, vocab, seed=100 + i) for i, n in enumerate(PROMPT_LENS)]


def params_for():
    return [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


# the reference torch backend and, where its C kernel builds, the cpu backend (the default on CPUs)
ATTNS = ["torch", "cpu"] if cpu_kernels.available() else ["torch"]


@pytest.fixture(
    scope="module",
    params=[(a, ps, attn) for a in ARCH_NAMES for ps in (1, 4) for attn in ATTNS],
    ids=lambda p: f"{p[0]}-page{p[1]}-{p[2]}",
)
def arch_llm(request, tiny_model_dirs):
    arch, page_size, attn = request.param
    with make_llm(tiny_model_dirs[arch], **tiny_llm_kwargs(page_size=page_size, attn=attn)) as llm:
        yield arch, llm


def test_batched_prompts_equal_hf_greedy(arch_llm, hf_reference):
    arch, llm = arch_llm
    prompts = prompts_for(arch)
    outs = llm.generate(prompts, params_for())
    ref = hf_reference(arch)
    for prompt, out, n in zip(prompts, outs, MAX_TOKENS):
        assert len(out["token_ids"]) == n
        assert out["finish_reason"] == "length"
        assert_tokens_equal_hf(out["token_ids"], ref, prompt, what=f"{arch}, prompt of {len(prompt)} tokens")
    assert_all_kv_free(llm)


def test_each_prompt_alone_equals_batched(arch_llm):
    arch, llm = arch_llm
    prompts = prompts_for(arch)
    batched = llm.generate(prompts, params_for())
    for prompt, params, together in zip(prompts, params_for(), batched):
        alone = llm.generate([prompt], params)[0]
        assert alone["token_ids"] == together["token_ids"], f"{arch}: prompt of {len(prompt)} tokens"
    assert_all_kv_free(llm)


def test_prompt_served_from_cache_equals_computed(arch_llm):
    """Running the same prompts twice: the second run reads each prompt's page-aligned prefix from the
    radix cache (a hand count) and attends over it (extend), with the same tokens as the first run."""
    arch, llm = arch_llm
    ps = llm.scheduler.page_size
    prompts = prompts_for(arch)
    first = llm.generate(prompts, params_for())
    before = llm.stats()
    second = llm.generate(prompts, params_for())
    after = llm.stats()
    delta = {
        k: after[k] - before[k] for k in ("prompt_tokens", "cached_prompt_tokens", "computed_prompt_tokens")
    }
    assert delta["prompt_tokens"] == sum(PROMPT_LENS)
    # at least one prompt token is always computed, so the cached part stops at the last full page before it
    assert delta["cached_prompt_tokens"] == sum((n - 1) // ps * ps for n in PROMPT_LENS)
    assert delta["cached_prompt_tokens"] + delta["computed_prompt_tokens"] == delta["prompt_tokens"]
    assert [o["token_ids"] for o in second] == [o["token_ids"] for o in first]
    assert_all_kv_free(llm)
