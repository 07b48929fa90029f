"""Webhooks at the gateway: a target named by a Turn or a session is checked before anything is
written, and a Run's delivery, with each attempt, is readable by whoever may read the Run."""

from __future__ import annotations

import functools

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromPath

from fleet_gateway.errors import ApiError, not_found
from fleet_gateway.routes.runs import find_run
from fleet_gateway.schemas import WebhookAttemptOut, WebhookDeliveryOut, WebhookDeliveryPage, WebhookTarget
from fleet_gateway.state import GatewayState
from fleet_gateway.streaming import iso
from fleet_shared.config import Settings
from fleet_shared.db import webhooks
from fleet_shared.db.engine import run_whole
from fleet_shared.tenancy import Principal
from fleet_shared.webhook_targets import TargetPolicy, TargetRefused


def checked_target(settings: Settings, target: WebhookTarget | None) -> str | None:
    """The target's URL once the deployment's policy allows it (422 `invalid_webhook` if not):
    https unless webhooks.allow_http, no credentials, no private address written in it. A host
    name is checked again, by its addresses, at every delivery."""
    if target is None:
        return None
    if settings.webhook_secret is None:
        raise ApiError(
            422,
            "invalid_webhook",
            "webhook: this deployment sends no webhooks (FLEET_WEBHOOK_SECRET is not set)",
        )
    try:
        TargetPolicy.of(settings.profile.webhooks).check_url(target.url)
    except TargetRefused as exc:
        raise ApiError(422, "invalid_webhook", f"webhook.url: {exc}") from None
    return target.url


class WebhookController(Controller):
    path = "/api/runs/{run_id:str}/webhooks"

    @get("/")
    async def list_deliveries(
        self, gw: NamedDependency[GatewayState], caller: NamedDependency[Principal], run_id: FromPath[str]
    ) -> WebhookDeliveryPage:
        """The Run's delivery (none, or one) and every attempt so far."""
        async with gw.db_sessions() as db:
            run = await find_run(db, run_id, caller)
        if run is None:
            raise not_found("run")
        found = await run_whole(gw.db_sessions, functools.partial(webhooks.deliveries_of_on, run_id=run.id))
        items = [
            WebhookDeliveryOut(
                id=delivery.id,
                url=delivery.url,
                status=delivery.status,  # type: ignore[arg-type]
                attempts=[
                    WebhookAttemptOut(
                        number=a.number,
                        started_at=iso(a.started_at),
                        duration_ms=a.duration_ms,
                        status_code=a.status_code,
                        error=a.error,
                    )
                    for a in attempts
                ],
                created_at=iso(delivery.created_at),
                next_attempt_at=iso(delivery.next_attempt_at)
                if delivery.status == webhooks.PENDING
                else None,
                finished_at=iso(delivery.finished_at) if delivery.finished_at else None,
            )
            for delivery, attempts in found
        ]
        return WebhookDeliveryPage(items)
