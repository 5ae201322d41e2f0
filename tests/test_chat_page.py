"""The chat page at `/`, in a real headless Chromium (Debian's, driven by Playwright) against the real
service on a tiny random Llama that speaks through the default model's tokenizer and chat template.

References: the same greedy request sent to /v1/chat/completions directly (the text, and the number of
content pieces its stream carries), hand-written HTML for the markdown renderer, the service's own log
for an aborted request. Every request the browser makes is recorded: none may leave this machine."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from helpers import TinySpec, build_tiny_model, serving

playwright = pytest.importorskip("playwright.sync_api")

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no Chromium (`./run setup test` installs it)")

SERVICE_ARGS = [
    "--dtype",
    "float32",
    "--attn",
    "torch",
    "--num-pages",
    "4096",
    "--max-seq-len-override",
    "2048",
]
API_KEY = "page-test-key"
SYSTEM = "You answer in one line."
QUESTION = "Tell me about the sea."


@pytest.fixture(scope="module")
def chat_model(default_model_dir: str, tmp_path_factory) -> str:
    """A tiny random Llama (two layers of 64) with the default model's vocabulary, tokenizer and template:
    it starts in seconds and its greedy replies are long streams of arbitrary text."""
    out = tmp_path_factory.mktemp("chat_model") / "model"
    config = json.loads(Path(default_model_dir, "config.json").read_text())
    kwargs = {"vocab_size": config["vocab_size"], "hidden_size": 64, "intermediate_size": 128}
    kwargs.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    kwargs.update(bos_token_id=config["bos_token_id"], eos_token_id=config["eos_token_id"])
    build_tiny_model(TinySpec("chat", "LlamaForCausalLM", kwargs, seed=11), str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(default_model_dir, name), out / name)
    return str(out)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    # every address but this machine's goes to a proxy that is not there: a stray request fails here
    # instead of leaving, and the pages' request logs below name it
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=BROWSER, proxy={"server": "http://127.0.0.1:9", "bypass": "127.0.0.1"}
        )
        yield b
        b.close()


# the last assistant message is in state arguments[0] with more than arguments[1] pieces shown
LAST_IN_STATE = """([state, pieces]) => {
    const m = [...document.querySelectorAll('.msg.assistant, .msg.error')].pop();
    return m !== undefined && m.dataset.state === state && Number(m.dataset.chunks || 0) >= pieces;
}"""


class Page:
    """A fresh browser tab on the service's chat page that records every request it makes."""

    def __init__(self, browser, url: str) -> None:
        self.url = url
        self.context = browser.new_context()
        self.page = self.context.new_page()
        self.requests: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(f"{url}/")

    def settings(self, **values: str) -> None:
        if self.page.locator("#settings").is_hidden():
            self.page.click("#toggle-settings")
        for field, value in values.items():
            self.page.fill(f"#{field}", value)

    def ask(self, text: str) -> None:
        self.page.fill("#prompt", text)
        self.page.press("#prompt", "Enter")

    def reply(self, state: str = "done", timeout_s: float = 120) -> dict[str, str]:
        """The last assistant message once it reached `state`: its raw text, pieces and shown text."""
        self.page.wait_for_function(LAST_IN_STATE, arg=[state, 0], timeout=timeout_s * 1000)
        last = self.page.locator(".msg.assistant, .msg.error").last
        return {
            "raw": last.get_attribute("data-raw") or "",
            "chunks": last.get_attribute("data-chunks") or "0",
            "text": last.inner_text(),
        }

    def assert_stayed_local(self) -> None:
        host = urlsplit(self.url).netloc
        away = [u for u in self.requests if urlsplit(u).netloc != host and not u.startswith("data:")]
        assert not away, f"the page made requests off this server: {away}"
        assert self.requests, "no request recorded"

    def close(self) -> None:
        self.context.close()


@pytest.fixture(scope="module")
def service(chat_model, tmp_path_factory):
    args = ["--model", chat_model, *SERVICE_ARGS, "--served-model-name", "tiny"]
    with serving(args, tmp_path_factory.mktemp("chat_page") / "server.log") as s:
        yield s


@pytest.fixture
def page(browser, service) -> Iterator[Page]:
    p = Page(browser, service.url)
    yield p
    p.close()


def api_reply(url: str, body: dict, headers: dict | None = None) -> tuple[str, int, int]:
    """The reply's text from the API without streaming, its number of tokens, and the number of content
    pieces of its stream (at most one a token; fewer where the server joined pieces that waited)."""
    full = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300).json()
    text, tokens = full["choices"][0]["message"]["content"], full["usage"]["completion_tokens"]
    pieces = 0
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, headers=headers, timeout=300
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                pieces += bool(choices and choices[0]["delta"].get("content"))
    return text, tokens, pieces


def greedy_body(max_tokens: int) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    return {"model": "tiny", "messages": messages, "temperature": 0, "top_p": 1, "max_tokens": max_tokens}


def test_the_page_streams_the_reply_the_api_gives_for_the_same_greedy_request(service, page):
    assert page.page.locator("#model").inner_text() == "tiny"  # read from /v1/models
    # long enough that the handler cannot fall behind for the whole reply (a handler that falls behind
    # gets the pieces that waited joined into one: on a loaded machine a short reply may arrive whole)
    page.settings(system=SYSTEM, temperature="0", top_p="1", max_tokens="400")
    page.ask(QUESTION)
    got = page.reply()
    text, tokens, pieces = api_reply(service.url, greedy_body(400))
    assert 1 < pieces <= tokens, (
        "the reference stream: one piece (the test would see no stream), or more pieces than tokens"
    )
    assert got["raw"] == text
    # shown piece by piece as the stream arrived: at most a piece a token (the server may join pieces that
    # wait for the same write, for the page's stream as for the reference's, so the two counts differ)
    assert 1 < int(got["chunks"]) <= tokens
    # a second turn carries the first: the page sends the whole conversation
    page.settings(max_tokens="40")
    page.ask("And the mountains?")
    second = page.reply()
    body = greedy_body(40)
    body["messages"] += [
        {"role": "assistant", "content": text},
        {"role": "user", "content": "And the mountains?"},
    ]
    assert second["raw"] == api_reply(service.url, body)[0]
    page.assert_stayed_local()


