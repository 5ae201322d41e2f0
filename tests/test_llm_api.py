"""The offline API: bad input is a ValueError naming the problem, outputs follow the documented shape,
requests finish for the documented reasons, every KV slot is returned, and shutdown frees the engine."""

from __future__ import annotations

import gc
import json
import os
import shutil
import weakref

import pytest
from helpers import (
    TINY_SPECS,
    HFReference,
    assert_all_kv_free,
    assert_tokens_equal_hf,
    make_llm,
    random_prompt,
    tiny_llm_kwargs,
)

from minisgl.core import InvalidRequest, SamplingParams
from minisgl.llm import LLM

ARCH = "llama"
MAX_SEQ_LEN = 96
VOCAB = TINY_SPECS[ARCH].config_kwargs["vocab_size"]


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    with make_llm(tiny_model_dirs[ARCH], **tiny_llm_kwargs(max_seq_len_override=MAX_SEQ_LEN)) as llm:
        yield llm


def prompt(n: int, seed: int = 0):
    return random_prompt(n, VOCAB, seed)


# ---- bad input --------------------------------------------------------------------------------------
BAD_PARAMS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.2}, "top_p"),
    ({"top_k": 0}, "top_k"),
]


@pytest.mark.parametrize(
    "kwargs,names", BAD_PARAMS, ids=[f"{next(iter(k))}={next(iter(k.values()))}" for k, _ in BAD_PARAMS]
)
def test_bad_sampling_params_raise_value_error_naming_the_field(llm, kwargs, names):
    with pytest.raises(ValueError, match=names):
        llm.generate([prompt(5)], SamplingParams(**kwargs))
    assert_all_kv_free(llm)


@pytest.mark.parametrize("bad", [[], ""], ids=["empty-ids", "empty-string"])
def test_empty_prompt_raises(llm, bad):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([bad], SamplingParams(max_tokens=4))


def test_prompt_longer_than_max_seq_len_raises(llm):
    with pytest.raises(ValueError, match="maximum sequence length"):
        llm.generate([prompt(MAX_SEQ_LEN)], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="maximum sequence length"):
        llm.generate([prompt(MAX_SEQ_LEN + 50)], SamplingParams(max_tokens=1))


def test_bad_input_in_a_batch_queues_nothing(llm):
    """One bad request rejects the whole call before anything runs; the LLM stays usable."""
    good = [prompt(6, seed=1), prompt(9, seed=2)]
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(good + [prompt(4)], [SamplingParams(max_tokens=4)] * 2 + [SamplingParams(top_p=2.0)])
    assert not llm.scheduler.has_work
    outs = llm.generate(good, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o["token_ids"]) for o in outs] == [4, 4]
    assert_all_kv_free(llm)


def test_mismatched_sampling_params_list_raises(llm):
    with pytest.raises(ValueError):
        llm.generate([prompt(5), prompt(6)], [SamplingParams(max_tokens=2)])


def test_string_prompt_without_tokenizer_raises(llm):
    """The tiny models have no tokenizer: a string prompt is a clear error, token ids work."""
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["hello"], SamplingParams(max_tokens=2))


def test_token_id_outside_vocab_raises(llm):
    with pytest.raises(ValueError):
        llm.generate([[1, 2, VOCAB]], SamplingParams(max_tokens=2))


# ---- bad model paths ----------------------------------------------------------------------------------
def _expect_model_error(path, match):
    with pytest.raises(ValueError, match=match):
        LLM(path, **tiny_llm_kwargs())


def test_nonexistent_model_dir_raises(tmp_path):
    _expect_model_error(str(tmp_path / "no_such_model"), "does not exist")


def test_model_file_that_is_not_gguf_raises(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    _expect_model_error(str(f), "gguf")


def test_model_dir_without_config_raises(tmp_path):
    _expect_model_error(str(tmp_path), "config.json")


def test_unsupported_architecture_lists_the_supported_ones(tmp_path, tiny_model_dirs):
    model = tmp_path / "renamed"
    shutil.copytree(tiny_model_dirs[ARCH], model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FancyNewForCausalLM") as err:
        LLM(str(model), **tiny_llm_kwargs())
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert supported in str(err.value)


@pytest.mark.parametrize("attn,library", [("fi", "FlashInfer"), ("fa", "FlashAttention"), ("nope", None)])
def test_unavailable_attention_backend_raises_naming_the_supported_ones(tiny_model_dirs, attn, library):
    with pytest.raises(ValueError, match=library or "unknown attention backend") as err:
        LLM(tiny_model_dirs[ARCH], **tiny_llm_kwargs(attn=attn))
    assert "torch" in str(err.value) and "triton" in str(err.value)


def test_unsupported_real_architecture_raises_value_error(tmp_path):
    """A real checkpoint of an unsupported family (GPT-2: no rms_norm_eps, no rope) is rejected by name,
    not by an AttributeError deep inside the config reader."""
    from transformers import GPT2Config

    GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=100, architectures=["GPT2LMHeadModel"]
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path), **tiny_llm_kwargs())


