"""What a settings request may change: the attack chain's keys (a host interpreter, a data dir,
a sandbox uid, any variable's name, the model, the profile) are refused before the file is touched, and
startup refuses a hand-edited file that would show a secret as the model name."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from fleet_shared import policy_file
from fleet_shared.config import load_settings
from fleet_shared.errors import ConfigError, InvalidSettingChange

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in [n for n in os.environ if n.startswith("FLEET_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("FLEET_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("FLEET_API_TOKEN", "tok-never-a-model")
    shutil.copytree(REPO / "config" / "scripts", tmp_path / "scripts")
    copy = tmp_path / "fleet.toml"
    shutil.copyfile(REPO / "config" / "fleet.toml", copy)
    return copy


def revision(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


FILE_ONLY = [
    # F1: the interpreter the worker runs (planted in a workspace, it ran on the host).
    {"profiles.offline.sandbox.local.python": "/srv/fleet/.fleet/workspaces/ws/memory/py"},
    {"profiles.offline.sandbox.local.python": "auto"},
    {"profiles.offline.sandbox.local.python": None},
    {"profiles.offline.sandbox.local.uid_base": 1000},
    {"profiles.offline.sandbox.local.uid_count": 1},
    {"profiles.offline.sandbox.local.allow_unisolated": True},
    {"profiles.offline.storage.data_dir": "/tmp"},
    {"profiles.offline.storage.database_url": "sqlite+aiosqlite:////tmp/x.db"},
    {"profiles.offline.storage.redis_url": "unix:///tmp/r.sock"},
    {"profiles.offline.storage.blobs.backend": "s3"},
    {"profiles.offline.storage.blobs.local_dir": "/tmp/b"},
    {"profiles.offline.storage.blobs.s3_endpoint_env": "FLEET_S3_ENDPOINT"},
    # What is deleted: history (versions kept) and uploads under way (gc's grace).
    {"profiles.offline.storage.workspace_versions_kept": 1},
    {"profiles.offline.storage.gc_grace_seconds": 60},
    {"profiles.offline.llm.root.script": "/srv/fleet/.fleet/workspaces/ws/memory/s.jsonl"},
    {"profiles.offline.gateway.auth.token_env": "FLEET_LM_MODEL"},
    {"profiles.offline.gateway.allowed_hosts": ["*"]},
    {"profiles.offline.gateway.cors.allowed_origins": ["https://attacker.example"]},
    {"profiles.offline.worker.metrics_host": "0.0.0.0"},
    {"profiles.offline.worker.queue_name": "other:queue"},
    {"profiles.daytona.sandbox.daytona.volume": "another-deployments-volume"},
    {"profiles.daytona.sandbox.daytona.deployment": "another"},
    # A table that holds any of them cannot be removed whole (its keys would reset).
    {"profiles.offline.storage": None},
    {"profiles.offline.sandbox.local": None},
    {"profiles.local-recursive": None},
]


@pytest.mark.parametrize("change", FILE_ONLY, ids=lambda c: next(iter(c)))
def test_keys_that_choose_host_paths_executables_or_identities_are_file_only(
    config: Path, change: dict[str, object]
) -> None:
    before = config.read_bytes()
    with pytest.raises(InvalidSettingChange, match="only the file on disk") as info:
        policy_file.apply_changes(config, revision(config), change)  # type: ignore[arg-type]
    assert next(iter(change)) in str(info.value)
    assert config.read_bytes() == before


@pytest.mark.parametrize(
    "change",
    [
        # The model's name read from the API token, the DB or Redis URL, or the LM's key; the
        # model itself (it picks the provider, and so where the key is sent); the LM's key and
        # URL read from another secret's variable (review of #36: an allowlist by name let
        # OPENAI_BASE_URL send the key elsewhere).
        {"profiles.offline.llm.root.model": None, "profiles.offline.llm.root.model_env": "FLEET_API_TOKEN"},
        {"profiles.local.llm.root.model_env": "FLEET_LM_MODEL"},
        {"profiles.local.llm.root.api_key_env": "OPENAI_API_KEY"},
        {"profiles.local.llm.root.base_url_env": "OPENAI_BASE_URL"},
        {"profiles.offline.llm.root.model": "openai/gpt-test"},
        {"profiles.daytona.sandbox.daytona.api_key_env": "FLEET_DAYTONA_API_KEY"},
        {"profiles.daytona.sandbox.daytona.api_url_env": "FLEET_DAYTONA_API_URL"},
        # Which profile runs, and a profile the file does not have (its defaults would choose
        # the data dir, the queue and the store), choose every file-only key at once.
        {"config.default_profile": "local"},
        {"profiles.fresh.rlm.max_iters": 5},
        # What the store may hold.
        {"profiles.offline.storage.quota_session_mb": 0},
        {"profiles.offline.storage.quota_deployment_mb": 0},
        # Where cells run and workspaces go (review of #36): this host, or Daytona's.
        {"profiles.daytona.sandbox.provider": "local"},
    ],
    ids=lambda c: "+".join(f"{k}={v}" for k, v in c.items() if v),
)
def test_what_names_a_variable_or_picks_a_profile_is_file_only(
    config: Path, change: dict[str, object]
) -> None:
    before = config.read_bytes()
    with pytest.raises(InvalidSettingChange, match="only the file on disk"):
        policy_file.apply_changes(config, revision(config), change)  # type: ignore[arg-type]
    assert config.read_bytes() == before


def test_what_shapes_a_turn_still_goes_through(config: Path) -> None:
    policy_file.apply_changes(
        config,
        revision(config),
        {
            "profiles.offline.rlm.max_iters": 7,
            "profiles.offline.llm.root.temperature": 0.5,
            "profiles.offline.sandbox.local.cell_timeout_seconds": 30,
            "profiles.offline.storage.max_attachments_per_turn": 4,
        },
    )
    settings = load_settings({"FLEET_CONFIG": str(config), "FLEET_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert settings.profile.rlm.max_iters == 7
    assert settings.profile.sandbox.local.cell_timeout_seconds == 30


@pytest.mark.parametrize(
    "change",
    [
        {"profiles.offline.sandbox.local.workspace_files": 2_200_000_000},  # mkfs: under 2^32 inodes
        {"profiles.offline.sandbox.local.workspace_mb": 16_000_000},
        {"profiles.offline.sandbox.local.memory_mb": 2**40},
        {"profiles.offline.sandbox.local.max_processes": 10**9},
    ],
    ids=lambda c: next(iter(c)).rsplit(".", 1)[-1],
)
def test_a_budget_has_an_upper_bound(config: Path, change: dict[str, object]) -> None:
    """Review of #36: past these a root worker could make no workspace volume at all."""
    before = config.read_bytes()
    with pytest.raises(InvalidSettingChange, match="Expected `int` <="):
        policy_file.apply_changes(config, revision(config), change)  # type: ignore[arg-type]
    assert config.read_bytes() == before


