"""Settings: the policy file, read and changed over HTTP by loopback clients only.

The socket peer decides, never a forwarded-for header: the file steers what every process runs
(models, sandboxes, limits), so only someone on the gateway's own host may change it, never from a
web page, and only through revisions, so two editors never overwrite each other. What a request
may change at all is fleet_shared.settings_policy's to say. Changes apply on restart.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from litestar import Controller, get, patch
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency
from litestar.handlers.base import BaseRouteHandler
from litestar.params import JSONBody

from fleet_gateway.auth import PRINCIPAL_STATE
from fleet_gateway.errors import ApiError
from fleet_gateway.origins import from_this_host
from fleet_gateway.schemas import SettingsChange, SettingsOut, SettingsUpdated
from fleet_gateway.state import GatewayState
from fleet_shared import policy_file
from fleet_shared.errors import ConfigError, InvalidSettingChange, SettingsConflict
from fleet_shared.tenancy import ADMIN, Principal

log = structlog.get_logger(__name__)

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})


async def require_local_operator(
    connection: ASGIConnection[Any, Any, Any, Any], _handler: BaseRouteHandler
) -> None:
    """A caller with the `admin` scope, on a loopback peer, and no web page in between: not even
    one whose origin may call the rest of the API. Runs after the API's authentication guard."""
    principal = connection.state.get(PRINCIPAL_STATE)
    if not isinstance(principal, Principal) or not principal.may(ADMIN):
        raise ApiError(403, "forbidden", "settings need the `admin` scope")
    client = connection.client
    if client is None or client.host not in LOOPBACK_HOSTS:
        raise ApiError(403, "forbidden", "settings are served to loopback clients only")
    if not from_this_host(connection.headers.items()):
        raise ApiError(403, "origin_not_allowed", "settings are never served to a web page of another origin")


class SettingsController(Controller):
    path = "/api/settings"
    guards = [require_local_operator]

    @get("/")
    async def get_settings(self, gw: NamedDependency[GatewayState]) -> SettingsOut:
        """The policy file's profiles (env var names, never their values) and its revision."""
        try:
            snapshot = await asyncio.to_thread(policy_file.read_snapshot, gw.settings.config_path)
        except (ConfigError, OSError) as exc:
            raise unreadable(exc) from None
        return SettingsOut.of(snapshot, gw.settings.profile_name)

    @patch("/")
    async def update_settings(
        self, gw: NamedDependency[GatewayState], data: JSONBody[SettingsChange]
    ) -> SettingsUpdated:
        """Set dotted keys if the file is still at `revision`; the result must pass startup's
        validation, or nothing is written. Running processes keep their settings until restarted."""
        try:
            snapshot = await asyncio.to_thread(
                policy_file.apply_changes,
                gw.settings.config_path,
                data.revision,
                data.set,
                (gw.settings.profile_name,),  # a restart of this process must find its profile
                require_auth=gw.settings.auth_required,
            )
        except SettingsConflict:
            raise ApiError(
                409,
                "settings_revision_conflict",
                "the settings changed since they were read: re-read them (GET /api/settings) and retry",
            ) from None
        except InvalidSettingChange as exc:
            raise ApiError(422, "validation_error", str(exc)) from None
        except (ConfigError, OSError) as exc:
            raise unreadable(exc) from None
        log.info("settings.changed", keys=sorted(data.set), revision=snapshot.revision)
        return SettingsUpdated.of(snapshot, gw.settings.profile_name)


def unreadable(exc: ConfigError | OSError) -> ApiError:
    # The file's folder stays out of the answer; an OSError's text would carry it.
    problem = str(exc) if isinstance(exc, ConfigError) else (exc.strerror or type(exc).__name__)
    log.warning("settings.unavailable", error_type=type(exc).__name__)
    return ApiError(503, "service_unavailable", f"the policy file cannot be used: {problem}")
