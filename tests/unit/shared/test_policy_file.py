"""`fleet_shared.policy_file`: edits of a copy of the shipped policy file keep its comments, pass
startup's validation or write nothing, refuse secrets, and replace the file atomically."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from pathlib import Path

import pytest

from fleet_shared import policy_file
from fleet_shared.config import load_settings
from fleet_shared.errors import ConfigError, InvalidSettingChange, SettingsConflict
from tests.support.policy import LOCAL_LM_ENV

REPO = Path(__file__).resolve().parents[3]
SHIPPED = REPO / "config" / "fleet.toml"


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # A change is loaded as a restart would load it, with the process's environment: the
    # gateway's has a Redis URL, and nothing else of the shipped profiles is needed for offline.
    for name in [n for n in os.environ if n.startswith("FLEET_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("FLEET_REDIS_URL", "redis://127.0.0.1:1/0")
    shutil.copytree(REPO / "config" / "scripts", tmp_path / "scripts")  # the offline profile's script
    copy = tmp_path / "fleet.toml"
    shutil.copyfile(SHIPPED, copy)
    return copy


def leftovers(config: Path) -> list[str]:
    """Files beside the policy file other than its lock file (kept: writers of every process share it)."""
    return sorted(
        p.name
        for p in config.parent.iterdir()
        if p.name not in (config.name, f".{config.name}.lock", "scripts")
    )


def revision(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def comments(text: str) -> list[str]:
    return [line[line.index("#") :] for line in text.splitlines() if "#" in line]


def test_the_snapshot_names_the_file_and_holds_the_profiles(config: Path) -> None:
    snapshot = policy_file.read_snapshot(config)
    assert snapshot.revision == revision(config)
    assert snapshot.name == "fleet.toml"
    assert snapshot.default_profile == "offline"
    assert snapshot.profiles["local"]["llm"]["root"]["api_key_env"] == "FLEET_LM_API_KEY"
    assert set(snapshot.profiles) >= {"offline", "local", "daytona"}


def test_a_change_keeps_every_comment_and_loads_at_startup(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in LOCAL_LM_ENV.items():
        monkeypatch.setenv(name, value)
    before = config.read_text()
    snapshot = policy_file.apply_changes(
        config,
        revision(config),
        {
            "profiles.local.rlm.max_iters": 30,
            "profiles.offline.worker.lease_seconds": 4,  # the line carries a trailing comment
            "profiles.offline.rlm.max_iters": 11,
        },
    )
    after = config.read_text()
    assert comments(after) == comments(before)
    assert "lease_seconds = 4  # renewed every second" in after
    assert snapshot.revision == revision(config) and snapshot.default_profile == "offline"
    assert snapshot.profiles["local"]["rlm"]["max_iters"] == 30
    # Only the three lines changed.
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines(), strict=True) if a != b]
    assert len(changed) == 3
    settings = load_settings(
        {
            "FLEET_CONFIG": str(config),
            "FLEET_PROFILE": "offline",
            "FLEET_REDIS_URL": "redis://127.0.0.1:1/0",
            "FLEET_SCRIPTED_LM": str(REPO / "config" / "scripts" / "demo.jsonl"),
        }
    )
    assert settings.profile.worker.lease_seconds == 4


def test_a_new_table_is_created_and_null_removes_a_key(config: Path) -> None:
    policy_file.apply_changes(
        config,
        revision(config),
        {
            "profiles.daytona.sandbox.local.cpus": 2.0,
            "profiles.daytona.worker.drain_seconds": None,
        },
    )
    snapshot = policy_file.read_snapshot(config)
    assert snapshot.profiles["daytona"]["sandbox"]["local"] == {"cpus": 2.0}
    assert snapshot.profiles["daytona"]["sandbox"]["provider"] == "daytona"
    assert "drain_seconds" not in snapshot.profiles["daytona"]["worker"]
    assert "[profiles.daytona.sandbox.local]" in config.read_text()


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"profiles.local.rlm.max_iters": 1000}, "profiles.local.rlm.max_iters"),
        ({"profiles.local.rlm.max_iters": "many"}, "profiles.local.rlm.max_iters"),
        ({"profiles.local.rlm.bogus": 1}, "profiles.local.rlm.bogus: unknown key"),
        ({"config.bogus": 1}, "config.bogus: unknown key"),
        ({"config.default_profile": "nowhere"}, "only the file on disk"),
        ({"profiles.offline": None}, "profiles.offline: holds keys only the file"),
        ({"profiles.local.rlm.max_iters.deeper": 1}, "profiles.local.rlm.max_iters: is a value"),
        ({"profiles.local.rlm": 3}, "profiles.local.rlm: is a table"),
        ({"bogus.key": 1}, "bogus.key: not a setting"),
        ({"profiles": 1}, "profiles: not a setting"),
        ({'profiles."odd key".x': 1}, "not a setting"),
        ({"profiles.local.llm.root.api_key_env": "sk-live-0123"}, "only the file on disk"),
        ({"profiles.local.llm.root.api_key_env": 5}, "only the file on disk"),
        ({"profiles.offline.llm.root.model": "x://u:hunter2@h"}, "only the file on disk"),
        ({"profiles.offline.llm.root.model": None}, "only the file on disk"),
        ({"config.default_profile": "local"}, "only the file on disk"),
        ({"profiles.offline.rlm.title": "x"}, "unknown key"),
        # Valid per profile, but the next startup would fail: refused now (found in review).
        ({"profiles.offline.sandbox.provider": "daytona"}, "only the file on disk"),
        ({f"profiles.offline.rlm.k{i}": i for i in range(51)}, "at most 50"),
        ({}, "at least one"),
    ],
)
def test_a_refused_change_writes_nothing(config: Path, changes: dict[str, object], named: str) -> None:
    before = config.read_bytes()
    with pytest.raises(InvalidSettingChange) as info:
        policy_file.apply_changes(config, revision(config), changes)  # type: ignore[arg-type]
    message = str(info.value)
    assert named in message and "\n" not in message
    assert "hunter2" not in message and str(config.parent) not in message
    assert config.read_bytes() == before
    assert leftovers(config) == []  # no temp file left


def test_a_change_that_would_switch_bearer_auth_off_is_refused(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No request can reach the keys that decide it (token_env, default_profile, a new profile
    are file-only); the restart check refuses it all the same if one ever could."""
    monkeypatch.setenv("FLEET_API_TOKEN", "tok")
    candidate = config.read_text().replace('default_profile = "offline"', 'default_profile = "other"') + (
        '\n[profiles.other.llm.root]\nmodel = "scripted/demo"\nscript = "scripts/demo.jsonl"\n'
        '\n[profiles.other.gateway.auth]\ntoken_env = "FLEET_OTHER_TOKEN"\n'
    )
    with pytest.raises(InvalidSettingChange, match="switch bearer auth off"):
        policy_file.check_restart(candidate.encode(), config, (), require_auth=True)


