"""--kv-cache-dtype fp8_e4m3: a float8 K/V pool (one byte a value). The kernels' side is in
tests/test_triton_kernels.py (the pool holds the rounded values, attention reads them upcast); here the
option's checks and a whole model on the torch backend against Hugging Face in float32."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_SPECS, make_llm, random_prompt, tiny_llm_kwargs

from minisgl.core import SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.utils.options import OptionError

FP8_MARGIN = 0.05  # logits: a top-two gap this small may flip under K/V rounded to 3 mantissa bits


def test_fp8_with_the_cpu_backend_is_refused_naming_the_option(tiny_model_dirs):
    with pytest.raises(OptionError, match="kv_cache_dtype"):
        EngineConfig(attn="cpu", kv_cache_dtype="fp8_e4m3")
    kwargs = tiny_llm_kwargs(attn="auto", kv_cache_dtype="fp8_e4m3")
    with (
        pytest.raises(
            ValueError,
            match="--kv-cache-dtype fp8_e4m3 needs an attention backend that reads float8 K/V .*; cpu does not",
        ),
        make_llm(tiny_model_dirs["llama"], **kwargs),
    ):
        pass


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_fp8_pool_gives_hugging_faces_greedy_tokens_up_to_near_ties(name, tiny_model_dirs, hf_reference):
    """The pool is float8 and a quarter of float32's bytes a page; the greedy tokens equal HF's (float32
    K/V) until a step whose top two logits lie within FP8_MARGIN."""
    vocab = TINY_SPECS[name].config_kwargs["vocab_size"]
    prompts = [random_prompt(n, vocab, seed) for n, seed in [(17, 1), (6, 2), (33, 3), (9, 4), (25, 5)]]
    with make_llm(tiny_model_dirs[name], **tiny_llm_kwargs(kv_cache_dtype="fp8_e4m3")) as llm:
        engine = llm.scheduler.engine
        assert engine.kv_pool.k_buffer.dtype == torch.float8_e4m3fn
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        used = engine.kv_pool.k_buffer[0, :40].float()
        assert used.abs().sum() > 0 and torch.isfinite(used).all()
    ref = hf_reference(name)
    compared = 0
    for prompt, out in zip(prompts, outs):
        expected, margins = ref.greedy_with_margins(prompt, 8)
        for ours, want, margin in zip(out["token_ids"], expected, margins):
            if margin < FP8_MARGIN:
                break
            assert ours == want, (prompt, out["token_ids"], expected)
            compared += 1
    assert compared >= 8  # the check did compare tokens
