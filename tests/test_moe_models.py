"""Mixture-of-experts models equal Hugging Face's greedy output token for token in float32.

Tiny random Qwen3-MoE (a dense layer among the sparse ones, renormalised and raw top-k weights, one KV
head) and Mixtral models, through the torch reference backend and the Triton fused backend (under
TRITON_INTERPRET=1 on a CPU): four prompts of different lengths batched, each prompt alone, and through
the emulated decode and prefill graphs. In a decode step of a few tokens most experts receive no token."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must be set before Triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import (
    MOE_SPECS,
    HFReference,
    assert_all_kv_free,
    assert_tokens_equal_hf,
    build_tiny_model,
    make_llm,
    random_prompt,
    tiny_llm_kwargs,
)

from minisgl.core import SamplingParams

PROMPT_LENS = [5, 19, 33, 2]
MAX_TOKENS = [12, 9, 14, 10]
HAVE_TRITON = True
try:
    import triton  # noqa: F401
except ImportError:
    HAVE_TRITON = False
BACKENDS = ["torch", "fused"] if HAVE_TRITON else ["torch"]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe_models")
    return {name: build_tiny_model(spec, str(root / name)) for name, spec in MOE_SPECS.items()}


_REFS: dict[str, HFReference] = {}


def reference(moe_dirs, name: str) -> HFReference:
    if name not in _REFS:
        _REFS[name] = HFReference(moe_dirs[name])
    return _REFS[name]


def prompts_for(name: str) -> list[list[int]]:
    vocab = MOE_SPECS[name].config_kwargs["vocab_size"]
    return [random_prompt(n, vocab, seed=200 + i) for i, n in enumerate(PROMPT_LENS)]


def params(backend: str = "torch") -> list[SamplingParams]:
    # the Triton interpreter runs each kernel in Python: fewer steps through the fused backend on a CPU
    lens = MAX_TOKENS if backend == "torch" or torch.cuda.is_available() else [n // 2 for n in MAX_TOKENS]
    return [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MOE_SPECS))
def test_moe_model_equals_hf_batched_and_alone(moe_dirs, name, backend):
    prompts = prompts_for(name)
    with make_llm(moe_dirs[name], **tiny_llm_kwargs(moe_backend=backend)) as llm:
        assert type(llm.scheduler.engine.moe_backend).__name__.lower().startswith(backend)
        batched = llm.generate(prompts, params(backend))
        alone = [llm.generate([p], [sp])[0] for p, sp in zip(prompts[:2], params(backend)[:1])]
        assert_all_kv_free(llm)
    ref = reference(moe_dirs, name)
    for prompt, out, sp in zip(prompts, batched, params(backend)):
        assert len(out["token_ids"]) == sp.max_tokens
        assert_tokens_equal_hf(out["token_ids"], ref, prompt, f"{name} {backend} batched")
    for one, out in zip(alone, batched):
        assert one["token_ids"] == out["token_ids"]


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
def test_moe_through_decode_and_prefill_graphs_equals_hf(moe_dirs):
    """The fused backend inside the (emulated on a CPU) decode graphs of 1 and 2 requests and the prefill
    graph of 16 tokens, with Triton attention (the prefill graphs need it) and chunked prefill: Hugging
    Face's greedy tokens."""
    name = "qwen3_moe"
    prompts = prompts_for(name)[1:3]  # 19 and 33 tokens: chunked by 16
    kwargs = tiny_llm_kwargs(
        moe_backend="fused",
        attn="triton",
        page_size=4,
        cuda_graph_max_bs=2,
        cuda_graph_max_prefill=16,
        max_prefill_length=16,
    )
    with make_llm(moe_dirs[name], **kwargs) as llm:
        engine = llm.scheduler.engine
        assert engine.graph_runner is not None and engine.prefill_graphs is not None
        outs = llm.generate(prompts, [SamplingParams(max_tokens=4, ignore_eos=True)] * len(prompts))
        assert engine.graph_runner.replays > 0 and engine.prefill_graphs.replays > 0
    for prompt, out in zip(prompts, outs):
        assert_tokens_equal_hf(out["token_ids"], reference(moe_dirs, name), prompt, "MoE graphs")


