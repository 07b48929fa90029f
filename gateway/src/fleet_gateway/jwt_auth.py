"""`gateway.auth.mode = "jwt"`: OIDC bearer JWTs verified by PyJWT against the provider's
published keys (JWKS), which are cached and refetched at a bounded rate."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import jwt
import structlog

from fleet_gateway.auth import refused
from fleet_gateway.errors import ApiError
from fleet_shared.config_file import JwtSection
from fleet_shared.tenancy import KNOWN_SCOPES, Principal

log = structlog.get_logger(__name__)
FETCH_TIMEOUT_SECONDS = 5.0
MAX_JWKS_BYTES = 256 * 1024


class JwksCache:
    """The provider's keys by `kid`. Kept `jwks_cache_seconds`; a token naming a `kid` the set
    lacks (the provider rotated) refetches it, but never twice within `jwks_min_refresh_seconds`,
    so tokens with made-up kids cannot turn the gateway into a load on the provider."""

    def __init__(self, url: str, *, cache_seconds: float, min_refresh_seconds: float) -> None:
        self.url, self.cache_seconds, self.min_refresh_seconds = url, cache_seconds, min_refresh_seconds
        self.keys: dict[str | None, jwt.PyJWK] = {}
        self.fetched_at = -float("inf")  # monotonic time of the last attempt, good or not
        self.lock = asyncio.Lock()

    async def key(self, kid: str | None) -> jwt.PyJWK | None:
        if time.monotonic() - self.fetched_at > self.cache_seconds or kid not in self.keys:
            await self.refresh()
        return self.keys.get(kid)

    async def refresh(self) -> None:
        async with self.lock:  # one fetch at a time; those who waited use its result
            if time.monotonic() - self.fetched_at >= self.min_refresh_seconds:
                self.fetched_at = time.monotonic()
                await self.fetch()
            if not self.keys:  # never fetched a usable set: the provider, not the token, is at fault
                raise ApiError(
                    503, "service_unavailable", "the identity provider's keys are unavailable; retry"
                )

    async def fetch(self) -> None:
        """The provider's current set in place of ours; on any failure, ours is kept."""
        try:
            async with (
                httpx.AsyncClient(timeout=FETCH_TIMEOUT_SECONDS, follow_redirects=False) as client,
                client.stream("GET", self.url, headers={"accept": "application/json"}) as response,
            ):
                response.raise_for_status()
                body = b""
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_JWKS_BYTES:
                        raise ValueError("the key set is too large")
            keyset = jwt.PyJWKSet.from_dict(json.loads(body))
        except (httpx.HTTPError, ValueError, jwt.PyJWKSetError) as exc:
            log.warning("auth.jwks_unavailable", error_type=type(exc).__name__)
            return
        keys: dict[str | None, jwt.PyJWK] = {key.key_id: key for key in keyset.keys}
        if len(keyset.keys) == 1:
            keys[None] = keyset.keys[0]  # a token without `kid` may use a set's only key
        self.keys = keys


class JwtVerifier:
    def __init__(self, settings: JwtSection) -> None:
        self.settings = settings
        self.keys = JwksCache(
            settings.jwks_url,
            cache_seconds=settings.jwks_cache_seconds,
            min_refresh_seconds=settings.jwks_min_refresh_seconds,
        )

    async def principal(self, token: str | None) -> Principal:
        if token is None:
            raise refused("a bearer JWT is required")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError:
            raise refused("the bearer token is not a JWT") from None
        if header.get("alg") not in self.settings.algorithms:
            raise refused("the token's algorithm is not allowed")
        kid = header.get("kid")
        key = await self.keys.key(kid if isinstance(kid, str) else None)
        if key is None:
            raise refused("the token is signed with a key the identity provider does not publish")
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=list(self.settings.algorithms),
                audience=self.settings.audience,
                issuer=self.settings.issuer,
                leeway=self.settings.leeway_seconds,
                options={"require": ["exp", "iss", "aud", "sub"]},
            )
        except jwt.ExpiredSignatureError:
            raise refused("the token has expired") from None
        except jwt.ImmatureSignatureError:
            raise refused("the token is not valid yet") from None
        except jwt.InvalidAudienceError:
            raise refused("the token is for another audience") from None
        except jwt.InvalidIssuerError:
            raise refused("the token is from another issuer") from None
        except jwt.InvalidTokenError:
            raise refused("the token's signature or claims are not valid") from None
        return self.principal_of(claims)

    def principal_of(self, claims: dict[str, Any]) -> Principal:
        tenant, user = claims.get(self.settings.tenant_claim), claims.get("sub")
        if not isinstance(tenant, str) or not 0 < len(tenant) <= 128:
            raise refused(f"the token has no `{self.settings.tenant_claim}` (tenant) claim")
        if not isinstance(user, str) or not 0 < len(user) <= 255:
            raise refused("the token has no usable `sub` claim")
        return Principal(tenant, user, scopes_of(claims) & KNOWN_SCOPES)


def scopes_of(claims: dict[str, Any]) -> frozenset[str]:
    """`scope` (space-separated, RFC 8693) or `scp` (a list, or a string, as Entra ID sends)."""
    found: set[str] = set()
    for name in ("scope", "scp"):
        value = claims.get(name)
        if isinstance(value, str):
            found.update(value.split())
        elif isinstance(value, list):
            found.update(item for item in value if isinstance(item, str))
    return frozenset(found)