def test_stop_ends_the_stream_and_the_server_aborts_the_request(service, page):
    page.settings(temperature="0", max_tokens="1900")
    page.ask(QUESTION)
    page.page.wait_for_function(LAST_IN_STATE, arg=["streaming", 1], timeout=120_000)
    page.page.click("#stop")
    got = page.reply("stopped")
    assert got["raw"] and "(stopped)" in got["text"]
    assert page.page.locator("#send").is_visible() and page.page.locator("#stop").is_hidden()
    for _ in range(600):  # the server notices the closed connection and aborts the request
        if "Aborting request" in service.log_text():
            break
        time.sleep(0.1)
    assert "Aborting request" in service.log_text()
    page.assert_stayed_local()


def test_the_page_is_served_with_a_policy_that_keeps_it_to_this_server(service):
    r = httpx.get(f"{service.url}/", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    policy = dict(p.strip().split(" ", 1) for p in r.headers["content-security-policy"].split(";"))
    assert policy["default-src"] == "'none'" and policy["connect-src"] == "'self'"
    assert re.fullmatch(r"'sha256-[A-Za-z0-9+/=]+'", policy["script-src"])  # only the page's own script
    assert not re.search(r"(src|href)=\"?(https?:)?//", r.text), "the page links to another site"


MARKDOWN_CASES = [
    ("plain & <b>bold</b>", "<p>plain &amp; &lt;b&gt;bold&lt;/b&gt;</p>"),
    ("<img src=x onerror=alert(1)>", "<p>&lt;img src=x onerror=alert(1)&gt;</p>"),
    (
        "**strong** and *em* and `a<b`",
        "<p><strong>strong</strong> and <em>em</em> and <code>a&lt;b</code></p>",
    ),
    ("# Title\ntext", "<h1>Title</h1>\n<p>text</p>"),
    ("- one\n- **two**", "<ul><li>one</li><li><strong>two</strong></li></ul>"),
    ("1. a\n2. b", "<ol><li>a</li><li>b</li></ol>"),
    (
        "```python\nif a < b:\n    print('x')\n```",
        '<pre><code class="language-python">if a &lt; b:\n    print(&#39;x&#39;)</code></pre>',
    ),
    ("```\nunclosed <fence>", "<pre><code>unclosed &lt;fence&gt;</code></pre>"),
    (
        "[site](https://example.org/a?b=1&c=2)",
        '<p><a href="https://example.org/a?b=1&amp;c=2" target="_blank" rel="noopener noreferrer">site</a></p>',
    ),
    ("[x](javascript:alert(1))", "<p>[x](javascript:alert(1))</p>"),
    (
        '[x](https://e.org/"onmouseover="alert(1))',
        (
            '<p><a href="https://e.org/&quot;onmouseover=&quot;alert(1" target="_blank" '
            'rel="noopener noreferrer">x</a>)</p>'
        ),
    ),
    (
        "![pic](https://example.org/p.png)",
        '<p><a href="https://example.org/p.png" target="_blank" rel="noopener noreferrer">pic</a></p>',
    ),
    ("> quoted *text*", "<blockquote><p>quoted <em>text</em></p></blockquote>"),
    ("a\nb\n\nc", "<p>a<br>b</p>\n<p>c</p>"),
    ("2 * 3 * 4 and snake_case_name", "<p>2 * 3 * 4 and snake_case_name</p>"),
    ("---", "<hr>"),
]


def test_the_markdown_renderer_gives_the_expected_html_and_escapes_everything_else(page):
    for source, expected in MARKDOWN_CASES:
        assert page.page.evaluate("renderMarkdown", source) == expected, source
    # a reply that tries markup runs nothing: no element the renderer did not make reaches the page
    hostile = "<script>window.pwned=1</script><img src=x onerror='window.pwned=1'>"
    page.page.evaluate(
        "(s) => show(addMessage('assistant'), {content: s, reasoning: s, chunks: 1, note: s})", hostile
    )
    assert page.page.evaluate("window.pwned") is None
    assert page.page.locator(".msg script, .msg img").count() == 0
    page.assert_stayed_local()


def test_with_an_api_key_the_page_loads_and_sends_the_key_it_is_given(browser, chat_model, tmp_path):
    args = ["--model", chat_model, *SERVICE_ARGS, "--served-model-name", "tiny", "--api-key", API_KEY]
    with serving(args, tmp_path / "server.log", ready_path="/health") as s:
        page = Page(browser, s.url)
        try:
            page.settings(temperature="0", top_p="1", max_tokens="8")
            page.ask(QUESTION)
            refused = page.reply("error")
            assert "API key" in refused["text"]
            page.settings(api_key=API_KEY, system=SYSTEM)
            page.ask(QUESTION)
            got = page.reply()
            headers = {"Authorization": f"Bearer {API_KEY}"}
            assert got["raw"] == api_reply(s.url, greedy_body(8), headers)[0]
            page.assert_stayed_local()
        finally:
            page.close()
