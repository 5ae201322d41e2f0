"""The tokenizer worker: chat template, incremental detokenization (UTF-8 safe, special tokens skipped) and
stop strings honoured across token boundaries without ever leaking, checked against the HF tokenizer."""

from __future__ import annotations

import pytest

from minisgl.core import SamplingParams
from minisgl.message import DetokenizeMsg, DetokenizeStartMsg, TokenizeMsg
from minisgl.models.resolve import resolve_model_path
from minisgl.tokenizer import DetokenizeManager, TokenizeManager
from minisgl.utils.hf import load_tokenizer

UTF8_HEAVY = "Grüße aus 北京！🎉🚀 Ça va? 日本語のテキスト, emoji 👩‍👩‍👧 and ∑ ∫ ≠ math."


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


def _stream(
    tok, ids: list[int], uid: int = 0, stop=(), stop_token_ids=(), last_reason="length", prompt_tail=()
):
    """Feed `ids` one by one (the last one finishing the request); return the replies and stopped uids."""
    mgr = DetokenizeManager(tok)
    mgr.start(
        DetokenizeStartMsg(
            uid,
            prompt_len=len(prompt_tail),
            prompt_tail=list(prompt_tail),
            stop=list(stop),
            stop_token_ids=list(stop_token_ids),
        )
    )
    replies, stopped = [], []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        r, s = mgr.feed([DetokenizeMsg(uid, t, finished=last, finish_reason=last_reason if last else None)])
        replies += r
        stopped += s
        if any(x.finished for x in r):
            break
    return replies, stopped, mgr


def test_chat_messages_go_through_the_models_chat_template(tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = TokenizeManager(tokenizer).tokenize(TokenizeMsg(0, SamplingParams(), messages=messages))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_text_and_token_prompts(tokenizer):
    mgr = TokenizeManager(tokenizer)
    assert mgr.tokenize(TokenizeMsg(0, SamplingParams(), text="Hello world")) == tokenizer.encode(
        "Hello world"
    )
    assert mgr.tokenize(TokenizeMsg(0, SamplingParams(), input_ids=[5, 6])) == [5, 6]


def test_utf8_heavy_stream_never_splits_a_character_and_concatenates_to_the_full_text(tokenizer):
    ids = tokenizer.encode(UTF8_HEAVY)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids), "the text should contain multi-token chars"
    replies, _, _ = _stream(tokenizer, ids)
    assert all("\ufffd" not in r.text for r in replies)
    assert "".join(r.text for r in replies) == tokenizer.decode(ids) == UTF8_HEAVY
    assert replies[-1].finished and replies[-1].finish_reason == "length"
    assert replies[-1].completion_tokens == len(ids)


def test_word_boundary_spaces_survive_with_prompt_context(tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    out = tokenizer.encode(" Paris, and the capital of Italy is Rome.")
    replies, _, _ = _stream(tokenizer, out, prompt_tail=prompt)
    assert "".join(r.text for r in replies) == tokenizer.decode(out)
    assert replies[0].prompt_tokens == len(prompt)


def test_special_tokens_are_skipped(tokenizer):
    ids = (
        tokenizer.encode("Hello")
        + [tokenizer.convert_tokens_to_ids("<|im_start|>")]
        + tokenizer.encode(" there")
    )
    ids.append(tokenizer.eos_token_id)
    replies, _, _ = _stream(tokenizer, ids, last_reason="stop")
    assert "".join(r.text for r in replies) == "Hello there"


@pytest.mark.parametrize("stop", ["capital of", "Italy", "l of It", "."])
def test_stop_string_cut_across_chunks_is_never_leaked(tokenizer, stop):
    text = " Paris. The capital of Italy is Rome. The capital of Spain is Madrid."
    ids = tokenizer.encode(text)
    replies, stopped, mgr = _stream(tokenizer, ids, uid=3, stop=[stop, "never appears"])
    out = "".join(r.text for r in replies)
    assert out == text[: text.index(stop)]
    assert replies[-1].finished and replies[-1].finish_reason == "stop"
    assert stopped == [3], "the scheduler must be told to stop generating"
    # every chunk shown so far was a prefix of the final text: nothing had to be taken back
    shown = ""
    for r in replies:
        shown += r.text
        assert stop not in shown
    # the scheduler's own last message (an abort) for the stopped request is ignored
    assert mgr.feed([DetokenizeMsg(3, -1, finished=True, finish_reason="abort")]) == ([], [])
    assert not mgr.states and not mgr.dropped


def test_text_held_back_as_a_possible_stop_prefix_is_released_when_it_is_not(tokenizer):
    text = "a b c d e"
    ids = tokenizer.encode(text)
    replies, stopped, _ = _stream(tokenizer, ids, stop=["c d x"])
    assert "".join(r.text for r in replies) == text
    assert not stopped and replies[-1].finish_reason == "length"
    # while " c d" could still become "c d x", it was held back
    partial = ""
    for r in replies[:-1]:
        partial += r.text
    assert not partial.endswith("c d")


def test_stop_token_id_ends_the_text_without_appearing(tokenizer):
    ids = tokenizer.encode("one two three")
    stop_id = tokenizer.encode(" four")[0]
    replies, _, _ = _stream(tokenizer, ids + [stop_id], stop_token_ids=[stop_id], last_reason="stop")
    assert "".join(r.text for r in replies) == "one two three"
    assert replies[-1].completion_tokens == len(ids) + 1  # the stop token was generated: it counts


def test_scheduler_error_for_a_registered_request_becomes_an_error_reply(tokenizer):
    mgr = DetokenizeManager(tokenizer)
    mgr.start(DetokenizeStartMsg(9, prompt_len=4))
    replies, _ = mgr.feed([DetokenizeMsg(9, finished=True, finish_reason="error", error="prompt too long")])
    assert replies[0].finished and replies[0].error == "prompt too long"
    assert not mgr.states


def test_tokens_that_outrun_their_start_message_are_kept_until_it_arrives(tokenizer):
    mgr = DetokenizeManager(tokenizer)
    ids = tokenizer.encode("Hi there")
    assert mgr.feed([DetokenizeMsg(5, ids[0])]) == ([], [])
    replies, _ = mgr.start(DetokenizeStartMsg(5, prompt_len=2))
    r2, _ = mgr.feed([DetokenizeMsg(5, ids[1], finished=True, finish_reason="length")])
    assert "".join(r.text for r in replies + r2) == "Hi there"


def test_logprobs_name_their_tokens(tokenizer):
    mgr = DetokenizeManager(tokenizer)
    mgr.start(DetokenizeStartMsg(1, prompt_len=1, logprobs=True))
    t = tokenizer.encode(" Paris")[0]
    replies, _ = mgr.feed([DetokenizeMsg(1, t, True, "length", -0.25, [(t, -0.25), (2, -3.0)])])
    lp = replies[0].logprobs[0]
    assert lp.token == tokenizer.decode([t]) and lp.logprob == -0.25
    assert lp.top[1] == ("<|im_end|>", 2, -3.0)


def test_a_character_cut_off_by_the_end_of_the_output_is_dropped_not_broken(tokenizer):
    ids = tokenizer.encode("ok 🎉")
    assert "\ufffd" in tokenizer.decode(ids[:-1]), "the emoji should span several tokens"
    replies, _, _ = _stream(tokenizer, ids[:-1])
    assert "".join(r.text for r in replies) == "ok "
    assert replies[-1].completion_tokens == len(ids) - 1
