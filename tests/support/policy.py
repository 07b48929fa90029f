"""A private copy of the shipped policy file, for stacks that must not touch (or that tune) the repo's.

`fleet gateway` serves `PATCH /api/settings`, which rewrites the file FLEET_CONFIG names: a test
stack that a fuzzer or a test may drive there gets a copy in its own work dir. The copy can also
shorten the offline profile's heartbeat or its cell timeout, raise its log level, or preload modules
into its REPLs.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What the shipped `local` profile needs from the environment (nothing here is ever called).
LOCAL_LM_ENV = {
    "FLEET_LM_MODEL": "openai/x",
    "FLEET_LM_API_KEY": "k",
    "FLEET_LM_BASE_URL": "http://127.0.0.1:1/v1",
}
SHIPPED = REPO / "config"


def set_offline_value(text: str, section: str, key: str, value: str) -> str:
    """`key = value` in `[profiles.offline.<section>]`; fails loudly when the file's layout moved."""
    pattern = re.compile(
        rf"(^\[profiles\.offline\.{re.escape(section)}\]\n(?:[^\[\n].*\n)*?){key} = .*$", re.M
    )
    new, count = pattern.subn(rf"\g<1>{key} = {value}", text)
    assert count == 1, f"no `{key}` under [profiles.offline.{section}] in {SHIPPED / 'fleet.toml'}"
    return new


def private_policy(
    dest: Path,
    *,
    heartbeat_seconds: float | None = None,
    log_level: str | None = None,
    cell_timeout_seconds: float | None = None,
    preload: list[str] | None = None,
) -> dict[str, str]:
    """Copy config/fleet.toml (and its scripts) into `dest/policy/`; the env that selects the copy."""
    folder = dest / "policy"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copytree(SHIPPED / "scripts", folder / "scripts", dirs_exist_ok=True)
    text = (SHIPPED / "fleet.toml").read_text(encoding="utf-8")
    if heartbeat_seconds is not None:
        text = set_offline_value(text, "runtime", "heartbeat_seconds", repr(heartbeat_seconds))
    if log_level is not None:
        text = set_offline_value(text, "observability", "log_level", f'"{log_level}"')
    if cell_timeout_seconds is not None:
        text = set_offline_value(text, "sandbox.local", "cell_timeout_seconds", repr(cell_timeout_seconds))
    if preload is not None:
        text = set_offline_value(text, "sandbox.python", "preload", json.dumps(preload))
    path = folder / "fleet.toml"
    path.write_text(text, encoding="utf-8")
    folder.chmod(0o755)
    return {"FLEET_CONFIG": str(path), "FLEET_SKILLS_DIR": str(SHIPPED / "skills")}
