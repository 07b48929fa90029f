"""The `tokens` auth mode's file: `fleet token mint` writes a hash, never the token, and the
gateway refuses a file it cannot trust with one line naming the problem."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest

from fleet_cli.main import main
from fleet_shared.errors import ConfigError
from fleet_shared.tenancy import ADMIN, READ_ALL_SESSIONS, Principal
from fleet_shared.tokens_file import load_tokens, mint_token


def test_minted_tokens_load_as_their_callers_and_only_hashes_are_stored(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    alice = mint_token(path, tenant="acme", user="alice", scopes=(ADMIN,))
    bob = mint_token(path, tenant="acme", user="bob", scopes=())
    carol = mint_token(path, tenant="globex", user="carol@globex.example", scopes=(READ_ALL_SESSIONS,))
    text = path.read_text()
    assert all(token not in text for token in (alice, bob, carol))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_tokens(path) == {
        hashlib.sha256(alice.encode()).hexdigest(): Principal("acme", "alice", frozenset({ADMIN})),
        hashlib.sha256(bob.encode()).hexdigest(): Principal("acme", "bob", frozenset()),
        hashlib.sha256(carol.encode()).hexdigest(): Principal(
            "globex", "carol@globex.example", frozenset({READ_ALL_SESSIONS})
        ),
    }
    assert len({alice, bob, carol}) == 3 and min(len(t) for t in (alice, bob, carol)) >= 40


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ('[[tokens]]\nsha256 = "abc"\ntenant = "t"\nuser = "u"\n', "is not 64 lowercase hex digits"),
        (
            f'[[tokens]]\nsha256 = "{"a" * 64}"\ntenant = "t"\nuser = "u"\nscopes = ["root"]\n',
            "unknown scope",
        ),
        (f'[[tokens]]\nsha256 = "{"a" * 64}"\ntenant = "t"\nuser = "u"\n' * 2, "is listed twice"),
        (f'[[tokens]]\nsha256 = "{"a" * 64}"\ntenant = "a b"\nuser = "u"\n', "tenant"),
        (f'[[tokens]]\nsha256 = "{"a" * 64}"\ntenant = "t"\nuser = "u"\ntoken = "x"\n', "token"),
        ("[[tokens]\n", "Expected"),
    ],
)
def test_a_file_the_gateway_cannot_trust_is_one_config_error(tmp_path: Path, body: str, problem: str) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(body)
    with pytest.raises(ConfigError) as info:
        load_tokens(path)
    assert problem in str(info.value) and str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_mint_refuses_names_that_could_break_the_file_and_unknown_scopes(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    for tenant, user, scopes in [('a"b', "u", ()), ("t", "u\n[[tokens]]", ()), ("t", "u", ("everything",))]:
        with pytest.raises(ConfigError):
            mint_token(path, tenant=tenant, user=user, scopes=scopes)
    assert not path.exists() or load_tokens(path) == {}


def test_fleet_token_mint_prints_the_token_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tokens.toml"
    with pytest.raises(SystemExit) as exited:
        main(
            ["token", "mint", "--file", str(path), "--tenant", "acme", "--user", "dana", "--scopes", "admin"]
        )
    assert exited.value.code == 0
    out, err = capsys.readouterr()
    token = out.strip()
    assert load_tokens(path)[hashlib.sha256(token.encode()).hexdigest()] == Principal(
        "acme", "dana", frozenset({ADMIN})
    )
    assert token not in err and str(path) in err
