"""`gateway.auth.mode = "jwt"` against a JWKS served on loopback with keys made here: what a
token must be to name a caller, and how the key set is fetched and refetched."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Iterator
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

from fleet_gateway.errors import ApiError
from fleet_gateway.jwt_auth import JwtVerifier
from fleet_shared.config_file import JwtSection
from fleet_shared.tenancy import ADMIN, READ_ALL_SESSIONS, Principal
from tests.support.idp import AUDIENCE, ISSUER, JwksServer, rsa_key


@pytest.fixture
def jwks() -> Iterator[tuple[JwksServer, str]]:
    server = JwksServer()
    yield server, server.url
    server.stop()


def claims(**overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    base = {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "tid": "acme", "iat": now, "exp": now + 300}
    return {key: value for key, value in {**base, **overrides}.items() if value is not None}


def verifier(url: str, **settings: Any) -> JwtVerifier:
    return JwtVerifier(JwtSection(jwks_url=url, issuer=ISSUER, audience=AUDIENCE, **settings))


async def refusal(verifier: JwtVerifier, token: str | None) -> ApiError:
    with pytest.raises(ApiError) as info:
        await verifier.principal(token)
    return info.value


async def test_a_good_token_names_its_tenant_user_and_known_scopes(jwks: tuple[JwksServer, str]) -> None:
    state, url = jwks
    private, public = rsa_key("k1")
    state.keys = [public]
    token = jwt.encode(
        claims(scope=f"{ADMIN} openid", scp=[READ_ALL_SESSIONS]), private, "RS256", {"kid": "k1"}
    )
    found = await verifier(url).principal(token)
    assert found == Principal(
        "acme", "alice", frozenset({ADMIN, READ_ALL_SESSIONS})
    )  # unknown scopes dropped


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        pytest.param({"exp": -120}, "the token has expired", id="expired"),
        pytest.param({"nbf": 120}, "the token is not valid yet", id="not-yet-valid"),
        pytest.param({"aud": "another-api"}, "the token is for another audience", id="wrong-audience"),
        pytest.param({"iss": "https://evil.test/"}, "the token is from another issuer", id="wrong-issuer"),
        pytest.param({"tid": None}, "the token has no `tid` (tenant) claim", id="no-tenant"),
        pytest.param({"exp": None}, "the token's signature or claims are not valid", id="no-expiry"),
        pytest.param({"sub": None}, "the token's signature or claims are not valid", id="no-subject"),
    ],
)
async def test_a_token_with_bad_claims_is_401(
    jwks: tuple[JwksServer, str], overrides: dict[str, Any], reason: str
) -> None:
    state, url = jwks
    private, public = rsa_key("k1")
    state.keys = [public]
    now = int(time.time())  # times are offsets from now: the parameters are made at collection
    overrides = {k: now + v if k in ("exp", "nbf") and v is not None else v for k, v in overrides.items()}
    error = await refusal(verifier(url), jwt.encode(claims(**overrides), private, "RS256", {"kid": "k1"}))
    assert (error.status_code, error.code, error.message) == (401, "auth_required", reason)
    assert error.headers == {"WWW-Authenticate": "Bearer"}


async def test_clock_skew_within_the_leeway_is_accepted(jwks: tuple[JwksServer, str]) -> None:
    state, url = jwks
    private, public = rsa_key("k1")
    state.keys = [public]
    token = jwt.encode(claims(exp=int(time.time()) - 10), private, "RS256", {"kid": "k1"})
    assert (await verifier(url, leeway_seconds=30).principal(token)).user == "alice"
    assert (await refusal(verifier(url, leeway_seconds=0), token)).message == "the token has expired"


def unsigned(header: dict[str, Any], payload: dict[str, Any], sign: bytes | None = None) -> str:
    def part(value: dict[str, Any]) -> bytes:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=")

    signing_input = part(header) + b"." + part(payload)
    signature = b"" if sign is None else hmac.new(sign, signing_input, hashlib.sha256).digest()
    return (signing_input + b"." + base64.urlsafe_b64encode(signature).rstrip(b"=")).decode()


async def test_alg_none_and_hmac_signed_with_the_public_key_are_refused(jwks: tuple[JwksServer, str]) -> None:
    state, url = jwks
    private, public = rsa_key("k1")
    state.keys = [public]
    pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    check = verifier(url)
    none = await refusal(check, unsigned({"alg": "none", "kid": "k1"}, claims()))
    forged = await refusal(check, unsigned({"alg": "HS256", "kid": "k1", "typ": "JWT"}, claims(), sign=pem))
    assert none.message == forged.message == "the token's algorithm is not allowed"
    # Even were HS256 allowed, the published key is bound to RS256: the forgery cannot verify.
    assert (await refusal(check, "not.a.jwt")).message == "the bearer token is not a JWT"
    assert (await refusal(check, None)).message == "a bearer JWT is required"


async def test_a_token_signed_by_a_key_not_published_is_refused(jwks: tuple[JwksServer, str]) -> None:
    state, url = jwks
    _, published = rsa_key("k1")
    other, _ = rsa_key("k1")  # same kid, another key: a forger's
    state.keys = [published]
    error = await refusal(verifier(url), jwt.encode(claims(), other, "RS256", {"kid": "k1"}))
    assert error.message == "the token's signature or claims are not valid"


async def test_an_unknown_kid_refetches_the_keys_once_per_interval(jwks: tuple[JwksServer, str]) -> None:
    """A rotation is picked up; tokens with made-up kids cost at most one fetch per interval."""
    state, url = jwks
    old, old_public = rsa_key("old")
    new, new_public = rsa_key("new")
    ec_private = ec.generate_private_key(ec.SECP256R1())
    ec_public = {**json.loads(ECAlgorithm.to_jwk(ec_private.public_key())), "kid": "ec", "alg": "ES256"}
    state.keys = [old_public]
    check = verifier(url, jwks_min_refresh_seconds=60)
    assert (await check.principal(jwt.encode(claims(), old, "RS256", {"kid": "old"}))).tenant == "acme"
    assert state.fetches == 1
    state.keys = [old_public, new_public, ec_public]  # the provider rotates
    rotated = jwt.encode(claims(), new, "RS256", {"kid": "new"})
    assert (await refusal(check, rotated)).status_code == 401  # within the interval: no refetch
    for n in range(20):
        await refusal(check, jwt.encode(claims(), new, "RS256", {"kid": f"made-up-{n}"}))
    assert state.fetches == 1
    check.keys.fetched_at -= 61  # the interval has passed
    assert (await check.principal(rotated)).user == "alice"
    assert (await check.principal(jwt.encode(claims(), ec_private, "ES256", {"kid": "ec"}))).user == "alice"
    assert state.fetches == 2


async def test_a_provider_that_is_down_is_503_until_keys_are_known_then_the_cache_serves(
    jwks: tuple[JwksServer, str],
) -> None:
    state, url = jwks
    private, public = rsa_key("k1")
    token = jwt.encode(claims(), private, "RS256", {"kid": "k1"})
    state.down = True
    check = verifier(url, jwks_min_refresh_seconds=1, jwks_cache_seconds=10)
    for _ in range(3):  # the first fetch failed; within the interval, still the provider's fault
        error = await refusal(check, token)
        assert (error.status_code, error.code) == (503, "service_unavailable")
    assert state.fetches == 1
    state.down, state.keys = False, [public]
    check.keys.fetched_at -= 2
    assert (await check.principal(token)).user == "alice"
    state.down = True
    check.keys.fetched_at -= 11  # the cache has expired and the provider is down: keep its keys
    assert (await check.principal(token)).user == "alice"


async def test_a_key_set_past_its_size_bound_is_not_read_whole(jwks: tuple[JwksServer, str]) -> None:
    state, url = jwks
    private, public = rsa_key("k1")
    state.keys = [public] + [{"kty": "oct", "k": "x" * 1000, "kid": f"pad-{n}"} for n in range(300)]
    error = await refusal(verifier(url), jwt.encode(claims(), private, "RS256", {"kid": "k1"}))
    assert (error.status_code, error.code) == (503, "service_unavailable")
