"""Embeddings: a prompt's final hidden states pooled (last token, mean, first token) and L2-normalised
equal Hugging Face's in float32, offline (`LLM.embed`) and batched beside generation; the pooling comes
from --pooling or the model's sentence-transformers config."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_all_kv_free, assert_tokens_equal_hf, make_llm, random_prompt, tiny_llm_kwargs

from minisgl.core import SamplingParams
from minisgl.utils.hf import pooling_of

TOL = 1e-5
PROMPTS = ["Hello world, this is a test.", "Short", "A longer text " * 9]


def hf_embedding(model, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0].float()
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]
    return v / v.norm()


@pytest.fixture(scope="module")
def hf_base(default_model_dir):
    from transformers import AutoModel

    return AutoModel.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_equal_hf_pooled_normalised_hidden_states(default_model_dir, hf_base, pooling):
    kw = tiny_llm_kwargs(max_prefill_length=16, page_size=4, pooling=pooling)  # chunked prompts, a cache
    with make_llm(default_model_dir, **kw) as llm:
        ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        prompts = [PROMPTS[0], ids[1], PROMPTS[2]]  # text and token ids
        first = llm.embed(prompts)
        again = llm.embed(prompts)  # the prompts' prefixes are cached now (only last pooling may use them)
        for e, e2, p in zip(first, again, ids):
            expected = hf_embedding(hf_base, p, pooling)
            assert len(e) == expected.numel()
            assert torch.allclose(torch.tensor(e), expected, atol=TOL, rtol=0)
            assert torch.allclose(torch.tensor(e2), expected, atol=TOL, rtol=0)
        assert_all_kv_free(llm)


def test_embeddings_run_in_the_same_batches_as_generation(tiny_model_dirs, hf_reference):
    from transformers import AutoModel

    path = tiny_model_dirs["llama"]
    base = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    gen = [random_prompt(30, 733, seed=s) for s in (1, 2)]
    emb = [random_prompt(25, 733, seed=s) for s in (3, 4)]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    embed = SamplingParams(max_tokens=0, embed=True)
    with make_llm(path, **tiny_llm_kwargs(pooling="mean")) as llm:
        outs = llm.generate([gen[0], emb[0], gen[1], emb[1]], [greedy, embed, greedy, embed])
    for out, prompt in zip(outs[::2], gen):
        assert_tokens_equal_hf(out["token_ids"], hf_reference("llama"), prompt, "beside embeddings")
    for out, prompt in zip(outs[1::2], emb):
        assert out["token_ids"] == [] and "embedding" in out
        assert torch.allclose(
            torch.tensor(out["embedding"]), hf_embedding(base, prompt, "mean"), atol=TOL, rtol=0
        )


def test_the_pooling_comes_from_the_sentence_transformers_config(tmp_path):
    assert pooling_of(str(tmp_path)) == "last"  # no such config: the last token's
    (tmp_path / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert pooling_of(str(tmp_path)) == "mean"
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    assert pooling_of(str(tmp_path)) == "cls"
    assert pooling_of(str(tmp_path), "last") == "last"  # --pooling wins


# ---- POST /v1/embeddings through the service (the default model: last-token pooling) ---------------------
@pytest.fixture(scope="module")
def client(shared_service):
    import openai

    return openai.OpenAI(base_url=f"{shared_service.url}/v1", api_key="none", timeout=300, max_retries=0)


def test_the_embeddings_endpoint_equals_hf_for_strings_and_token_ids(client, thinking_model):
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(thinking_model)
    base = AutoModel.from_pretrained(thinking_model, dtype=torch.float32).eval()
    ids = [tok.encode(p) for p in PROMPTS]
    r = client.embeddings.create(model="m", input=PROMPTS)
    assert [d.index for d in r.data] == [0, 1, 2] and r.usage.prompt_tokens == sum(map(len, ids))
    for d, p in zip(r.data, ids):
        assert torch.allclose(torch.tensor(d.embedding), hf_embedding(base, p, "last"), atol=TOL, rtol=0)
    one = client.embeddings.create(model="m", input=ids[1]).data[0].embedding  # token ids
    assert torch.allclose(torch.tensor(one), hf_embedding(base, ids[1], "last"), atol=TOL, rtol=0)
    short = client.embeddings.create(model="m", input=PROMPTS[0], dimensions=16).data[0].embedding
    full = hf_embedding(base, ids[0], "last")[:16]
    assert torch.allclose(
        torch.tensor(short), full / full.norm(), atol=TOL, rtol=0
    )  # Matryoshka: renormalised
    # base64: little-endian float32 (the SDK asks for it by default and decodes it; here by hand)
    import base64

    import httpx

    body = {"input": PROMPTS[0], "encoding_format": "base64"}
    raw = httpx.post(f"{client.base_url}embeddings", json=body, timeout=60).json()["data"][0]["embedding"]
    decoded = torch.frombuffer(bytearray(base64.b64decode(raw)), dtype=torch.float32)
    assert torch.allclose(decoded, hf_embedding(base, ids[0], "last"), atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
    ],
)
def test_bad_embedding_requests_are_400_naming_the_field(shared_service, body, param):
    import httpx

    r = httpx.post(f"{shared_service.url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
