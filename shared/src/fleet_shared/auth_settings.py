"""The `gateway.auth` keys' checks at load time, and what counts as a loopback host."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

import msgspec

from fleet_shared.config_file import AuthSection
from fleet_shared.errors import ConfigError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_auth(auth: AuthSection, key: str, env: Mapping[str, str], base: Path) -> Path | None:
    """The tokens file for `mode = "tokens"`; the keys `mode = "jwt"` cannot work without."""
    if auth.mode == "tokens":
        named = env.get("FLEET_AUTH_TOKENS_FILE") or auth.tokens_file
        if not named:
            raise ConfigError(
                f"{key}.tokens_file is empty and FLEET_AUTH_TOKENS_FILE is not set (mode = tokens)"
            )
        return base / named
    if auth.mode == "jwt":
        jwt = auth.jwt
        for name in ("jwks_url", "issuer", "audience"):
            if not getattr(jwt, name):
                raise ConfigError(f"{key}.jwt.{name} is required (mode = jwt)")
        url = urlsplit(jwt.jwks_url)
        if url.scheme != "https" and not (url.scheme == "http" and is_loopback(url.hostname or "")):
            raise ConfigError(f"{key}.jwt.jwks_url must be https (http only to a loopback address)")
    return None


# What a deployment (the chart) sets without editing the file: the mode and the OIDC provider.
AUTH_ENV = {"FLEET_AUTH_MODE": "mode"}
JWT_ENV = {
    "FLEET_AUTH_JWKS_URL": "jwks_url",
    "FLEET_AUTH_JWT_ISSUER": "issuer",
    "FLEET_AUTH_JWT_AUDIENCE": "audience",
    "FLEET_AUTH_JWT_TENANT_CLAIM": "tenant_claim",
}


def auth_from_env(auth: AuthSection, env: Mapping[str, str]) -> AuthSection:
    """The profile's `gateway.auth`, with the FLEET_AUTH_* variables that are set in its place."""
    jwt_changes = {field: env[name] for name, field in JWT_ENV.items() if env.get(name)}
    changes: dict[str, object] = {field: env[name] for name, field in AUTH_ENV.items() if env.get(name)}
    if jwt_changes:
        changes["jwt"] = msgspec.structs.replace(auth.jwt, **jwt_changes)
    if not changes:
        return auth
    try:  # the same checks as the file's keys get
        return msgspec.convert(msgspec.to_builtins(msgspec.structs.replace(auth, **changes)), AuthSection)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"FLEET_AUTH_*: {exc}") from None