def hand_edited(config: Path, old: str, new: str) -> dict[str, str]:
    text = config.read_text()
    assert old in text
    config.write_text(text.replace(old, new, 1))
    return {"FLEET_CONFIG": str(config), "FLEET_REDIS_URL": "redis://127.0.0.1:1/0"}


def test_a_hand_edited_daytona_provider_needs_its_table(config: Path) -> None:
    env = hand_edited(
        config,
        '[profiles.offline.sandbox]\nprovider = "local"',
        '[profiles.offline.sandbox]\nprovider = "daytona"',
    )
    with pytest.raises(ConfigError, match=r"no \[sandbox.daytona\] table"):
        load_settings(env)


# BLOB_MODEL is named like a model's variable, but another key reads it as a secret.
@pytest.mark.parametrize(
    "variable", ["FLEET_API_TOKEN", "FLEET_DATABASE_URL", "MY_SECRET_MODEL", "BLOB_MODEL"]
)
def test_startup_refuses_a_model_read_from_a_secrets_variable(config: Path, variable: str) -> None:
    """Edited into the file by hand (no request can), the secret would still be the model name:
    in the banner, the start-up log, the Run row and every stream's `start`."""
    env = hand_edited(
        config,
        'model = "scripted/demo"\nscript = "scripts/demo.jsonl"',
        f'model_env = "{variable}"\nscript = "scripts/demo.jsonl"',
    )
    config.write_text(
        config.read_text().replace(
            "[profiles.offline.storage]",
            '[profiles.offline.storage.blobs]\ns3_secret_key_env = "BLOB_MODEL"\n\n'
            "[profiles.offline.storage]",
        )
    )
    secret = "postgresql+asyncpg://u:hunter2@db/x"
    with pytest.raises(ConfigError) as info:
        load_settings({**env, variable: secret, "FLEET_DATABASE_URL": secret, "FLEET_API_TOKEN": "t/k"})
    assert f"model_env: {variable} holds a secret" in str(info.value)
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    "value",
    [
        "sk-live-abc",
        "postgresql+asyncpg://u:hunter2@db/x",
        "redis://:hunter2@h:6379/0",
        "a b/c",
        "x/" + "y" * 300,
    ],
)
def test_a_model_name_must_look_like_provider_slash_model(config: Path, value: str) -> None:
    env = hand_edited(
        config,
        'model = "scripted/demo"\nscript = "scripts/demo.jsonl"',
        'model_env = "FLEET_LM_MODEL"\nscript = "scripts/demo.jsonl"',
    )
    with pytest.raises(ConfigError, match=r"not a model name \(provider/model") as info:
        load_settings({**env, "FLEET_LM_MODEL": value})
    assert value not in str(info.value) and "hunter2" not in str(info.value)
