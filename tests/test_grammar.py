"""Constrained decoding (json_schema, regex, ebnf) on a tiny random model with a tiny byte-level BPE
tokenizer: every generated token is checked against a fresh xgrammar matcher built here, independently of
the engine's, step by step; a finished output parses and validates (jsonschema) or fullmatches the regex.

A random model picks arbitrary tokens, so a grammar that admits unbounded output could run to max_tokens:
the constraints here are bounded, so every request ends with "stop" well before it."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
import torch
import xgrammar as xgr
from helpers import TINY_SPECS, TinySpec, build_tiny_model, make_llm, random_prompt, serving, tiny_llm_kwargs

from minisgl.core import InvalidRequest, SamplingParams

VOCAB = 733  # the model's logits; the tokenizer has fewer tokens (like a padded vocabulary)
TOKENIZER_SIZE = 400
EOS = 0
SCHEMA = {
    "type": "object",
    "properties": {
        # a pattern, not maxLength: xgrammar 0.2.9's maxLength strings admit raw control characters
        "name": {"type": "string", "pattern": "^[a-z0-9_]{1,6}$"},
        "kind": {"enum": ["a", "b", "c"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "size": {
            "type": "object",
            "properties": {"w": {"type": "integer", "minimum": -5, "maximum": 999}, "h": {"type": "boolean"}},
            "required": ["w", "h"],
        },
    },
    "required": ["name", "kind", "tags", "size"],
}
REGEX = r"(yes|no) [0-9]{2,4}"
EBNF = 'root ::= "[" num ("," num)? "]"\nnum ::= [0-9] [0-9]?'
# xgrammar's structural tag (what tool calling uses): literal tags around a constrained part
TAG = {
    "type": "structural_tag",
    "format": {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": "<a>"},
            {"type": "regex", "pattern": "(yes|no)"},
            {"type": "const_string", "value": "</a>"},
        ],
    },
}
PROMPTS = [[5, 17, 99, 3], [250, 12, 7, 7, 40, 41, 300], [1, 2, 3], [399, 398]]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        json.dumps({"name": f"it{i}", "kind": "abc"[i % 3], "tags": [True, False][: i % 3], "size": {"w": i}})
        for i in range(200)
    ] + ["yes 12", "no 345", "[1,2]", "[34]"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny random Llama whose directory also holds a byte-level BPE tokenizer (EOS id 0)."""
    base = TINY_SPECS["llama"]
    kwargs = {**base.config_kwargs, "vocab_size": VOCAB, "eos_token_id": EOS, "bos_token_id": 1}
    out = build_tiny_model(
        TinySpec("grammar", base.architecture, kwargs, seed=7), str(tmp_path_factory.mktemp("g"))
    )
    tok = _tokenizer()
    assert tok.eos_token_id == EOS and len(tok) == TOKENIZER_SIZE
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reference(model_dir):
    """An xgrammar compiler of our own over the same vocabulary: the independent judge of the outputs."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=[EOS])
    return tok, xgr.GrammarCompiler(info)


def _compile(compiler, kind: str, text: str):
    if kind == "json_schema":
        return compiler.compile_json_schema(text, any_whitespace=False, separators=(", ", ": "))
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(text)
    return compiler.compile_grammar(text)


def check_output(reference, params: SamplingParams, out: dict) -> None:
    """Each token is one the grammar allows at that point; a finished output is complete and valid."""
    tok, compiler = reference
    kind, text = params.grammar
    matcher = xgr.GrammarMatcher(_compile(compiler, kind, text))
    for i, t in enumerate(out["token_ids"]):
        assert matcher.accept_token(t), f"{kind}: token {i} ({t}) is outside the grammar: {out['token_ids']}"
    assert out["finish_reason"] == "stop", out
    assert matcher.is_terminated() and out["token_ids"][-1] == EOS
    body = tok.decode(out["token_ids"][:-1])
    if kind == "json_schema":
        jsonschema.validate(json.loads(body), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, body), body
    elif kind == "structural_tag":
        assert re.fullmatch(r"<a>(yes|no)</a>", body), body
    else:
        assert re.fullmatch(r"\[[0-9]{1,2}(,[0-9]{1,2})?\]", body), body


def constrained_params() -> list[SamplingParams]:
    """Every kind, greedy and sampled (two json requests share one schema, each its own matcher)."""
    common = {"max_tokens": 96}
    kinds = [{"json_schema": SCHEMA}, {"regex": REGEX}, {"ebnf": EBNF}]
    greedy = [SamplingParams(**k, **common) for k in kinds]
    sampled = [SamplingParams(**k, temperature=1.0, seed=11 + i, **common) for i, k in enumerate(kinds)]
    tag = SamplingParams(structural_tag=TAG, temperature=1.0, seed=5, **common)
    return [*greedy, *sampled, SamplingParams(json_schema=SCHEMA, temperature=1.0, seed=3, **common), tag]


CONFIGS = {
    "overlap": {},
    "no_overlap": {"overlap": False},
    "chunked": {"max_prefill_length": 3},  # prompts split into chunks that do not sample
    "graphs": {"cuda_graph_max_bs": 8},  # emulated decode graphs: the mask after the graph's logits
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_constrained_rows_follow_their_grammar_and_leave_the_others_alone(model_dir, reference, config):
    """Constrained requests emit only what their grammar allows and stop once it is complete; the
    unconstrained greedy requests of the same batch equal a run without any constrained request."""
    plain = [SamplingParams(max_tokens=12, ignore_eos=True) for _ in PROMPTS]
    constrained = constrained_params()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(constrained))]
    with make_llm(model_dir, **tiny_llm_kwargs(**CONFIGS[config])) as llm:
        alone = llm.generate(PROMPTS, plain)
        mixed = llm.generate(prompts + PROMPTS, constrained + plain)
        assert llm.scheduler.grammar.num_constrained == 0
        if config == "graphs":
            assert llm.scheduler.engine.graph_runner.replays > 0
    for params, out in zip(constrained, mixed):
        check_output(reference, params, out)
    assert [o["token_ids"] for o in mixed[len(constrained) :]] == [o["token_ids"] for o in alone]


def test_retraction_keeps_the_matcher_state(model_dir, reference):
    """A pool too small for every request retracts some; their outputs equal those of a large pool."""
    kinds = [{"json_schema": SCHEMA}, {"regex": REGEX}]
    params = [SamplingParams(**kinds[i % 2], temperature=1.0, seed=i, max_tokens=96) for i in range(10)]
    prompts = [random_prompt(12, TOKENIZER_SIZE, seed=i) for i in range(len(params))]
    with make_llm(model_dir, **tiny_llm_kwargs()) as llm:
        expected = llm.generate(prompts, params)
    small = tiny_llm_kwargs(num_page_override=64, max_seq_len_override=128, reserve_ratio=0.0)
    with make_llm(model_dir, **small) as llm:
        got = llm.generate(prompts, params)
        assert llm.scheduler.retraction.num_retractions > 0
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in expected]
    for p, out in zip(params, got):
        check_output(reference, p, out)


def test_abort_drops_the_matcher_and_frees_everything(model_dir):
    """Aborting a constrained request while it compiles or runs leaves nothing behind."""
    from helpers import assert_all_kv_free

    with make_llm(model_dir, **tiny_llm_kwargs()) as llm:
        llm.add_request(0, PROMPTS[0], SamplingParams(json_schema=SCHEMA, max_tokens=96))
        llm.abort_request(0)  # still compiling
        llm.add_request(1, PROMPTS[1], SamplingParams(regex=REGEX, max_tokens=96))
        tokens = []
        while len(tokens) < 2:
            tokens += [r for r in llm.step() if r.uid == 1]
        llm.abort_request(1)
        while llm.scheduler.has_work:
            llm.step()
        assert llm.scheduler.grammar.num_constrained == 0
        assert_all_kv_free(llm)
        out = llm.generate([PROMPTS[2]], SamplingParams(regex=REGEX, max_tokens=96))[0]
        assert out["finish_reason"] == "stop"


BAD = [
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": '{"type": "object", "properties": 5}'}, "json_schema"),
    ({"regex": "(unclosed"}, "regex"),
    ({"ebnf": 'root ::= "a" undefined_rule'}, "ebnf"),
    ({"ebnf": 'start ::= "a"'}, "ebnf"),  # no root rule
    ({"json_schema": SCHEMA, "regex": REGEX}, "json_schema"),
    ({"regex": 5}, "regex"),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "nope"}}}, "structural_tag"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_bad_constraints_are_refused_naming_the_field_before_anything_runs(model_dir, fields, param):
    with make_llm(model_dir, **tiny_llm_kwargs()) as llm:
        with pytest.raises(InvalidRequest) as e:
            llm.generate([PROMPTS[0], PROMPTS[1]], [SamplingParams(max_tokens=4), SamplingParams(**fields)])
        assert e.value.param == param and f"'{param}'" in e.value.message
        assert not llm.scheduler.has_work and not llm.scheduler.reqs


def test_native_generate_takes_constraints_and_refuses_bad_ones(model_dir, tmp_path):
    """/generate's sampling_params carry SGLang's constraint names; a bad one is a 400 naming it, and the
    service keeps serving."""
    args = ["--model-path", model_dir, "--dtype", "float32", "--attn", "torch", "--num-pages", "2048"]
    with serving(args, tmp_path / "service.log") as service:
        url = f"{service.url}/generate"
        for sp, param in [({"regex": "(unclosed"}, "regex"), ({"json_schema": "{bad"}, "json_schema")]:
            r = httpx.post(url, json={"input_ids": PROMPTS[0], "sampling_params": sp}, timeout=120)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param
        for sp, pattern in [
            ({"regex": REGEX, "temperature": 0}, REGEX),
            ({"ebnf": EBNF, "temperature": 1.0, "seed": 2}, r"\[[0-9]{1,2}(,[0-9]{1,2})?\]"),
            ({"json_schema": json.dumps(SCHEMA), "temperature": 0}, None),
        ]:
            body = {"input_ids": PROMPTS[1], "sampling_params": {**sp, "max_new_tokens": 96}}
            r = httpx.post(url, json=body, timeout=120)
            assert r.status_code == 200, r.text
            reply = r.json()
            assert reply["meta_info"]["finish_reason"]["type"] == "stop", reply
            if pattern is None:
                jsonschema.validate(json.loads(reply["text"]), SCHEMA)
            else:
                assert re.fullmatch(pattern, reply["text"]), reply["text"]


@pytest.mark.gpu
def test_constrained_decode_on_cuda_with_graphs(model_dir, reference):
    """On a GPU: the mask meets the decode graph's logits; outputs are accepted by the matcher."""
    constrained = constrained_params()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(constrained))]
    kwargs = {"device": "cuda", "num_page_override": 4096, "max_running_req": 32, "show_progress": False}
    with make_llm(model_dir, cuda_graph_max_bs=16, **kwargs) as llm:
        outs = llm.generate(prompts, constrained)
        assert llm.scheduler.engine.graph_runner.replays > 0
    for params, out in zip(constrained, outs):
        check_output(reference, params, out)


