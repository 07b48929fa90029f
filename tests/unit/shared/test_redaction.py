"""Secrets inside text: what `redact_url`/`redact_text` mask, and what they leave alone."""

from __future__ import annotations

import pytest

from fleet_shared.config import has_credentials, redact_url
from fleet_shared.redaction import redact_text, url_secrets


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("postgresql+asyncpg://u@h/db?password=hunter2", "postgresql+asyncpg://***@h/db?password=***"),
        ("redis://h:1/0?password=x", "redis://h:1/0?password=***"),
        (
            "postgresql://h/db?sslmode=require&sslpassword=k&application_name=fleet",
            "postgresql://h/db?sslmode=require&sslpassword=***&application_name=fleet",
        ),
        (
            "https://lm/v1?API_KEY=a&apikey=b&access_token=c&client_secret=d&secret_key=e&pwd=f&passwd=g",
            "https://lm/v1?API_KEY=***&apikey=***&access_token=***&client_secret=***&secret_key=***"
            "&pwd=***&passwd=***",
        ),
        ("https://lm/v1?token_type=bearer&page=2#token", "https://lm/v1?token_type=bearer&page=2#token"),
        ("postgresql+asyncpg://u:pa/ss@db:5432/fleet", "postgresql+asyncpg://u:***@db:5432/fleet"),
        ("postgresql://u:p/w@x@h/db", "postgresql://u:***@x@h/db"),
        ("https://user:p@ss@lm.internal/v1", "https://user:***@lm.internal/v1"),
        ("postgresql://u:%2Fp%40w@h/db", "postgresql://u:***@h/db"),
        (
            "a redis://:r1@h/0 and postgresql://u:p2@d/db?password=p3, then https://t0k@lm/v1",
            "a redis://:***@h/0 and postgresql://u:***@d/db?password=***, then https://***@lm/v1",
        ),
        ("['redis://:r1@h/0','postgresql://u:p2@d/db']", "['redis://:***@h/0','postgresql://u:***@d/db']"),
    ],
)
def test_redact_url_masks_every_password_and_secret_parameter_and_keeps_the_rest(
    text: str, shown: str
) -> None:
    assert redact_url(text) == shown


@pytest.mark.parametrize(
    "text",
    [
        "http://127.0.0.1:8/v1",
        "postgresql+asyncpg://db:5432/fleet?sslmode=require&application_name=fleet",
        "sqlite+aiosqlite:///var/lib/fleet/fleet.db",
        "http://h:8080/a@b",
        "https://h/x:y@z",
        "mail bob@example.com about it",
    ],
)
def test_text_without_secrets_is_unchanged(text: str) -> None:
    assert redact_url(text) == text
    assert redact_text(text) == text


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("sent Authorization: Bearer abc.def-ghi", "sent Authorization: ***"),
        ("{'Authorization': 'Basic dXNlcjpwdw=='}", "{'Authorization': '***'}"),
        ("retry with Bearer sk-123456 now", "retry with Bearer *** now"),
        ("no proxyuser:PROXY-PW@127.0.0.1:1", "no proxyuser:***@127.0.0.1:1"),
        ("connect: host=db password=s3cret, retrying", "connect: host=db password=***, retrying"),
        ("the token expired", "the token expired"),
        ('client(api_key="sk-live-0123456789abcdef")', 'client(api_key="***")'),
        ("API_KEY = 'abc123def456'", "API_KEY = '***'"),
        ('{"api_key": "k-123", "model": "gpt"}', '{"api_key": "***", "model": "gpt"}'),
        ("token: ghp_0123456789abcdefghijABCD", "token: ***"),
        ("password: hunter22", "password: ***"),
        ("key is sk-proj-0123456789abcdefXYZ, use it", "key is ***, use it"),
        ("aws AKIAABCDEFGHIJKLMNOP here", "aws *** here"),
        ("max_tokens: 100, tokens: 5", "max_tokens: 100, tokens: 5"),
        ('{"token_count": 5, "secretary": "ada"}', '{"token_count": 5, "secretary": "ada"}'),
    ],
)
def test_redact_text_also_masks_what_free_text_carries(text: str, shown: str) -> None:
    assert redact_text(text) == shown


def test_url_secrets_are_the_values_as_written_and_decoded() -> None:
    url = "postgresql://u:p%40ss/1@h/db?sslmode=require&password=q%2Bw&api_key=k1"
    assert url_secrets(url) == sorted({"p%40ss/1", "p@ss/1", "q%2Bw", "q+w", "k1"})
    assert url_secrets("postgresql://u@h/db?sslmode=require") == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("postgresql://u:pa/ss@h/db", True),
        ("postgresql://h/db?sslpassword=pw", True),
        ("https://lm/v1?access_token=t", True),
        ("https://lm/v1?token_type=bearer", False),
        ("https://t0k@lm/v1", False),
    ],
)
def test_has_credentials_shares_the_definitions(text: str, expected: bool) -> None:
    assert has_credentials(text) is expected
