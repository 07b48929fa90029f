"""Which requests the gateway serves at all: by the name it is called by (Host) and by the web page
a request comes from (Origin, Sec-Fetch-Site).

A web page can make a browser send requests to the gateway: to its own name rebound to 127.0.0.1
(DNS rebinding: the browser then treats the answers as the page's own), or cross-site (a form,
`fetch` without CORS). The first is stopped by the Host check: only names the operator gave, the
loopback names and the bind address are served. The second by the Origin check: a request that
can change something (any method but GET, HEAD, OPTIONS) from a page of another origin is refused
unless the operator allowed that origin; and a multipart upload must carry a header no plain form
can send, so that it is never a CORS "simple request".
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Receive, Scope, Send

from fleet_gateway.middleware import send_envelope
from fleet_shared.config import Settings

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
BROWSER_OTHER_SITES = frozenset({"cross-site", "same-site"})  # Sec-Fetch-Site from another origin
UPLOAD_PATH = "/api/attachments"
UPLOAD_HEADERS = ("authorization", "x-requested-with")
# Headers this policy decides by: each may come once, and never as a list (a proxy may join repeated
# headers with commas), so that no proxy or handler can read a value other than the one checked.
SINGLE_HEADERS = frozenset({"host", "origin", "sec-fetch-site"})


@dataclass(frozen=True)
class RequestPolicy:
    """The names the gateway answers to and the web origins it accepts changes from."""

    names: frozenset[str]
    suffixes: tuple[str, ...]  # ".example.com" matches every name under it
    any_name: bool
    origins: frozenset[str]

    @classmethod
    def of(cls, settings: Settings) -> RequestPolicy:
        hosts = [host.lower().rstrip(".") for host in settings.allowed_hosts]
        return cls(
            names=LOOPBACK_NAMES | {unbracket(h) for h in hosts if not h.startswith(".") and h != "*"},
            suffixes=tuple(h for h in hosts if h.startswith(".")),
            any_name="*" in hosts,
            origins=frozenset(o.lower().rstrip("/") for o in settings.profile.gateway.cors.allowed_origins),
        )

    def serves(self, name: str, bind: str) -> bool:
        """Whether a request for host `name` is served by a gateway bound to `bind`."""
        if self.any_name or name in self.names:
            return True
        if name == unbracket(bind.lower()) and unbracket(bind) not in WILDCARD_BINDS:
            return True
        return any(name.endswith(suffix) for suffix in self.suffixes)


def unbracket(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def host_name(value: str) -> str | None:
    """The name in a Host header (or an origin's netloc), without its port: None if malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or (value[end + 1 :] and not value[end + 1 :].startswith(":")):
            return None
        name = value[1:end]
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            return None
        return name
    name, _, port = value.partition(":")
    if not name or (port and not port.isdigit()) or any(c in name for c in "/@ \\"):
        return None
    return name.rstrip(".")


def host_and_port(value: str) -> tuple[str | None, str]:
    name = host_name(value)
    rest = value.strip().lower().rsplit("]", 1)[-1]
    port = rest.rpartition(":")[2] if ":" in rest else ""
    return name, port


def same_origin(origin: str, host: str) -> bool:
    """An Origin header names the page the gateway itself serves (scheme aside: a proxy may end
    TLS in front of it), by the same name and port as the Host header."""
    parts = urlsplit(origin.strip().lower())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    default = "443" if parts.scheme == "https" else "80"
    origin_name, origin_port = host_and_port(parts.netloc)
    host_name_, host_port = host_and_port(host)
    theirs, ours = (origin_name, origin_port or default), (host_name_, host_port or default)
    return origin_name is not None and theirs == ours


Refusal = tuple[int, str, str]


def refusal(policy: RequestPolicy, scope: Scope) -> Refusal | None:
    """Why the gateway must not serve this request, or None."""
    headers: dict[str, str] = {}
    for key, value in scope.get("headers", []):
        header, text = key.decode("latin-1").lower(), value.decode("latin-1")
        if header in SINGLE_HEADERS and (header in headers or "," in text):
            return 400, "duplicate_header", f"the header {header} may come only once, with one value"
        headers[header] = text
    host = headers.get("host", "")
    name = host_name(host)
    server = scope.get("server") or ("", None)
    if name is None or not policy.serves(name, str(server[0])):
        return 421, "host_not_allowed", "this gateway does not answer to that name (gateway.allowed_hosts)"
    if scope.get("method", "GET") in SAFE_METHODS:
        return None
    origin = headers.get("origin")
    fetch_site = headers.get("sec-fetch-site")
    if origin is not None:
        if origin.lower().rstrip("/") not in policy.origins and not same_origin(origin, host):
            return 403, "origin_not_allowed", "requests from this web origin are refused (gateway.cors)"
    elif fetch_site in BROWSER_OTHER_SITES:
        return 403, "origin_not_allowed", "requests from another site are refused (gateway.cors)"
    if scope.get("path", "").rstrip("/") == UPLOAD_PATH and not any(h in headers for h in UPLOAD_HEADERS):
        return (
            403,
            "upload_header_required",
            "an upload needs the header X-Requested-With (any value) or a bearer token",
        )
    return None


def request_policy_middleware(policy: RequestPolicy) -> Callable[[ASGIApp], ASGIApp]:
    """Refuse (in the envelope) before any handler, guard or body read."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == ScopeType.HTTP:
                refused = refusal(policy, scope)
                if refused is not None:
                    await send_envelope(send, scope, *refused)
                    return
            await app(scope, receive, send)

        return middleware

    return wrap


def from_this_host(headers: Iterable[tuple[str, str]]) -> bool:
    """For the settings routes: no other web page at all, even an allowed origin's."""
    found = {name.lower(): value for name, value in headers}
    origin, host = found.get("origin"), found.get("host", "")
    if origin is not None and not same_origin(origin, host):
        return False
    return found.get("sec-fetch-site") in (None, "same-origin", "none")
