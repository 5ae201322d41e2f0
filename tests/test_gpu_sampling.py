"""GPU only (`pytest -m gpu tests/test_gpu_sampling.py` on the GPU host): the batched sampling kernel at real
shapes (Qwen3's vocabulary of 151,936, bfloat16 logits, batches of 1, 32 and 256) against its torch
reference token for token, and the decode graphs' sampling graphs against the torch reference sampling
the same graph logits eagerly (tests/test_sampling_kernels.py holds the CPU versions)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import TINY_SPECS, build_tiny_model, make_llm, random_prompt

from minisgl.core import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 151_936
QWEN3_06B = os.path.join(os.path.dirname(__file__), "..", "minisgl", "benchmark", "configs", "qwen3-0.6b")


def _rows(s: int, seed: int):
    """Every filter on and off across the rows, greedy rows, seeded and unseeded rows (on the GPU)."""
    from test_sampling_kernels import _random_rows

    rows = _random_rows(s, VOCAB, seed)
    return rows._replace(**{f: x.cuda() for f, x in rows._asdict().items() if isinstance(x, torch.Tensor)})


@pytest.mark.parametrize("batch", [1, 32, 256])
@pytest.mark.parametrize("kind", ["peaked", "flat", "masked"])
def test_kernel_equals_reference_at_real_shapes(batch, kind):
    """Peaked rows (a trained model's), flat ones (dummy weights': top-p keeps most of the vocabulary),
    and rows most of whose tokens a grammar mask set to -inf."""
    from minisgl.kernel import reference as ref
    from minisgl.kernel import triton as triton_kernels

    g = torch.Generator(device="cuda").manual_seed(batch)
    scale = {"peaked": 4.0, "flat": 0.3, "masked": 2.0}[kind]
    logits = (torch.randn(batch, VOCAB, device="cuda", generator=g) * scale).to(torch.bfloat16)
    if kind == "masked":
        keep = torch.rand(batch, VOCAB, device="cuda", generator=g) < 0.01
        logits = logits.masked_fill(~keep, float("-inf"))
    rows = _rows(batch, seed=batch + len(kind))
    got = triton_kernels.sample(logits, rows)
    want = ref.sample(logits, rows)
    assert got.tolist() == want.tolist()
    greedy = rows.temperature == 0
    assert got[greedy].tolist() == logits[greedy].float().argmax(-1).int().tolist()
    if batch > 1:  # a row's token depends on its own logits and keys only, whatever its place
        perm = torch.randperm(batch, device="cuda", generator=g)
        moved = rows._replace(**{f: getattr(rows, f)[perm] for f in rows._fields[:6]})
        assert triton_kernels.sample(logits[perm].contiguous(), moved).tolist() == got[perm].tolist()


def _generate(model: str, prompts, params, **kwargs):
    with make_llm(model, show_progress=False, **kwargs) as llm:
        outs = [o["token_ids"] for o in llm.generate(prompts, params)]
        llm.scheduler.check_integrity()
        runner = llm.scheduler.engine.graph_runner
        return outs, runner.sample_replays


def _params(n: int, max_tokens: int) -> list[SamplingParams]:
    kinds = [
        {"temperature": 0.6, "top_p": 0.9},
        {"temperature": 1.0, "top_k": 50, "min_p": 0.02},
        {"temperature": 0.8, "top_k": 20, "top_p": 0.95},
        {"temperature": 0.0},
    ]
    return [
        SamplingParams(**kinds[i % 4], max_tokens=max_tokens, ignore_eos=True, seed=1000 + i)
        for i in range(n)
    ]


@pytest.mark.parametrize("model_kind", ["tiny_fp32", "qwen3_06b_bf16"])
def test_sampling_graphs_equal_eager_reference_sampling(tmp_path, model_kind):
    """Seeded requests: the same tokens from the sampling graphs (sampler fused) as from the torch
    reference sampling the decode graph's logits after the replay (sampler torch)."""
    if model_kind == "tiny_fp32":
        spec = TINY_SPECS["qwen3"]
        model, vocab = build_tiny_model(spec, str(tmp_path / "tiny")), spec.config_kwargs["vocab_size"]
        common = {"dtype": torch.float32, "load_format": "auto"}
    else:
        model, vocab, common = QWEN3_06B, 10_000, {"load_format": "dummy"}
    prompts = [random_prompt(8 + 5 * i, vocab, seed=i) for i in range(32)]
    params = _params(len(prompts), 16)
    common.update(num_page_override=8192, max_seq_len_override=1024, cuda_graph_max_bs=32, attn="triton")
    fused, replays = _generate(model, prompts, params, sampler="fused", **common)
    ref, ref_replays = _generate(model, prompts, params, sampler="torch", **common)
    assert replays > 0 and ref_replays == 0
    assert fused == ref
