"""The policy file as the settings API reads and edits it: its revision, in-place edits that keep
comments and layout, the same validation as startup, and an atomic replace."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import tempfile
import threading
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomlkit
import tomlkit.exceptions
from tomlkit.container import Container
from tomlkit.items import InlineTable, Table

from fleet_shared import settings_policy
from fleet_shared.config import (
    convert_profile,
    has_credentials,
    load_settings,
    parse_config_text,
    quote_key,
    redact_url,
)
from fleet_shared.errors import ConfigError, InvalidSettingChange, SettingsConflict

MAX_CHANGES = 50
ROOT_KEYS = ("config", "profiles")
KEY_PART = re.compile(r"^[A-Za-z0-9_-]+$")  # bare TOML keys: a dot always separates two parts

# One writer at a time in this process; other processes are caught by re-reading the file right
# before the replace.
WRITE_LOCK = threading.Lock()

SettingValue = str | int | float | bool | list[str | int | float | bool] | None


@dataclass(frozen=True)
class PolicySnapshot:
    """The file as it is on disk now. `profiles` holds env var names, never their values."""

    revision: str
    name: str
    default_profile: str
    profiles: dict[str, Any]


def revision_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_snapshot(path: Path) -> PolicySnapshot:
    """The file's revision and contents; ConfigError when it is not a valid policy file."""
    return snapshot_of(path.read_bytes(), path.name)


def snapshot_of(data: bytes, name: str) -> PolicySnapshot:
    raw = parse_config_text(decode(data, name), Path(name))
    return PolicySnapshot(
        revision=revision_of(data),
        name=name,
        default_profile=raw.config.default_profile,
        profiles=redacted(raw.profiles),
    )


def decode(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{name}: not UTF-8") from None


def redacted(value: Any) -> Any:
    """Startup refuses a password in the file, but the file may have been edited since."""
    if isinstance(value, dict):
        return {key: redacted(item) for key, item in value.items()}
    if isinstance(value, list):
        return [redacted(item) for item in value]
    if isinstance(value, str) and "://" in value:
        return redact_url(value)  # any user-info (a bare token shows as ***), any ?password=
    return value


def apply_changes(
    path: Path,
    expected_revision: str,
    changes: Mapping[str, SettingValue],
    keep_profiles: Collection[str] = (),
    *,
    require_auth: bool = False,
) -> PolicySnapshot:
    """Set dotted keys (`None` removes one) if the file is still at `expected_revision`.

    The result must pass startup's validation, and every profile in `keep_profiles` (the ones
    running processes use) must still exist; otherwise nothing is written. Raises
    SettingsConflict, InvalidSettingChange, ConfigError (the file on disk is broken) or OSError.
    """
    check_changes(changes)
    target = path.resolve()  # a symlinked file: edit what it points at, keep the link
    with WRITE_LOCK, locked(target):
        original = target.read_bytes()
        if revision_of(original) != expected_revision:
            raise SettingsConflict
        try:
            document = tomlkit.parse(decode(original, path.name))
        except tomlkit.exceptions.ParseError as exc:
            raise ConfigError(f"{path.name}: invalid TOML: {exc}") from None
        refuse_new_profiles(document, changes)
        for key, value in changes.items():
            set_key(document, key, value)
        data = tomlkit.dumps(document).encode("utf-8")
        validate(data, path.name, keep_profiles)
        check_restart(data, target, keep_profiles, require_auth=require_auth)
        replace_atomically(target, data, expected_revision)
    return snapshot_of(data, path.name)


def check_changes(changes: Mapping[str, SettingValue]) -> None:
    """Refusals that need no file: the key's shape, and secrets that must stay in the environment."""
    if not changes:
        raise InvalidSettingChange("set: name at least one key")
    if len(changes) > MAX_CHANGES:
        raise InvalidSettingChange(f"set: at most {MAX_CHANGES} keys at once")
    for key, value in changes.items():
        parts = key.split(".")
        if len(parts) < 2 or parts[0] not in ROOT_KEYS or not all(KEY_PART.match(p) for p in parts):
            raise InvalidSettingChange(
                f"{key}: not a setting (dotted bare keys under `config.` or `profiles.`)"
            )
        settings_policy.check_change(key, value)
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str) and has_credentials(text):
                raise InvalidSettingChange(
                    f"{key}: a URL with credentials belongs in an environment variable, "
                    "never in the policy file"
                )