def test_writers_in_other_processes_wait_for_the_lock(config: Path) -> None:
    """Found in review: the lock was per process. Two processes change the file from one
    revision: one wins, the other gets a conflict, and no update is lost silently."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    start = revision(config)
    results = context.Queue()
    processes = [
        context.Process(target=change_in_child, args=(config, start, 40 + i, results)) for i in range(4)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(30)
    outcomes = sorted(results.get(timeout=5) for _ in processes)
    assert outcomes.count("conflict") == 3 and len([o for o in outcomes if o.startswith("ok")]) == 1


def change_in_child(config: Path, start: str, value: int, results: object) -> None:
    try:
        policy_file.apply_changes(config, start, {"profiles.local.rlm.max_iters": value})
        results.put(f"ok {value}")  # type: ignore[attr-defined]
    except SettingsConflict:
        results.put("conflict")  # type: ignore[attr-defined]


def test_a_profile_a_process_runs_cannot_be_removed(config: Path) -> None:
    with pytest.raises(InvalidSettingChange, match="local"):
        policy_file.apply_changes(config, revision(config), {"profiles.local": None}, keep_profiles=["local"])
    # Nor any other: a profile holds file-only keys, which a request could then make anew.
    with pytest.raises(InvalidSettingChange, match="only the file on disk"):
        policy_file.apply_changes(config, revision(config), {"profiles.local-recursive": None})


def test_a_stale_revision_is_a_conflict(config: Path) -> None:
    stale = revision(config)
    policy_file.apply_changes(config, stale, {"profiles.local.rlm.max_iters": 21})
    before = config.read_bytes()
    with pytest.raises(SettingsConflict):
        policy_file.apply_changes(config, stale, {"profiles.local.rlm.max_iters": 22})
    assert config.read_bytes() == before


def test_a_write_by_another_process_before_the_replace_is_a_conflict(config: Path) -> None:
    """The file is read again right before the rename: another writer's change is never lost."""
    expected = revision(config)
    config.write_text(config.read_text() + "\n# another editor\n")
    edited = config.read_bytes()
    with pytest.raises(SettingsConflict):
        policy_file.replace_atomically(config, b"[config]\n", expected)
    assert config.read_bytes() == edited
    assert leftovers(config) == []