def _mask_reference(logits, allowed: dict[int, set[int]]):
    out = logits.clone()
    for row, ids in allowed.items():
        keep = torch.zeros(logits.shape[1], dtype=torch.bool)
        keep[sorted(ids)] = True
        out[row][~keep.to(logits.device)] = float("-inf")
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [2]])
def test_token_mask_sets_exactly_the_disallowed_logits_of_its_rows(device, rows):
    """The bitmask as xgrammar lays it out (bit i % 32 of word i // 32), applied to some rows of a batch,
    against a hand-built boolean mask; the other rows are untouched."""
    from minisgl.grammar import TokenMask, apply_token_mask

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=g).to(device)
    width = (VOCAB + 31) // 32
    allowed = {r: set(torch.randint(0, VOCAB, (50,), generator=g).tolist()) for r in rows}
    bits = torch.zeros(len(rows), width, dtype=torch.int64)
    for k, r in enumerate(rows):
        for t in allowed[r]:
            bits[k, t // 32] |= 1 << (t % 32)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).to(device)
    index = torch.tensor(rows, device=device) if len(rows) < 4 else None
    expected = _mask_reference(logits, allowed)
    apply_token_mask(logits, TokenMask(bits, index, rows))
    assert torch.equal(logits.cpu(), expected.cpu())
