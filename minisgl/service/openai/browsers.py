"""Keeping web pages away from a server without an API key, as llama.cpp and Jupyter do.

Without `--api-key`, anything that can reach the port can use the server; a web page the user opens can
too: it can POST a `text/plain` body (no CORS preflight), and a DNS-rebinding page (its own name
re-pointed at 127.0.0.1) can even read the replies. So a key-less server answers 403 to a request whose
`Host` is not a name of this server (a loopback name or address, the `--host` address; any IP address and
this machine's name when it listens on every interface) or whose `Origin` is another site, unless
`--allowed-hosts` / `--allowed-origins` list it (`*`: any). The JSON endpoints also require a JSON
`Content-Type` (protocol.py, HTTP 415), which a page cannot send without the preflight that this server
never answers. With `--api-key` the key is the protection: none of this applies."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_response

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def split_names(text: str) -> set[str]:
    """A comma-separated option -> its lower-case entries."""
    return {n.strip().lower() for n in text.split(",") if n.strip()}


def hostname(authority: str) -> str:
    """`host[:port]` (or `[v6]:port`) -> the host, lower-case, without brackets."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        return authority[1 : authority.find("]")] if "]" in authority else authority
    if authority.count(":") == 1:
        return authority.rsplit(":", 1)[0]
    return authority


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_loopback(name: str) -> bool:
    """localhost, *.localhost (RFC 6761: always this machine), 127.0.0.0/8, ::1."""
    ip = _ip(name)
    return ip.is_loopback if ip is not None else name in LOOPBACK_NAMES or name.endswith(".localhost")


class LocalOnly:
    """Which Host and Origin values a key-less server accepts."""

    def __init__(self, bind_host: str, allowed_hosts: str, allowed_origins: str) -> None:
        self.bind = hostname(bind_host)
        self.everywhere = bind_host.strip() in WILDCARD_HOSTS  # listening on every interface
        self.hosts = split_names(allowed_hosts)
        self.origins = {o.rstrip("/") for o in split_names(allowed_origins)}
        self.machine = {socket.gethostname().lower(), socket.getfqdn().lower()} if self.everywhere else set()

    def host_ok(self, host: str) -> bool:
        if "*" in self.hosts or not host:  # no Host at all: HTTP/1.0, not a browser
            return True
        name = hostname(host)
        if is_loopback(name) or name == self.bind or name in self.hosts:
            return True
        # an IP address cannot be re-pointed by DNS: on every interface, the machine's addresses are fine
        return self.everywhere and (_ip(name) is not None or name in self.machine)

    def origin_ok(self, origin: str, host: str) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if "*" in self.origins or origin in self.origins:
            return True
        if origin == "null":  # a sandboxed frame or a file: never this server's own page
            return False
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False
        # the server's own page (same host and port as the request's), or a page served by this machine
        return parts.netloc == host.strip().lower() or is_loopback(hostname(parts.netloc))


class LocalOnlyMiddleware:
    """A plain ASGI middleware (as APIKeyMiddleware): 403 before any route runs, unknown routes included."""

    def __init__(self, app: ASGIApp, policy: LocalOnly) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {
            k.lower(): v.decode("latin-1") for k, v in scope["headers"] if k.lower() in (b"host", b"origin")
        }
        host, origin = headers.get(b"host", ""), headers.get(b"origin")
        problem = None
        if not self.policy.host_ok(host):
            problem = f"the Host {_quoted(host)} is not a name of this server; list it in --allowed-hosts"
        elif origin is not None and not self.policy.origin_ok(origin, host):
            problem = (
                f"requests from the web page at {_quoted(origin)} are refused; list it in --allowed-origins"
            )
        if problem is None:
            await self.app(scope, receive, send)
            return
        message = f"{problem} (or start the server with --api-key)"
        await error_response(403, message, "forbidden", kind="permission_error")(scope, receive, send)


def _quoted(value: str) -> str:
    """A header's value, printable and short, for an error message."""
    return ascii(value[:100])