def test_concurrent_changes_from_one_revision_admit_exactly_one(config: Path) -> None:
    start = revision(config)
    outcomes: list[str] = []

    def change(value: int) -> None:
        try:
            policy_file.apply_changes(config, start, {"profiles.local.rlm.max_iters": value})
            outcomes.append(f"ok {value}")
        except SettingsConflict:
            outcomes.append("conflict")

    threads = [threading.Thread(target=change, args=(31 + i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [o for o in outcomes if o.startswith("ok")]
    assert len(winners) == 1 and outcomes.count("conflict") == 7
    assert policy_file.read_snapshot(config).profiles["local"]["rlm"]["max_iters"] == int(winners[0][3:])


def test_the_file_mode_is_kept_and_a_symlink_stays_a_link(config: Path, tmp_path: Path) -> None:
    config.chmod(0o640)
    link = tmp_path / "link.toml"
    link.symlink_to(config)
    policy_file.apply_changes(link, revision(config), {"profiles.local.rlm.max_iters": 25})
    assert link.is_symlink() and (config.stat().st_mode & 0o777) == 0o640
    assert policy_file.read_snapshot(config).profiles["local"]["rlm"]["max_iters"] == 25


def test_a_password_edited_into_the_file_by_hand_is_never_shown(config: Path) -> None:
    config.write_text(
        config.read_text().replace(
            'data_dir = ".fleet"', 'data_dir = ".fleet"\nredis_url = "redis://:hunter2@h/0"', 1
        )
    )
    snapshot = policy_file.read_snapshot(config)
    assert snapshot.profiles["offline"]["storage"]["redis_url"] == "redis://:***@h/0"


def test_a_broken_file_on_disk_is_a_config_error(config: Path) -> None:
    config.write_text("[config\n")
    with pytest.raises(ConfigError, match=r"^fleet.toml: invalid TOML"):
        policy_file.read_snapshot(config)
    with pytest.raises(ConfigError):
        policy_file.apply_changes(config, revision(config), {"profiles.local.rlm.max_iters": 5})


def test_a_gateway_without_the_provider_key_can_still_change_settings(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a cluster only workers hold the LM key. The gateway's check of a change must not refuse
    every change for the key it never has; the model's name is still required."""
    monkeypatch.setenv("FLEET_LM_MODEL", "openai/gpt-test")
    change = {"profiles.local.rlm.max_iters": 7}
    policy_file.apply_changes(config, revision(config), change, keep_profiles=["local"])
    assert "max_iters = 7" in config.read_text()
    monkeypatch.delenv("FLEET_LM_MODEL")
    with pytest.raises(InvalidSettingChange, match="FLEET_LM_MODEL is not set"):
        policy_file.apply_changes(config, revision(config), change, keep_profiles=["local"])


def test_the_gateway_loads_without_the_lm_credentials_and_never_reads_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {
        "FLEET_CONFIG": str(SHIPPED),
        "FLEET_PROFILE": "local",
        "FLEET_REDIS_URL": "redis://127.0.0.1:1/0",
        "FLEET_LM_MODEL": "openai/gpt-test",
    }
    with pytest.raises(ConfigError, match="FLEET_LM_API_KEY is not set"):
        load_settings(env)
    settings = load_settings({**env, "FLEET_LM_API_KEY": "sk-SECRET"}, lm_credentials=False)
    assert settings.root_lm.name == "openai/gpt-test"
    assert settings.root_lm.api_key is None and settings.root_lm.base_url is None
