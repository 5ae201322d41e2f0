"""The service with --tp 2 (two scheduler processes over gloo) gives the tokens of the offline TP=1 path,
token for token, for tiny Qwen3 (2 KV heads: split) and Qwen2 (1 KV head: replicated) models, with
concurrent requests and prefill chunked by a 16-token budget."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import TINY_SPECS, build_tiny_model, make_llm, random_prompt, serving, tiny_llm_kwargs

from minisgl.core import SamplingParams

LENGTHS = [3, 17, 40, 26]
MAX_TOKENS = [9, 6, 11, 7]


@pytest.mark.parametrize(("name", "kv_heads"), [("qwen3", 2), ("qwen2", 1)])
def test_service_tp2_equals_offline_tp1(tmp_path, name, kv_heads):
    spec = TINY_SPECS[name]
    spec = dataclasses.replace(spec, config_kwargs={**spec.config_kwargs, "num_key_value_heads": kv_heads})
    model = build_tiny_model(spec, str(tmp_path / name))
    prompts = [random_prompt(n, spec.config_kwargs["vocab_size"], seed=50 + i) for i, n in enumerate(LENGTHS)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    with make_llm(model, **tiny_llm_kwargs()) as llm:
        expected = [o["token_ids"] for o in llm.generate(prompts, params)]
    args = ["--model", model, "--tp", "2", "--dtype", "float32", "--attn", "torch"]
    args += ["--num-pages", "4096", "--max-prefill-length", "16"]
    with serving(args, tmp_path / "server.log") as service:

        def generate(i: int) -> list[int]:
            body = {
                "input_ids": prompts[i],
                "sampling_params": {"max_new_tokens": MAX_TOKENS[i], "temperature": 0, "ignore_eos": True},
            }
            return httpx.post(f"{service.url}/generate", timeout=120, json=body).json()["output_ids"]

        with ThreadPoolExecutor(len(prompts)) as ex:  # concurrent: batched on both ranks
            got = list(ex.map(generate, range(len(prompts))))
    assert got == expected
