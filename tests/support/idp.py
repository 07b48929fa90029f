"""An OIDC provider's key endpoint (JWKS) on loopback, with keys made in the test: what
`gateway.auth.mode = "jwt"` fetches. What it publishes can change, it counts its fetches, and it
can be down."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

ISSUER, AUDIENCE = "https://idp.fleet.test/", "fleet-api"


def rsa_key(kid: str) -> tuple[rsa.RSAPrivateKey, dict[str, Any]]:
    """A private key and its public JWK, bound to RS256."""
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = json.loads(RSAAlgorithm.to_jwk(private.public_key()))
    return private, {**public, "kid": kid, "alg": "RS256", "use": "sig"}


class JwksServer:
    def __init__(self) -> None:
        self.keys: list[dict[str, Any]] = []
        self.fetches = 0
        self.down = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.fetches += 1
                if server.down:
                    self.send_response(503)
                    self.end_headers()
                    return
                body = json.dumps({"keys": server.keys}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/jwks.json"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class LoopbackIdp:
    """One signing key, published by a JwksServer; tokens for any tenant and user."""

    def __init__(self) -> None:
        self.server = JwksServer()
        self.private, public = rsa_key("fleet-test")
        self.server.keys = [public]

    def env(self) -> dict[str, str]:
        return {
            "FLEET_AUTH_MODE": "jwt",
            "FLEET_AUTH_JWKS_URL": self.server.url,
            "FLEET_AUTH_JWT_ISSUER": ISSUER,
            "FLEET_AUTH_JWT_AUDIENCE": AUDIENCE,
        }

    def token(self, *, tenant: str, user: str, scopes: tuple[str, ...] = (), ttl: int = 6 * 3600) -> str:
        now = int(time.time())
        claims = {"iss": ISSUER, "aud": AUDIENCE, "sub": user, "tid": tenant, "iat": now, "exp": now + ttl}
        return jwt.encode({**claims, "scope": " ".join(scopes)}, self.private, "RS256", {"kid": "fleet-test"})

    def stop(self) -> None:
        self.server.stop()
