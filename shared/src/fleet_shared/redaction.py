"""Secrets inside text: URL passwords, secret query parameters, bearer tokens and Authorization
values, found and masked the same way for the config's reprs, the log and `fleet doctor`."""

from __future__ import annotations

import re
from urllib.parse import unquote_plus

MASK = "***"
# Query (or `name=value`) parameters whose value is a secret: libpq's `password`/`sslpassword`,
# redis-py's `password`, the usual API key and token spellings, and any `<prefix>_<one of these>`
# (`access_token`, `client_secret`, `aws_secret_access_key`).
SECRET_NAMES = (
    "password",
    "passwd",
    "pwd",
    "sslpassword",
    "token",
    "secret",
    "api_?key",
    "access_?key",
    "secret_?key",
)
SECRET_NAME = rf"(?:[a-z0-9]+_)*(?:{'|'.join(SECRET_NAMES)})"
# A URL's query carrying one: what `has_credentials` refuses in the config file.
URL_SECRET_QUERY = re.compile(rf"[?&]{SECRET_NAME}=", re.IGNORECASE)
# `name=value` anywhere (a query, a libpq keyword DSN, a driver's error text): the value goes, but
# not a sentence's punctuation after it.
SECRET_ASSIGNMENT = re.compile(rf"(?<![\w-])({SECRET_NAME})=([^&#\s'\"]*[^&#\s'\",.;)])", re.IGNORECASE)
# `scheme://user:password@`. The password may hold `@` (up to the last one before the path) or `/`
# (then up to the first `@`, as SQLAlchemy reads it; not when it looks like `:port/`). A bare
# `scheme://token@` is masked whole.
URL_USERINFO = re.compile(
    r"://(?P<user>[^:/?#@\s]*)"
    r"(?P<colon>:(?P<password>[^\s/]*|(?!\d+/)(?:(?!://)[^\s@])*))?@"
)
# `user:password@host` with no scheme before it (an HTTP client's error may print the netloc alone).
BARE_USERINFO = re.compile(r"(?<![\w/:.@-])([\w.~%+-]+):[^\s@/]+@(?=[\w\[])")
AUTHORIZATION = re.compile(
    r"((?:proxy-)?authorization|x-api-key|api-key)(['\"]?\s*[:=]\s*['\"]?)([^\r\n'\",}]+)", re.IGNORECASE
)
BEARER = re.compile(r"\b(bearer)(\s+)[\w.~+/=-]{4,}", re.IGNORECASE)
# What code and config text carry: `api_key = "…"`, `{"token": "…"}`, `password: …` (quoted or
# not), and keys recognisable by their issuer's prefix wherever they stand.
SECRET_COLON_OR_QUOTED = re.compile(
    rf"(?<![\w-])({SECRET_NAME})(['\"]?\s*(?::\s*['\"]?|=\s*['\"]))([^\s'\",}}]+)", re.IGNORECASE
)
KNOWN_KEY = re.compile(
    r"\b(?:sk-[A-Za-z0-9_-]{16,}|ghp_[A-Za-z0-9]{20,}|github_pat_\w{20,}|AKIA[0-9A-Z]{16}|xox[abpr]-[\w-]{10,})"
)
# A cheap test before the regexes run (the log redacts every string of every line).
MAYBE_SECRET = re.compile(
    r"://|@|=|bearer|authorization|api-key|pass|pwd|token|secret|key|sk-|ghp_|github_pat_|AKIA|xox",
    re.IGNORECASE,
)


def redact_url(text: str) -> str:
    """`text` with every URL's password (or bare token user-info) and every secret parameter's
    value replaced by ***; the rest of each URL is kept. Any number of URLs in one string."""

    def masked(match: re.Match[str]) -> str:
        return f"://{match['user']}:{MASK}@" if match["colon"] else f"://{MASK}@"

    text = URL_USERINFO.sub(masked, text)
    return SECRET_ASSIGNMENT.sub(rf"\1={MASK}", text)


def redact_text(text: str) -> str:
    """`redact_url`, plus what free text and code carry: `user:pw@host` without a scheme,
    `Bearer <token>`, `Authorization: <value>`, `api_key = "<value>"` / `"token": "<value>"` /
    `password: <value>`, and keys known by their prefix (`sk-…`, `ghp_…`, `AKIA…`, `xox?-…`)."""
    if not MAYBE_SECRET.search(text):
        return text
    text = BARE_USERINFO.sub(rf"\1:{MASK}@", redact_url(text))
    text = AUTHORIZATION.sub(rf"\1\2{MASK}", text)
    text = SECRET_COLON_OR_QUOTED.sub(rf"\1\2{MASK}", text)
    text = KNOWN_KEY.sub(MASK, text)
    return BEARER.sub(rf"\1\2{MASK}", text)


def has_credentials(text: str) -> bool:
    """True for a URL carrying a secret: a password in its user-info (`user:pass@`, `:pass@`)
    or a password-like query parameter (`?password=`). A bare user name (`postgres@db`, trust
    auth) is not a secret."""
    if "://" not in text:
        return False
    match = URL_USERINFO.search(text)
    return (match is not None and match["colon"] is not None) or URL_SECRET_QUERY.search(text) is not None


def url_secrets(text: str) -> list[str]:
    """The secret values in a URL (or any text): passwords and secret parameters' values, as
    written and percent-decoded, for masking them wherever else they appear."""
    found = [match["password"] for match in URL_USERINFO.finditer(text) if match["colon"]]
    found += [match[2] for match in SECRET_ASSIGNMENT.finditer(text)]
    return sorted({form for secret in found if secret for form in (secret, unquote_plus(secret))})
