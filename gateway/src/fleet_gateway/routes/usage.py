"""GET /api/usage: the caller's tenant's counts against its quotas (docs/security.md, tenancy)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from litestar import get
from litestar.di import NamedDependency
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_gateway.quotas import turns_this_minute
from fleet_gateway.schemas import Allowance, UsageOut
from fleet_gateway.state import GatewayState
from fleet_shared.db import runs
from fleet_shared.db.files import StorageQuota, stored_bytes
from fleet_shared.tenancy import Principal
from fleet_shared.tenant_usage import DAY_SECONDS, lm_tokens_today, utc_day


def allowance(used: int, limit: int) -> Allowance:
    return Allowance(used=used, limit=limit or None)


@get("/api/usage", summary="The caller's tenant's usage today, against its quotas")
async def get_usage(
    gw: NamedDependency[GatewayState], db: NamedDependency[AsyncSession], caller: NamedDependency[Principal]
) -> UsageOut:
    """Only the caller's own tenant: there is no way to name another. Redis or the database
    down is a 503, like any route that needs them."""
    now = time.time()
    day = utc_day(now)
    midnight = datetime.fromtimestamp(day * DAY_SECONDS, UTC)
    limits = gw.settings.profile.quotas.of(caller.tenant)
    tokens = await lm_tokens_today(gw.redis, caller.tenant, day)
    this_minute = await turns_this_minute(gw.redis, caller.tenant, now)
    active, today = await runs.tenant_run_counts(db, caller.tenant, midnight)
    stored = await stored_bytes(db, tenant=caller.tenant)
    storage_limit = StorageQuota.of(gw.settings.profile.storage, limits).tenant_bytes
    return UsageOut(
        tenant=caller.tenant,
        day=midnight.date().isoformat(),
        lm_tokens_today=allowance(tokens, limits.lm_tokens_per_day),
        turns_today=today,
        turns_this_minute=allowance(this_minute, limits.turns_per_minute),
        active_turns=allowance(active, limits.active_turns),
        storage_bytes=allowance(stored.tenant, storage_limit),
    )
