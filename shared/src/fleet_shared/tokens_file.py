"""The `tokens` auth mode's file (docs/security.md, tenancy): each entry binds a token's sha256,
never the token, to a tenant, a user and scopes. `fleet token mint` adds one and prints the
token once; the gateway reads the file at start."""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import tomllib
from pathlib import Path
from typing import Annotated

import msgspec

from fleet_shared.errors import ConfigError
from fleet_shared.tenancy import KNOWN_SCOPES, Principal

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._@:-]+$")]
TOKEN_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class TokenEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    sha256: str
    tenant: Name
    user: Name
    scopes: tuple[str, ...] = ()


class TokenFileBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tokens: tuple[TokenEntry, ...] = ()


def load_tokens(path: Path) -> dict[str, Principal]:
    """Each entry's caller by its token's sha256; a ConfigError (one line) for any problem."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        body = msgspec.convert(raw, TokenFileBody)
    except OSError as exc:
        raise ConfigError(f"cannot read the tokens file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    by_hash: dict[str, Principal] = {}
    for entry in body.tokens:
        if not TOKEN_SHA256.match(entry.sha256):
            raise ConfigError(f"{path}: sha256 {entry.sha256[:16]!r}… is not 64 lowercase hex digits")
        check_scopes(entry.scopes, f"{path}: ")
        if entry.sha256 in by_hash:
            raise ConfigError(f"{path}: the token {entry.sha256[:12]}… is listed twice")
        by_hash[entry.sha256] = Principal(entry.tenant, entry.user, frozenset(entry.scopes))
    return by_hash


def check_scopes(scopes: tuple[str, ...], where: str = "") -> None:
    unknown = set(scopes) - KNOWN_SCOPES
    if unknown:
        raise ConfigError(f"{where}unknown scope(s) {sorted(unknown)} (known: {sorted(KNOWN_SCOPES)})")


def mint_token(path: Path, *, tenant: str, user: str, scopes: tuple[str, ...]) -> str:
    """A new random token for `tenant`/`user`, its hash appended to the file (created 0600)."""
    fields = {"sha256": "0" * 64, "tenant": tenant, "user": user, "scopes": scopes}
    try:
        entry = msgspec.convert(fields, TokenEntry)
    except msgspec.ValidationError as exc:  # names are letters, digits and . _ @ : - only
        raise ConfigError(f"cannot mint that token: {exc}") from None
    load_tokens(path)  # never append to a file the gateway would refuse
    check_scopes(scopes)
    token = secrets.token_urlsafe(32)
    digest = hashlib.sha256(token.encode()).hexdigest()
    lines = [
        "",
        "[[tokens]]",
        f'sha256 = "{digest}"',
        f'tenant = "{entry.tenant}"',
        f'user = "{entry.user}"',
        "scopes = [{}]".format(", ".join(f'"{scope}"' for scope in entry.scopes)),
    ]
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as out:
        out.write("\n".join(lines) + "\n")
    return token
