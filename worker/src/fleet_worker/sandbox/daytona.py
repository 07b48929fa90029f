"""The `daytona` sandbox provider: one Daytona sandbox per session (see docs/sandboxes.md)."""

from __future__ import annotations

import os

from fleet_shared.config import Settings
from fleet_worker.sandbox.errors import SandboxUnavailable
from fleet_worker.sandbox.provider import SandboxProvider


def daytona_provider(settings: Settings, environ: dict[str, str] | None = None) -> SandboxProvider:
    """The provider for `sandbox.provider = "daytona"`; SandboxUnavailable (one line) when the
    profile does not configure it."""
    env = os.environ if environ is None else environ
    section = settings.profile.sandbox.daytona
    if section is None:
        raise SandboxUnavailable(
            "sandbox.provider is 'daytona' but the profile has no [sandbox.daytona] table",
            fix="add it (api_key_env, api_url_env, snapshot) or set sandbox.provider = 'local'",
        )
    if not env.get(section.api_key_env):
        raise SandboxUnavailable(
            f"sandbox.daytona.api_key_env names {section.api_key_env}, which is not set",
            fix=f"export {section.api_key_env}, or set sandbox.provider = 'local'",
        )
    raise SandboxUnavailable(
        "the daytona provider is not available in this build", fix="set sandbox.provider = 'local'"
    )