def test_expert_parallel_needs_an_moe_model_and_a_divisor(moe_dirs, tiny_model_dirs):
    with (
        pytest.raises(ValueError, match="has no experts"),
        make_llm(tiny_model_dirs["llama"], **tiny_llm_kwargs(ep_size=2)),
    ):
        pass
    with (
        pytest.raises(ValueError, match="must divide the TP size"),
        make_llm(moe_dirs["mixtral"], **tiny_llm_kwargs(ep_size=2)),
    ):
        pass
    with (
        pytest.raises(ValueError, match="moe_backend"),
        make_llm(moe_dirs["mixtral"], **tiny_llm_kwargs(moe_backend="nope")),
    ):
        pass


@pytest.mark.parametrize(
    ("name", "ep"),
    [("qwen3_moe", 1), ("qwen3_moe", 2), ("qwen3_moe_unnormed", 2), ("mixtral", 1), ("mixtral", 2)],
)
def test_moe_tp2_and_ep2_equal_hf(moe_dirs, name, ep):
    """Two real rank processes over gloo, through the torch backend: TP=2 splits each expert's
    intermediate dimension, EP=2 places half of the experts on each rank (one KV head: replicated); both
    give Hugging Face's greedy tokens (and so TP=1's), with chunked prefill."""
    prompts = prompts_for(name)
    kwargs = tiny_llm_kwargs(tp_size=2, ep_size=ep, max_prefill_length=16)
    with make_llm(moe_dirs[name], **kwargs) as llm:
        experts = next(m for m in llm.scheduler.engine.model.modules() if m.__class__.__name__ == "Experts")
        assert (
            experts.num_local
            == MOE_SPECS[name].config_kwargs.get(
                "num_experts", MOE_SPECS[name].config_kwargs.get("num_local_experts")
            )
            // ep
        )
        outs = llm.generate(prompts, params())
    ref = reference(moe_dirs, name)
    for prompt, out in zip(prompts, outs):
        assert_tokens_equal_hf(out["token_ids"], ref, prompt, f"{name} tp=2 ep={ep}")


@pytest.mark.parametrize(
    ("name", "tp", "ep", "message"),
    [("mixtral", 2, 4, "must divide the TP size"), ("mixtral", 8, 8, "exceeds the number of experts")],
)
def test_expert_parallel_sizes_are_refused_before_any_rank_starts(moe_dirs, name, tp, ep, message):
    with (
        pytest.raises(ValueError, match=message),
        make_llm(moe_dirs[name], **tiny_llm_kwargs(tp_size=tp, ep_size=ep)),
    ):
        pass


@pytest.mark.parametrize(
    ("experts", "ep", "ranges"),
    [
        (5, 2, [(0, 3), (3, 2)]),  # the remainder on the first ranks, as vLLM places it
        (6, 4, [(0, 2), (2, 2), (4, 1), (5, 1)]),
        (8, 2, [(0, 4), (4, 4)]),
        (3, 3, [(0, 1), (1, 1), (2, 1)]),
    ],
)
def test_expert_ranges_split_the_experts_with_the_remainder_first(experts, ep, ranges):
    from minisgl.moe.layer import expert_range

    assert [expert_range(experts, ep, r) for r in range(ep)] == ranges


def test_ep2_over_five_experts_places_three_and_two_and_equals_hf(tmp_path):
    """Two real ranks over gloo, EP=2 over 5 experts: rank 0 holds experts 0-2, rank 1 experts 3-4
    (its weights one expert per sparse layer lighter), and the tokens are Hugging Face's."""
    import dataclasses

    spec = MOE_SPECS["qwen3_moe"]
    spec = dataclasses.replace(spec, config_kwargs={**spec.config_kwargs, "num_experts": 5}, seed=9)
    path = build_tiny_model(spec, str(tmp_path / "five_experts"))
    prompts = prompts_for("qwen3_moe")
    with make_llm(path, **tiny_llm_kwargs(tp_size=2, ep_size=2, max_prefill_length=16)) as llm:
        sparse = [m for m in llm.scheduler.engine.model.modules() if m.__class__.__name__ == "Experts"]
        assert [(m.expert_start, m.num_local) for m in sparse] == [(0, 3)] * len(sparse)
        outs = llm.generate(prompts, params())
        weights = [s["memory"]["weights"] for s in llm.rank_states()]
    cfg = spec.config_kwargs
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    one_expert = 3 * hidden * inter * 4  # gate, up and down in float32, whole (TP / EP = 1)
    assert weights[0] - weights[1] == len(sparse) * one_expert
    ref = HFReference(path)
    for prompt, out in zip(prompts, outs):
        assert_tokens_equal_hf(out["token_ids"], ref, prompt, "5 experts over ep=2")
