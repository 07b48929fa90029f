"""The webhook target policy (SSRF) and the retry schedule, as pure functions; the checked
network backend with an injected resolver. Real sockets: tests/integration/test_webhooks.py."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
from datetime import UTC, datetime, timedelta

import pytest

from fleet_shared.config import ConfigError, load_settings
from fleet_shared.config_file import WebhooksSection
from fleet_shared.db.webhooks import Taken
from fleet_shared.webhook_delivery import expired, next_step, retry_delay
from fleet_shared.webhook_targets import CheckedBackend, IPAddress, TargetPolicy, TargetRefused
from tests.unit.shared.test_config import shipped_env

DEFAULT = TargetPolicy.of(WebhooksSection())


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example.com/fleet",
        "https://93.184.216.34:8443/x?y=1",
        "https://[2606:4700:4700::1111]/x",
    ],
)
def test_public_https_targets_pass(url: str) -> None:
    DEFAULT.check_url(url)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://hooks.example.com/x", "must be https"),
        ("https://127.0.0.1/x", "not a public address"),
        ("https://localhost/x", "not a public address"),
        ("https://app.localhost/x", "not a public address"),
        ("https://10.0.0.1/x", "not a public address"),
        ("https://172.16.5.4/x", "not a public address"),
        ("https://192.168.1.1/x", "not a public address"),
        ("https://100.64.0.1/x", "not a public address"),  # shared (carrier-grade NAT)
        ("https://169.254.169.254/x", "not a public address"),  # cloud metadata
        ("https://[fe80::1]/x", "not a public address"),
        ("https://[fd00::1]/x", "not a public address"),
        ("https://[::ffff:93.184.216.34]/x", "not a public address"),  # IPv4 written as IPv6
        ("https://224.0.0.1/x", "not a public address"),
        ("https://user@hooks.example.com/x", "credentials"),
        ("https:///x", "needs a host"),
        ("https://hooks.example.com:0/x", "port other than 0"),
        ("https://hooks.example.com:99999/x", "not a URL"),
        ("https://" + "a" * 2050 + ".com/", "at most 2048"),
        ("javascript:alert(1)", "must be https"),
        # Legacy IPv4 numbers, read as the system resolver reads them.
        ("https://2130706433/x", "127.0.0.1 is not a public"),
        ("https://127.1/x", "127.0.0.1 is not a public"),
        ("https://0x7f000001/x", "127.0.0.1 is not a public"),
        ("https://0177.0.0.1/x", "127.0.0.1 is not a public"),
        ("https://10.1/x", "10.0.0.1 is not a public"),
        # IPv6 ranges that carry an IPv4 address, public or not.
        ("https://[64:ff9b::a00:5]/x", "not a public address"),  # NAT64 of 10.0.0.5
        ("https://[64:ff9b:1::a00:5]/x", "not a public address"),
        ("https://[::7f00:1]/x", "not a public address"),  # IPv4-compatible
        ("https://[::ffff:0:7f00:1]/x", "not a public address"),  # SIIT
        ("https://[2002:7f00:1::]/x", "not a public address"),  # 6to4
        ("https://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/x", "not a public address"),  # Teredo
        # Not printable ASCII: httpcore would refuse it mid-delivery, glibc would cut it at the NUL.
        ("https://exämple.com/x", "printable ASCII"),
        ("https://evil.example\x00.test/x", "printable ASCII"),
        ("https://evil.example/x y", "printable ASCII"),
    ],
)
def test_refused_targets_say_why(url: str, why: str) -> None:
    with pytest.raises(TargetRefused, match=why):
        DEFAULT.check_url(url)


def test_allowed_networks_and_http_open_only_what_they_name() -> None:
    policy = TargetPolicy.of(WebhooksSection(allow_http=True, allowed_networks=["10.20.0.0/16", "::1"]))
    policy.check_url("http://10.20.3.4:8080/x")
    policy.check_url("http://[::1]/x")
    with pytest.raises(TargetRefused):
        policy.check_url("http://10.21.0.1/x")
    with pytest.raises(TargetRefused):
        policy.check_url("http://127.0.0.1/x")


def test_the_backend_refuses_a_name_if_any_address_it_resolves_to_is_refused() -> None:
    async def resolve(host: str, port: int) -> list[IPAddress]:
        return [ipaddress.ip_address("93.184.216.34"), ipaddress.ip_address("10.0.0.9")]

    backend = CheckedBackend(DEFAULT, resolve)
    with pytest.raises(TargetRefused, match=r"10\.0\.0\.9"):
        asyncio.run(backend.connect_tcp("mixed.example.test", 443))
    with pytest.raises(TargetRefused, match="Unix socket"):
        asyncio.run(backend.connect_unix_socket("/run/docker.sock"))


def test_the_retry_schedule_doubles_to_an_hour_and_gives_up_after_the_window() -> None:
    assert [retry_delay(5, n) for n in (1, 2, 3, 4)] == [5, 10, 20, 40]
    assert retry_delay(5, 40) == 3600
    section = WebhooksSection(first_retry_seconds=5, give_up_seconds=60)
    ended = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
    taken = Taken("d", "https://h.example/x", "{}", attempt=1, created_at=ended, lease_until=ended)
    assert next_step(section, taken, 200, False, ended) == ("delivered", None)
    assert next_step(section, taken, 500, False, ended) == ("pending", ended + timedelta(seconds=5))
    assert next_step(section, taken, None, False, ended) == ("pending", ended + timedelta(seconds=5))
    assert next_step(section, taken, 410, False, ended) == ("failed", None)
    assert next_step(section, taken, None, True, ended) == ("failed", None)  # the policy refused it
    late = ended + timedelta(seconds=58)
    assert next_step(section, taken, 500, False, late) == ("failed", None)  # past the window
    assert not expired(section, taken, late) and expired(section, taken, ended + timedelta(seconds=61))


def test_the_signing_secret_must_be_a_whsec_key_of_24_bytes_or_more() -> None:
    good = "whsec_" + base64.b64encode(b"k" * 32).decode()
    assert load_settings(shipped_env(FLEET_WEBHOOK_SECRET=good)).webhook_secret is not None
    assert load_settings(shipped_env()).webhook_secret is None
    for bad in ("whsec_short", "not base64 at all!", "whsec_" + base64.b64encode(b"k" * 8).decode()):
        with pytest.raises(ConfigError, match="FLEET_WEBHOOK_SECRET") as info:
            load_settings(shipped_env(FLEET_WEBHOOK_SECRET=bad))
        assert bad not in str(info.value)  # the value is never echoed