# ---- outputs ------------------------------------------------------------------------------------------
def test_outputs_are_one_dict_per_prompt_in_order(llm):
    prompts = [prompt(n, seed=n) for n in (3, 11, 7)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(outs) == 3
    for p, o in zip(prompts, outs):
        assert {"text", "token_ids", "finish_reason"} <= set(o)
        assert len(o["token_ids"]) == 5 and o["finish_reason"] == "length"
        alone = llm.generate([p], SamplingParams(max_tokens=5, ignore_eos=True))[0]
        assert alone["token_ids"] == o["token_ids"]  # generated ids only, matched to their own prompt


def test_sampling_params_list_applies_per_prompt(llm):
    prompts = [prompt(n, seed=n) for n in (4, 8, 12)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 9, 1)])
    assert [len(o["token_ids"]) for o in outs] == [3, 9, 1]
    single = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(o["token_ids"]) for o in single] == [6, 6, 6]
    assert all(a["token_ids"][:3] == b["token_ids"][:3] for a, b in zip(outs[:2], single[:2]))
    assert_all_kv_free(llm)


def test_max_tokens_none_runs_up_to_the_context(llm):
    """max_tokens=None (the service's absent max_tokens): a prompt at max_seq_len - 1 gets one token."""
    outs = llm.generate(
        [prompt(MAX_SEQ_LEN - 1), prompt(MAX_SEQ_LEN - 3, seed=1)],
        SamplingParams(max_tokens=None, ignore_eos=True),
    )
    assert [len(o["token_ids"]) for o in outs] == [1, 3]
    assert all(o["finish_reason"] == "length" for o in outs)
    assert_all_kv_free(llm)


def test_prompt_plus_max_tokens_beyond_the_context_is_rejected_as_by_the_service(llm):
    """The offline path no longer caps an explicit max_tokens: like the service, it names max_tokens."""
    with pytest.raises(InvalidRequest, match="'max_tokens' is 50") as err:
        llm.generate([prompt(MAX_SEQ_LEN - 3)], SamplingParams(max_tokens=50))
    assert err.value.param == "max_tokens"
    out = llm.generate([prompt(MAX_SEQ_LEN - 3)], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out["token_ids"]) == 3  # exactly at the context is fine
    assert_all_kv_free(llm)


@pytest.mark.parametrize(
    "kwargs,param",
    [
        *BAD_PARAMS,
        ({"seed": "7"}, "seed"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_request_carries_the_generic_field_name(llm, kwargs, param):
    with pytest.raises(InvalidRequest) as err:
        llm.generate([prompt(5)], SamplingParams(**kwargs))
    assert err.value.param == param and f"'{param}'" in str(err.value)


@pytest.mark.parametrize(
    "bad", [[], [1, 2, VOCAB], [1, -1], prompt(MAX_SEQ_LEN)], ids=["empty", "vocab", "negative", "long"]
)
def test_bad_prompts_name_the_prompt(llm, bad):
    with pytest.raises(InvalidRequest) as err:
        llm.generate([bad], SamplingParams(max_tokens=1))
    assert err.value.param == "prompt"


def test_stop_token_ids_end_generation(llm, hf_reference):
    p = prompt(10, seed=3)
    greedy = hf_reference(ARCH).greedy(p, 24)
    stop = next(t for i, t in enumerate(greedy) if i >= 4 and t not in greedy[:i])  # first seen at index >= 4
    k = greedy.index(stop)
    out = llm.generate([p], SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[stop]))[0]
    assert out["finish_reason"] == "stop"
    assert out["token_ids"] in (greedy[:k], greedy[: k + 1]), (out["token_ids"], greedy, stop)
    assert_all_kv_free(llm)


def test_eos_ends_generation_unless_ignored(tmp_path, tiny_model_dirs):
    """The config's eos_token_id ends a request (finish_reason "stop"); ignore_eos runs to max_tokens."""
    p = prompt(8, seed=4)
    ref = HFReference(tiny_model_dirs[ARCH])
    greedy = ref.greedy(p, 20)
    eos = next(t for i, t in enumerate(greedy) if i >= 3 and t not in greedy[:i])
    k = greedy.index(eos)
    model = tmp_path / "with_eos"
    shutil.copytree(tiny_model_dirs[ARCH], model)
    for name in ("config.json", "generation_config.json"):
        if (model / name).exists():
            cfg = json.loads((model / name).read_text())
            cfg["eos_token_id"] = eos
            (model / name).write_text(json.dumps(cfg))
    with make_llm(str(model), **tiny_llm_kwargs()) as llm:
        stopped = llm.generate([p], SamplingParams(max_tokens=20))[0]
        assert stopped["finish_reason"] == "stop"
        assert stopped["token_ids"] in (greedy[:k], greedy[: k + 1])
        ignored = llm.generate([p], SamplingParams(max_tokens=20, ignore_eos=True))[0]
        assert ignored["finish_reason"] == "length"
        assert_tokens_equal_hf(ignored["token_ids"], ref, p, what="ignore_eos")
        assert_all_kv_free(llm)


# ---- KV slots and shutdown ------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_type", ["naive", "radix"])
def test_every_kv_slot_is_free_after_generate(tiny_model_dirs, cache_type):
    with make_llm(tiny_model_dirs[ARCH], **tiny_llm_kwargs(cache_type=cache_type, page_size=4)) as llm:
        total = llm.scheduler.num_total_pages
        for round_ in range(3):
            prompts = [prompt(n, seed=round_ * 10 + n) for n in (3, 9, 17, 30, 31)]
            llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in (1, 7, 12, 3, 20)])
            assert_all_kv_free(llm)
        if cache_type == "naive":  # nothing is kept: the whole pool is free
            assert llm.scheduler.num_free_pages() == total


