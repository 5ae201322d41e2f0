"""On a CUDA device: the fast path (triton attention + CUDA graphs + overlap scheduling) gives the same
greedy tokens as the reference path (torch attention, no graphs, no overlap)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import TINY_SPECS, build_tiny_model, make_llm, random_prompt

from minisgl.core import SamplingParams

pytestmark = pytest.mark.gpu

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "minisgl", "benchmark", "configs")


def _run(model: str, prompts, n: int, **kwargs):
    params = SamplingParams(max_tokens=n, ignore_eos=True, logprobs=True, top_logprobs=2)
    with make_llm(model, show_progress=False, **kwargs) as llm:
        outs = llm.generate(prompts, params)
        llm.scheduler.check_integrity()
        graphs = llm.scheduler.engine.prefill_graphs
        assert (graphs is not None and graphs.replays > 0) == (kwargs.get("cuda_graph_max_bs") != 0)
    return outs


def _assert_same_greedy(fast, ref, tie: float) -> None:
    """Token for token, except that a first difference is allowed where the reference's top two
    log-probabilities are within `tie` (a legitimate rounding tie-break)."""
    bad = []
    for i, (f, r) in enumerate(zip(fast, ref)):
        if f["token_ids"] == r["token_ids"]:
            continue
        j = next(k for k, (a, b) in enumerate(zip(f["token_ids"], r["token_ids"])) if a != b)
        (_, lp1), (_, lp2) = r["top_logprobs"][j][:2]
        (_, fp1), (_, fp2) = f["top_logprobs"][j][:2]
        if lp1 - lp2 >= tie:
            bad.append(
                f"prompt {i}: first difference at token {j}, reference top-2 gap {lp1 - lp2:.3g}, "
                f"fast path top-2 gap {fp1 - fp2:.3g}"
            )
    assert not bad, "\n".join(bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_path_equals_reference_tiny_fp32(tmp_path):
    spec = TINY_SPECS["qwen3"] if "qwen3" in TINY_SPECS else next(iter(TINY_SPECS.values()))
    model = build_tiny_model(spec, str(tmp_path / "tiny"))
    vocab = spec.config_kwargs["vocab_size"]
    prompts = [random_prompt(n, vocab, seed=n) for n in (3, 17, 64, 130, 5, 33, 250, 8)]
    common = {"dtype": torch.float32, "num_page_override": 8192, "max_seq_len_override": 1024}
    ref = _run(model, prompts, 32, attn="torch", cuda_graph_max_bs=0, overlap=False, **common)
    for page_size in (1, 16):
        fast = _run(
            model,
            prompts,
            32,
            attn="triton",
            cuda_graph_max_bs=16,
            overlap=True,
            page_size=page_size,
            **common,
        )
        _assert_same_greedy(fast, ref, tie=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_path_equals_reference_qwen3_06b_bf16():
    model = os.path.join(CONFIGS, "qwen3-0.6b")
    prompts = [random_prompt(n, 151936, seed=n) for n in (7, 20, 64, 100, 3, 300, 33, 512)]
    common = {
        "dtype": torch.bfloat16,
        "load_format": "dummy",
        "num_page_override": 16384,
        "max_seq_len_override": 2048,
    }
    ref = _run(model, prompts, 32, attn="torch", cuda_graph_max_bs=0, overlap=False, **common)
    fast = _run(model, prompts, 32, attn="triton", cuda_graph_max_bs=16, overlap=True, **common)
    # bf16 logits of these random weights are tens in size, so one bf16 rounding step is 0.06-0.25: two
    # attention kernels that round differently may swap tokens whose top-2 gap is within a few such steps
    # (a 1e-3 criterion is below bf16 resolution here). Measured first differences: gaps 0.03-0.31.
    _assert_same_greedy(fast, ref, tie=0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_path_equals_reference_one_request_at_a_time_qwen3_06b_bf16():
    """Batch size 1 (W2's shape): decode through the GEMVs, with the attention's split merge inside the
    output projection, gives the reference path's greedy tokens (bf16 near-ties allowed as above)."""
    model = os.path.join(CONFIGS, "qwen3-0.6b")
    prompts = [random_prompt(n, 151936, seed=n) for n in (128, 700)]
    common = {
        "dtype": torch.bfloat16,
        "load_format": "dummy",
        "num_page_override": 4096,
        "max_seq_len_override": 2048,
        "max_running_req": 1,
    }
    ref = _run(model, prompts, 32, attn="torch", cuda_graph_max_bs=0, overlap=False, **common)
    fast = _run(model, prompts, 32, attn="triton", cuda_graph_max_bs=1, overlap=True, **common)
    _assert_same_greedy(fast, ref, tie=0.5)


def _batch_prompts(batch: int, vocab: int) -> list[list[int]]:
    """batch prompts: one of 4,200 tokens (its context passes 4,096), the others 3-300 tokens."""
    lens = [4200] + [3 + (37 * i) % 298 for i in range(batch - 1)]
    return [random_prompt(n, vocab, seed=1000 + i) for i, n in enumerate(lens)]


def _assert_batch_fast_equals_reference(model: str, vocab: int, batch: int, tie: float, **common) -> None:
    """_batch_prompts(batch) through the reference path (torch attention, no graphs, no overlap) and the
    fast path at page sizes 1 and 16, all requests running at once: the same greedy tokens up to `tie`."""
    prompts = _batch_prompts(batch, vocab)
    common.update(max_seq_len_override=4400, max_running_req=batch)
    ref = _run(
        model,
        prompts,
        24,
        attn="torch",
        cuda_graph_max_bs=0,
        overlap=False,
        num_page_override=120_000,
        **common,
    )
    for page_size in (1, 16):
        fast = _run(
            model,
            prompts,
            24,
            attn="triton",
            cuda_graph_max_bs=256,
            overlap=True,
            page_size=page_size,
            num_page_override=120_000 // page_size + batch,
            **common,
        )
        _assert_same_greedy(fast, ref, tie=tie)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 32, 256])
