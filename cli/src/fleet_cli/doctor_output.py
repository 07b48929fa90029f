"""What `fleet doctor` prints: the checks scrubbed of every secret the settings hold, as a table
or as one JSON document."""

from __future__ import annotations

import re

import msgspec

from fleet_shared.config import Settings
from fleet_shared.doctor import Check, CheckStatus, all_passed
from fleet_shared.redaction import MASK, redact_text, url_secrets

MARKERS: dict[CheckStatus, str] = {"ok": "ok", "warn": "WARN", "skip": "skip", "fail": "FAIL"}
# A secret this short is masked only where it stands alone: replacing every `x` would garble the
# report (a URL still masks it in place, by its position).
SHORT_SECRET = 4


def secrets_of(settings: Settings) -> list[str]:
    """Every secret value the settings hold: URL passwords and secret query values, API keys,
    the API token."""
    found = [
        secret.reveal()
        for secret in (
            settings.root_lm.api_key,
            settings.sub_lm.api_key,
            settings.api_token,
            settings.blobs.s3_access_key,
            settings.blobs.s3_secret_key,
        )
        if secret is not None
    ]
    for url in (
        settings.database_url,
        settings.redis_url,
        settings.root_lm.base_url,
        settings.sub_lm.base_url,
    ):
        found += url_secrets(url or "")
    return [secret for secret in found if secret]


def scrub(checks: list[Check], secrets: list[str]) -> list[Check]:
    """The checks with secrets in URLs and free text masked, and any secret value replaced by ***."""
    patterns = [
        re.escape(secret) if len(secret) >= SHORT_SECRET else rf"(?<![\w%]){re.escape(secret)}(?!\w)"
        for secret in sorted(set(secrets), key=len, reverse=True)
    ]
    anywhere = re.compile("|".join(patterns)) if patterns else None

    def clean(text: str) -> str:
        text = redact_text(text)
        return anywhere.sub(MASK, text) if anywhere else text

    return [
        msgspec.structs.replace(
            check, detail=clean(check.detail), fix=clean(check.fix) if check.fix else None
        )
        for check in checks
    ]


def render_text(checks: list[Check]) -> str:
    """One line per check (marker, name, detail), its fix indented below it, then a summary."""
    width = max(len(check.name) for check in checks)
    lines = []
    for check in checks:
        lines.append(f"{MARKERS[check.status]:<4}  {check.name:<{width}}  {check.detail}")
        if check.fix and check.status in ("fail", "warn"):
            lines.append(f"{'':<4}  {'':<{width}}  fix: {check.fix}")
    failed = sum(check.status == "fail" for check in checks)
    warned = sum(check.status == "warn" for check in checks)
    summary = f"{failed} check(s) failed" if failed else "no check failed"
    lines.append(f"fleet doctor: {summary}, {warned} warning(s)")
    return "\n".join(lines)


def render_json(checks: list[Check]) -> str:
    """One JSON document: {"ok": bool, "checks": [{name, status, detail, fix}, ...]}."""
    return msgspec.json.encode({"ok": all_passed(checks), "checks": checks}).decode()
