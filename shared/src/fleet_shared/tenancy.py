"""Who is calling (docs/security.md, tenancy): a tenant, a user in it, and the scopes granted.

Every row a caller can reach hangs off a session or an attachment, and both carry the tenant and
the user who created them. A row of another tenant is the same 404 as one that does not exist."""

from __future__ import annotations

import msgspec

DEFAULT_TENANT = "default"
ADMIN = "admin"  # may read and change the settings
READ_ALL_SESSIONS = "sessions:read:all"  # may read, not change, the tenant's other users' sessions
KNOWN_SCOPES = frozenset({ADMIN, READ_ALL_SESSIONS})


class Principal(msgspec.Struct, frozen=True):
    tenant: str
    user: str
    scopes: frozenset[str] = frozenset()

    def may(self, scope: str) -> bool:
        return scope in self.scopes

    def may_change(self, tenant: str, owner: str) -> bool:
        return tenant == self.tenant and owner == self.user


# The caller in `token` mode (one shared token, or none on loopback): one tenant, one user, every
# scope, which is what a single-tenant deployment always was. Rows made before tenancy carry it.
OPERATOR = Principal(DEFAULT_TENANT, "default", KNOWN_SCOPES)