def test_shutdown_frees_the_engine_and_a_new_llm_works(tiny_model_dirs):
    llm = LLM(tiny_model_dirs[ARCH], **tiny_llm_kwargs())
    p = prompt(12, seed=9)
    before = llm.generate([p], SamplingParams(max_tokens=8, ignore_eos=True))[0]["token_ids"]
    engine = llm.scheduler.engine
    refs = [weakref.ref(engine.model), weakref.ref(engine.kv_pool)]
    kv_tensor = weakref.ref(engine.kv_pool.k(0))
    del engine
    llm.shutdown()
    llm.shutdown()  # idempotent
    gc.collect()
    assert all(r() is None for r in refs), "the model or the KV pool outlived shutdown()"
    assert kv_tensor() is None, "a KV cache tensor outlived shutdown()"
    with make_llm(tiny_model_dirs[ARCH], **tiny_llm_kwargs()) as again:
        assert again.generate([p], SamplingParams(max_tokens=8, ignore_eos=True))[0]["token_ids"] == before


def test_llm_accepts_a_gguf_file_path(default_model_dir):
    """`LLM(path)` with a .gguf file resolves to the converted (cached) directory."""
    from minisgl.models.resolve import default_model_path, resolve_model_path

    gguf = default_model_path()
    assert gguf.endswith(".gguf") and os.path.isfile(gguf)
    assert resolve_model_path(gguf) == default_model_dir
    assert os.path.isfile(os.path.join(default_model_dir, "config.json"))


def test_two_llms_in_one_process_each_compute_their_own_model(tiny_model_dirs, hf_reference):
    """Building (or shutting down) a second LLM does not disturb the first one's engine."""
    p = prompt(10, seed=1)
    other_vocab = TINY_SPECS["qwen3"].config_kwargs["vocab_size"]
    q = random_prompt(10, other_vocab, seed=1)
    with make_llm(tiny_model_dirs[ARCH], **tiny_llm_kwargs()) as first:
        with make_llm(tiny_model_dirs["qwen3"], **tiny_llm_kwargs()) as second:
            a = first.generate([p], SamplingParams(max_tokens=8, ignore_eos=True))[0]["token_ids"]
            b = second.generate([q], SamplingParams(max_tokens=8, ignore_eos=True))[0]["token_ids"]
            assert_tokens_equal_hf(a, hf_reference(ARCH), p, what="first LLM beside a second")
            assert_tokens_equal_hf(b, hf_reference("qwen3"), q, what="second LLM")
        again = first.generate([p], SamplingParams(max_tokens=8, ignore_eos=True))[0]["token_ids"]
        assert again == a
        assert_all_kv_free(first)


def test_logprobs_equal_hf_log_softmax(llm, tiny_model_dirs):
    """logprobs=True reports each generated token's log-probability under the model, and top_logprobs=k
    the k most likely (id, logprob) pairs, as Hugging Face's log-softmax of the same step gives them."""
    import torch

    p = prompt(9, seed=21)
    out = llm.generate([p], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3))[0]
    assert len(out["logprobs"]) == len(out["token_ids"]) == 6
    model = HFReference(tiny_model_dirs[ARCH]).model
    ids = torch.tensor([p + out["token_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), dim=-1)
    for i, (tok, lp) in enumerate(zip(out["token_ids"], out["logprobs"])):
        row = logp[len(p) - 1 + i]
        assert abs(lp - float(row[tok])) < 1e-3, (i, lp, float(row[tok]))
        top = out["top_logprobs"][i]
        assert len(top) == 3
        assert [int(t) for t, _ in top] == row.topk(3).indices.tolist()
        assert all(abs(v - float(row[int(t)])) < 1e-3 for t, v in top)