def refuse_new_profiles(document: tomlkit.TOMLDocument, changes: Mapping[str, SettingValue]) -> None:
    """A request edits the profiles the file has: a new one would bring the defaults of every
    file-only key (the data dir, the queue, retention, the store), which only the file chooses."""
    profiles = document.get("profiles")
    existing = set(profiles) if isinstance(profiles, Table | InlineTable | dict) else set()
    for key in changes:
        parts = key.split(".")
        if parts[0] == "profiles" and len(parts) > 1 and parts[1] not in existing:
            raise InvalidSettingChange(
                f"{key}: profile {parts[1]!r} is not in the file; only the file on disk can add one"
            )


def set_key(document: tomlkit.TOMLDocument, key: str, value: SettingValue) -> None:
    """Set one dotted key in place (its comments stay), creating the tables it needs."""
    parts = key.split(".")
    table: Container | Table | InlineTable = document
    created = False
    for depth, part in enumerate(parts[:-1]):
        child = table.get(part)
        if child is None:
            if value is None:
                return  # removing what is not there
            table[part] = tomlkit.inline_table() if isinstance(table, InlineTable) else tomlkit.table()
            child, created = table[part], True
        if not isinstance(child, Table | InlineTable):
            raise InvalidSettingChange(f"{'.'.join(parts[: depth + 1])}: is a value, not a table")
        table = child
    leaf = parts[-1]
    if value is None:
        table.pop(leaf, None)
        return
    if isinstance(table.get(leaf), Table | InlineTable):
        raise InvalidSettingChange(f"{key}: is a table; set the keys inside it")
    table[leaf] = value
    if created and isinstance(table, Table):
        table.add(tomlkit.nl())  # a blank line before the next table, like the rest of the file


def validate(data: bytes, name: str, keep_profiles: Collection[str]) -> None:
    """What startup checks of every profile, so a restart cannot fail on this file."""
    path = Path(name)  # errors name the file, never its folder
    try:
        raw = parse_config_text(data.decode("utf-8"), path)
        for profile_name, table in raw.profiles.items():
            convert_profile(path, profile_name, table)
    except ConfigError as exc:
        raise InvalidSettingChange(str(exc)) from None
    for needed in {raw.config.default_profile, *keep_profiles}:
        if needed not in raw.profiles:
            raise InvalidSettingChange(
                f"{name}: profile {quote_key(needed)} is in use (the default, or a running "
                "process's) and cannot be removed"
            )


@contextlib.contextmanager
def locked(target: Path) -> Iterator[None]:
    """An exclusive lock on a sibling lock file, from the read to the rename: other processes
    (more gateway workers, more gateways on a shared file) wait instead of losing an update."""
    with open(target.parent / f".{target.name}.lock", "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def check_restart(data: bytes, target: Path, keep_profiles: Collection[str], *, require_auth: bool) -> None:
    """Load the candidate exactly as a restart would, with this process's environment, for the
    default profile and each profile in use: a change that would stop the next startup (a
    missing script, an unset env var, a broken storage backend) is refused now. A change that
    would switch bearer auth off while it is on is refused too."""
    fd, temp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".check")
    temp = Path(temp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        environ = {k: v for k, v in os.environ.items() if k != "FLEET_PROFILE"}
        environ["FLEET_CONFIG"] = str(temp)
        for profile in (None, *keep_profiles):
            env = environ if profile is None else {**environ, "FLEET_PROFILE": profile}
            try:
                candidate = load_settings(env, lm_credentials=holds_lm_credentials(target, env))
            except ConfigError as exc:
                message = str(exc).replace(str(temp), target.name).replace(temp.name, target.name)
                raise InvalidSettingChange(message.replace(f"{target.parent}/", "")) from None  # no folder
            if require_auth and not candidate.auth_required:
                raise InvalidSettingChange(
                    f"{target.name}: this change would switch bearer auth off "
                    f"(profile {candidate.profile_name}: gateway.auth.token_env names an unset variable)"
                )
    finally:
        temp.unlink(missing_ok=True)


def holds_lm_credentials(current: Path, env: Mapping[str, str]) -> bool:
    """Whether this process can resolve the current file's LM key and base URL. `fleet up` shares
    one environment with its workers, so a change that would unset them is checked; a gateway in
    a cluster never holds the provider key (only workers do), so there that part is not checked
    rather than refusing every change."""
    try:
        load_settings({**env, "FLEET_CONFIG": str(current)})
    except ConfigError:
        return False
    return True


def replace_atomically(target: Path, data: bytes, expected_revision: str) -> None:
    """Write a sibling temp file, fsync it, and rename it over the target: readers see the old
    file or the new one, never a torn one. Another process's write since we read is a conflict."""
    mode = target.stat().st_mode & 0o7777
    fd, temp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    temp = Path(temp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        temp.chmod(mode)
        if revision_of(target.read_bytes()) != expected_revision:
            raise SettingsConflict
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    sync_directory(target.parent)


def sync_directory(folder: Path) -> None:
    """Make the rename itself durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
