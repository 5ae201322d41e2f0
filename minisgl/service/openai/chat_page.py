"""The chat page at `/`, as llama-server has one: a single static file (`chat.html`, its script and style
inline) that talks to this server's /v1/chat/completions. It is served with a Content-Security-Policy
that runs only that script (by its hash) and lets the page connect to this server alone: nothing is
fetched from elsewhere, and markup that slipped into a reply could run nothing."""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

from fastapi.responses import HTMLResponse


@functools.cache
def _page() -> tuple[str, str]:
    """The page and its Content-Security-Policy (read once)."""
    html = resources.files(__package__).joinpath("chat.html").read_text(encoding="utf-8")
    scripts = re.findall(r"<script>(.*?)</script>", html, re.DOTALL)
    hashes = " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in scripts
    )
    policy = [
        "default-src 'none'",
        f"script-src {hashes}",
        "style-src 'unsafe-inline'",
        "connect-src 'self'",
        "img-src data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
    return html, "; ".join(policy)


def chat_page() -> HTMLResponse:
    """GET /: the page, with headers that keep it to itself (no framing, no referrer sent on a link)."""
    html, policy = _page()
    headers = {
        "Content-Security-Policy": policy,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }
    return HTMLResponse(html, headers=headers)
