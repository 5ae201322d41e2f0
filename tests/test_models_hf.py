"""Every supported architecture equals Hugging Face's greedy output token for token in float32.

For each tiny random model (GQA, head_dim != hidden / heads where allowed, tied and untied embeddings,
attention bias, llama3 rope scaling), page sizes 1 and 4 and the torch and cpu attention backends: four prompts of different lengths generated
together equal Hugging Face; each prompt alone equals the batched result; every KV slot is free afterwards.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must be set before Triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import (
    ARCH_NAMES,
    TINY_SPECS,
    HFReference,
    TinySpec,
    assert_all_kv_free,
    assert_tokens_equal_hf,
    build_tiny_model,
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


# Config features the tiny models above leave at their defaults: each equals Hugging Face, or is refused
# with an error that names it. Sizes odd on purpose, GQA throughout.
_SMALL = {"vocab_size": 389, "hidden_size": 48, "intermediate_size": 104, "num_hidden_layers": 2}
_SMALL |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 20}
FEATURE_SPECS = [
    TinySpec("llama_biases", "LlamaForCausalLM", {**_SMALL, "attention_bias": True, "mlp_bias": True}, 11),
    TinySpec("qwen3_bias", "Qwen3ForCausalLM", {**_SMALL, "attention_bias": True}, 12),
    TinySpec(
        "qwen3_yarn",
        "Qwen3ForCausalLM",
        {
            **_SMALL,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
        15,
    ),
]


@pytest.mark.parametrize("spec", FEATURE_SPECS, ids=lambda s: s.name)
def test_config_features_equal_hf(spec, tmp_path):
    """Biases on every projection the config names (Llama's attention_bias and mlp_bias, Qwen3's
    attention_bias on q/k/v and o), and YaRN's rope scaling, equal Hugging Face."""
    model_dir = build_tiny_model(spec, str(tmp_path / spec.name))
    ref = HFReference(model_dir)
    prompts = [random_prompt(n, _SMALL["vocab_size"], seed=200 + i) for i, n in enumerate([9, 30])]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (24, 18)]
    with make_llm(model_dir, **tiny_llm_kwargs(attn=ATTNS[-1], page_size=4)) as llm:
        for prompt, o in zip(prompts, llm.generate(prompts, params)):
            assert_tokens_equal_hf(o["token_ids"], ref, prompt, what=spec.name)


# Sliding windows: one layer full, one sliding (Qwen2's max_window_layers), and Mistral's window on every
# layer; a window of 13 keys, so prompts, chunks, cached prefixes and decodes all reach past it
WINDOW = 13
WINDOW_SPECS = [
    TinySpec(
        "qwen2_window",
        "Qwen2ForCausalLM",
        {**_SMALL, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
        13,
    ),
    TinySpec("mistral_window", "MistralForCausalLM", {**_SMALL, "sliding_window": WINDOW}, 14),
]


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("spec", WINDOW_SPECS, ids=lambda s: s.name)
def test_sliding_window_attention_equals_hf_past_the_window(spec, attn, tmp_path):
    """Each sliding layer's queries see the window's last keys, as Hugging Face's: prompts shorter and
    longer than the window prefilled in chunks of 8 (later chunks' prefixes past the window), decoded past
    it, batched, then a prompt whose cached prefix is longer than the window."""
    model_dir = build_tiny_model(spec, str(tmp_path / spec.name))
    ref = HFReference(model_dir)
    vocab = _SMALL["vocab_size"]
    prompts = [random_prompt(n, vocab, seed=300 + i) for i, n in enumerate([6, 11, 29])]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (30, 17, 9)]
    kwargs = tiny_llm_kwargs(attn=attn, page_size=4, max_prefill_length=8)
    with make_llm(model_dir, **kwargs) as llm:
        assert llm.scheduler.max_seq_len > WINDOW
        for prompt, o in zip(prompts, llm.generate(prompts, params)):
            assert_tokens_equal_hf(o["token_ids"], ref, prompt, what=f"{spec.name} {attn}")
        longer = prompts[2] + random_prompt(5, vocab, seed=310)  # 29 tokens from the radix cache
        before = llm.stats()["cached_prompt_tokens"]
        (o,) = llm.generate([longer], params[2])
        assert llm.stats()["cached_prompt_tokens"] - before == 28  # the pages of 4 under its 29 tokens
        assert_tokens_equal_hf(o["token_ids"], ref, longer, what=f"{spec.name} {attn} cached prefix")


def test_a_checkpoint_tensor_the_config_does_not_announce_is_refused_by_name(tmp_path):
    """A checkpoint with MLP biases whose config.json says mlp_bias false: loading stops and names the
    tensor, where a silent skip would generate from a different model."""
    import json

    spec = TinySpec("llama_biases", "LlamaForCausalLM", {**_SMALL, "mlp_bias": True}, 11)
    model_dir = build_tiny_model(spec, str(tmp_path / "m"))
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "mlp_bias": False}))
    with (
        pytest.raises(ValueError, match=r"mlp\.(gate_up|down)_proj\.bias.*has no place"),
        make_llm(model_dir, **tiny_llm_kwargs()),
    ):
        pass


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 1e4},
    "linear": {"rope_type": "linear", "rope_theta": 1e4, "factor": 3.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn_mscale": {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "truncate": False,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 2.0,
        "attention_factor": 0.75,
        "original_max_position_embeddings": 100,
    },
}


@pytest.mark.parametrize("name", ROPES)
def test_rotary_tables_equal_hugging_face(name):
    """The cos|sin table every backend reads equals Hugging Face's rotary embedding at every position
    (frequencies and YaRN's attention factor), for each supported rope type."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from minisgl.layers.rotary import RotaryEmbedding
    from minisgl.models.config import ModelConfig

    hf = LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rope_parameters=dict(ROPES[name]),
    )
    cfg = ModelConfig.from_hf(hf)
    ours = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
    positions = torch.arange(512)[None]
    cos, sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions)
    half = cfg.head_dim // 2
    torch.testing.assert_close(ours.cos_sin_cache[:, :half], cos[0, :, :half], rtol=0, atol=2e-6)
    torch.testing.assert_close(ours.cos_sin_cache[:, half:], sin[0, :, :half], rtol=0, atol=2e-6)


def test_a_backend_that_does_not_slide_ends_sequences_at_the_window(tmp_path):
    """Triton attention (interpreted on a CPU) has no sliding window: sequences end at the window, within
    which sliding changes nothing, and equal Hugging Face there; a longer prompt is refused naming the
    bound. The torch and cpu backends slide (above)."""
    pytest.importorskip("triton")
    from minisgl.core import InvalidRequest

    spec = WINDOW_SPECS[1]
    model_dir = build_tiny_model(spec, str(tmp_path / spec.name))
    prompt = random_prompt(5, _SMALL["vocab_size"], seed=320)
    params = SamplingParams(max_tokens=WINDOW - 5, ignore_eos=True)
    with make_llm(model_dir, **tiny_llm_kwargs(attn="triton", page_size=4)) as llm:
        assert llm.scheduler.max_seq_len == WINDOW
        (o,) = llm.generate([prompt], params)
        with pytest.raises(InvalidRequest, match=f"maximum sequence length is {WINDOW}"):
            llm.generate([random_prompt(WINDOW, _SMALL["vocab_size"], seed=1)], params)
    assert_tokens_equal_hf(o["token_ids"], HFReference(model_dir), prompt, what="triton within the window")
