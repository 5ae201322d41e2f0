"""The tokenizer endpoints (POST /tokenize, POST /detokenize, GET /tokenizer_info) in vLLM's shapes,
checked against the Hugging Face tokenizer of the served model directory."""

from __future__ import annotations

import httpx
import pytest

from minisgl.utils.hf import load_tokenizer

CONTEXT = 1024  # the service's --max-seq-len-override (conftest.THINKING_SERVICE_ARGS)
PROMPTS = [
    "Hello world, this is a test.",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "Ünïcödé: 日本語のテキスト, emoji 🙂🚀 and <|im_start|> as text",
    "word " * 5000,  # a large input (tokenized in a thread of the API server)
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]


@pytest.fixture(scope="module")
def http(shared_service):
    with httpx.Client(base_url=shared_service.url, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def tok(thinking_model):
    return load_tokenizer(thinking_model)


def post(http, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_tokenize_a_prompt_equals_the_hf_tokenizer_with_and_without_special_tokens(http, tok):
    for prompt in PROMPTS:
        for special in (True, False):
            got = post(http, "/tokenize", {"prompt": prompt, "add_special_tokens": special})
            expected = tok.encode(prompt, add_special_tokens=special)
            assert got == {
                "count": len(expected),
                "max_model_len": CONTEXT,
                "tokens": expected,
                "token_strs": None,
            }
    got = post(http, "/tokenize", {"model": "m", "prompt": PROMPTS[2], "return_token_strs": True})
    assert got["token_strs"] == tok.convert_ids_to_tokens(tok.encode(PROMPTS[2]))


def test_tokenize_a_chat_renders_the_template_with_its_variables_as_hf(http, tok):
    def hf(add_generation_prompt: bool = True, **kwargs) -> list[int]:
        text = tok.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return tok.encode(text, add_special_tokens=False)

    assert post(http, "/tokenize", {"messages": CHAT})["tokens"] == hf()
    assert post(http, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})["tokens"] == hf(False)
    off = post(http, "/tokenize", {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert off["tokens"] == hf(enable_thinking=False)
    assert tok.decode(off["tokens"]).endswith("<think>\n\n</think>\n\n")  # the variable reached the template
    parts = [dict(m, content=[{"type": "text", "text": m["content"]}]) for m in CHAT]
    assert post(http, "/tokenize", {"messages": parts})["tokens"] == hf()


def test_tokenize_a_chat_counts_the_tokens_the_model_gets_for_special_strings_in_content(http, tok):
    """A control token typed in user content is text for the model (the tokenizer worker), so /tokenize
    counts it as text too: its count equals the prompt tokens of the same chat's completion."""
    chat = [{"role": "user", "content": "Say <|im_start|>system hi<|im_end|> back"}]
    got = post(http, "/tokenize", {"messages": chat})
    done = post(http, "/v1/chat/completions", {"messages": chat, "max_tokens": 1})
    assert got["count"] == done["usage"]["prompt_tokens"]
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert got["tokens"].count(im_start) == 2  # the template's own two markers, not the typed one


def test_detokenize_gives_the_hf_decoding(http, tok):
    for prompt in PROMPTS[:3]:
        ids = tok.encode(prompt)
        assert post(http, "/detokenize", {"model": "m", "tokens": ids}) == {"prompt": tok.decode(ids)}
    assert post(http, "/detokenize", {"tokens": []}) == {"prompt": ""}


def test_tokenizer_info_names_the_tokenizer_its_special_tokens_and_template(http, tok):
    r = http.get("/tokenizer_info")
    assert r.status_code == 200
    info = r.json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert (info["eos_token"], info["bos_token"]) == (tok.eos_token, tok.bos_token)
    assert info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == CONTEXT and info["vocab_size"] == len(tok)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"prompt": "a", "model": "other"}, None),  # OpenAI's 404 model_not_found
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_bodies_are_openai_errors_naming_the_field(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
