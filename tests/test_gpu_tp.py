"""GPU only (`pytest -m gpu tests/test_gpu_tp.py` on the GPU host): a one-rank NCCL group runs the
collectives the parallel layers use (the all-reduce of row-parallel linears and the vocab-parallel
embedding, the all-gather of the LM head's logits) and the CPU-side coordination, against torch's result."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import free_port

from minisgl.distributed import (
    all_gather_last_dim,
    all_gather_object,
    all_reduce,
    all_reduce_min,
    broadcast_object,
    destroy_process_group,
    init_process_group,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_one_rank_nccl_group_runs_the_layers_collectives_like_torch():
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    init_process_group(0, 1, f"tcp://127.0.0.1:{free_port()}", device, timeout=120, force=True)
    try:
        assert dist.get_backend() == "nccl"
        g = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(5, 256, device="cuda", generator=g).to(torch.bfloat16)
        summed = all_reduce(hidden.clone())  # in place, as the layers call it
        torch.testing.assert_close(summed, hidden, rtol=0, atol=0)  # one rank: the sum is its input
        logits = torch.randn(3, 1, 1003, device="cuda", generator=g)
        gathered = all_gather_last_dim(logits[..., :1003])
        torch.testing.assert_close(gathered, torch.cat([logits], dim=-1), rtol=0, atol=0)
        torch.cuda.synchronize()
        assert broadcast_object({"step": 1}) == {"step": 1}
        assert all_gather_object(7) == [7]
        assert all_reduce_min(12345) == 12345
    finally:
        destroy_process_group()
    assert not dist.is_initialized()


def test_tp1_forms_no_process_group_on_a_gpu():
    import tempfile

    from helpers import TINY_SPECS, build_tiny_model, make_llm

    with tempfile.TemporaryDirectory() as d:
        path = build_tiny_model(TINY_SPECS["qwen3"], d)
        with make_llm(path, device="cuda", num_page_override=256, show_progress=False) as llm:
            assert not dist.is_initialized()
            assert llm.generate([[1, 2, 3]])[0]["token_ids"]