def test_fast_path_equals_reference_at_batch_1_32_256_past_4096_keys_tiny_fp32(tmp_path, batch):
    """Decode batches of 1, 32 and 256 requests (the decode tiles of one request and of a batch), page
    sizes 1 and 16, one request past 4,096 tokens of context: the fast path's greedy tokens equal the
    reference path's in float32 (a first difference only at a float32 near-tie)."""
    spec = TINY_SPECS["qwen3"] if "qwen3" in TINY_SPECS else next(iter(TINY_SPECS.values()))
    model = build_tiny_model(spec, str(tmp_path / "tiny"), max_positions=8192)
    _assert_batch_fast_equals_reference(
        model, spec.config_kwargs["vocab_size"], batch, 1e-4, dtype=torch.float32
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [32, 256])
def test_fast_path_equals_reference_at_batch_32_256_past_4096_keys_qwen3_06b_bf16(batch):
    """As above with Qwen3-0.6B shapes in bf16 (8 KV heads: at 256 requests the decode runs in one split),
    page sizes 1 and 16; a first difference is allowed at a bf16 near-tie, as in the tests above."""
    model = os.path.join(CONFIGS, "qwen3-0.6b")
    _assert_batch_fast_equals_reference(model, 151936, batch, 0.5, dtype=torch.bfloat16, load_format="dummy")


def _shape_config(name: str, out_dir, **overrides) -> str:
    """A shipped shape config with some fields changed (fewer layers), written to out_dir."""
    import json

    with open(os.path.join(CONFIGS, name, "config.json")) as f:
        config = json.load(f)
    config.update(overrides)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return str(out_dir)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_fast_path_equals_reference_moe_bf16(tmp_path, name):
    """Qwen3-30B-A3B and Mixtral-8x7B shapes with 4 layers: the fused MoE kernels inside CUDA graphs (with
    Triton attention and overlap) give the torch reference path's greedy tokens (bf16 near-ties allowed
    as above)."""
    model = _shape_config(name, tmp_path / name, num_hidden_layers=4)
    vocab = 151936 if name.startswith("qwen3") else 32000
    prompts = [random_prompt(n, vocab, seed=n) for n in (7, 20, 64, 100, 3, 300, 33, 512)]
    common = {
        "dtype": torch.bfloat16,
        "load_format": "dummy",
        "num_page_override": 16384,
        "max_seq_len_override": 2048,
    }
    ref = _run(
        model, prompts, 32, attn="torch", moe_backend="torch", cuda_graph_max_bs=0, overlap=False, **common
    )
    fast = _run(
        model, prompts, 32, attn="triton", moe_backend="fused", cuda_graph_max_bs=16, overlap=True, **common
    )
    _assert_same_greedy(fast, ref, tie=0.5)
