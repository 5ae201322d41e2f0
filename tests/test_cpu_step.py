"""The CPU decode step (engine/cpu_step.py): a decode batch's layers in one C call.

It must compute what the layers compute: the same greedy tokens and the same log-probabilities (up to
float32 rounding) as the layer-by-layer path, which test_models_hf checks against Hugging Face; the
tiny GGUF models of test_gguf_stored run through it against Hugging Face directly. Models it does not
cover (mixture of experts) keep the layers, as does `cpu_decode_step="off"`."""

from __future__ import annotations

import math

import pytest
from helpers import (
    ARCH_NAMES,
    MOE_SPECS,
    TINY_SPECS,
    build_tiny_model,
    make_llm,
    random_prompt,
    tiny_llm_kwargs,
)

from minisgl.core import SamplingParams
from minisgl.kernel import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.decode_step_available(), reason="no AVX2 build of the C kernels"
)

# 1..3 rows take the GEMV path of the stored kernels, 4 and more the panel path; lengths differ so rows
# leave the batch at different steps
PROMPT_LENS = [3, 9, 21, 30, 41]
MAX_TOKENS = [14, 30, 9, 22, 26]


def _run(model_dir: str, vocab: int, mode: str, page_size: int = 1) -> list[dict]:
    prompts = [random_prompt(n, vocab, seed=200 + n) for n in PROMPT_LENS]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=True) for n in MAX_TOKENS]
    kw = tiny_llm_kwargs(attn="cpu", cpu_decode_step=mode, page_size=page_size)
    with make_llm(model_dir, **kw) as llm:
        assert (llm.scheduler.engine.cpu_step is not None) == (mode == "auto")
        return llm.generate(prompts, params)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_step_equals_the_layers(arch, page_size, tiny_model_dirs):
    vocab = TINY_SPECS[arch].config_kwargs["vocab_size"]
    layers = _run(tiny_model_dirs[arch], vocab, "off", page_size)
    step = _run(tiny_model_dirs[arch], vocab, "auto", page_size)
    for a, b, n in zip(layers, step, MAX_TOKENS):
        assert b["token_ids"] == a["token_ids"] and len(b["token_ids"]) == n
        for x, y in zip(a["logprobs"], b["logprobs"]):
            assert math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-5), (arch, x, y)


def test_moe_model_keeps_the_layers(tmp_path):
    spec = next(iter(MOE_SPECS.values()))
    model_dir = build_tiny_model(spec, str(tmp_path / spec.name))
    with make_llm(model_dir, **tiny_llm_kwargs(attn="cpu")) as llm:
        assert llm.scheduler.engine.cpu_step is None
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out[0]["token_ids"]) == 3


def test_torch_attention_keeps_the_layers(tiny_model_dirs):
    with make_llm(tiny_model_dirs[ARCH_NAMES[0]], **tiny_llm_kwargs(attn="torch")) as llm:
        assert llm.scheduler.engine.cpu_step is None


def test_a_layer_class_that_does_not_declare_the_fused_paths_gets_neither(tiny_model_dirs):
    """A subclass of the Llama layer (as a model whose math differs would be) inherits no fast path: the
    C decode step refuses its layers and the Triton layer kernel gets no weights for them; the declared
    classes get both."""
    from minisgl.engine.cpu_step import CpuDecodeStep
    from minisgl.models.llama import CPU_DECODE_STEP, TRITON_LAYER, LlamaDecoderLayer, declares
    from minisgl.models.qwen3 import Qwen3DecoderLayer

    class OtherMath(LlamaDecoderLayer):  # e.g. another activation in forward()
        pass

    for cls in (LlamaDecoderLayer, Qwen3DecoderLayer):
        assert declares(cls.__new__(cls), CPU_DECODE_STEP) and declares(cls.__new__(cls), TRITON_LAYER)
    with make_llm(tiny_model_dirs[ARCH_NAMES[0]], **tiny_llm_kwargs(attn="cpu")) as llm:
        engine = llm.scheduler.engine
        assert engine.cpu_step is not None  # the declared class: the step is on
        layers = engine.model.model.layers
        for layer in layers:
            layer.__class__ = OtherMath
        args = (engine.model, engine.kv_pool, engine.page_table, engine.attn_backend, engine.dtype)
        assert CpuDecodeStep.create(*args) is None
        assert all(layer.layer_weights() is None for layer in layers)
