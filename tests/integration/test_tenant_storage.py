"""`quotas.storage_mb`: what one tenant may keep in the blob store, so no tenant can fill the
deployment's share for the others. A fork stores nothing new, but its versions count again, so
forking is within the quota too (an attacker's review found forks inflating the shared count)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
from litestar.testing import AsyncTestClient

from fleet_gateway.app import create_app
from fleet_shared.config_file import QuotaLimits
from fleet_shared.tenancy import Principal
from fleet_shared.tokens_file import mint_token
from tests.integration.harness import Harness
from tests.integration.test_tenancy import in_tokens_mode

HarnessFactory = Callable[..., Harness]
KIB = 1024
WRITES_600_KIB = (
    "import pathlib\npathlib.Path('memory/big.bin').write_bytes(b'x' * 600 * 1024)\nSUBMIT(answer='kept')"
)


async def test_a_tenant_is_held_to_its_own_storage_quota_and_others_are_not(
    harness_factory: HarnessFactory, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens.toml"
    small = {"Authorization": f"Bearer {mint_token(tokens, tenant='small', user='u', scopes=())}"}
    other = {"Authorization": f"Bearer {mint_token(tokens, tenant='other', user='u', scopes=())}"}
    harness = harness_factory({"lm": "root", "reasoning": "keep a file", "code": WRITES_600_KIB})
    settings = in_tokens_mode(harness.settings, tokens)
    quotas = msgspec.structs.replace(settings.profile.quotas, tenants={"small": QuotaLimits(storage_mb=2)})
    settings = msgspec.structs.replace(
        settings, profile=msgspec.structs.replace(settings.profile, quotas=quotas)
    )

    async with AsyncTestClient(create_app(settings)) as client:

        async def upload(auth: dict[str, str], size: int) -> int:
            files = {"attachment": ("a.bin", b"a" * size, "application/octet-stream")}
            response = await client.post(
                "/api/attachments", files=files, headers={**auth, "X-Requested-With": "t"}
            )
            return response.status_code

        session = (await client.post("/api/sessions", json={}, headers=small)).json()["id"]
        await harness.submit("keep", session_id=session, caller=Principal("small", "u"))
        await harness.work()  # its version adds 600 KiB to the tenant's count

        first = await client.post(f"/api/sessions/{session}/fork", json={}, headers=small)
        assert first.status_code == 201, first.text  # 1.2 MiB counted
        second = await client.post(f"/api/sessions/{session}/fork", json={}, headers=small)
        assert second.status_code == 201, second.text  # 1.8 MiB counted
        third = await client.post(f"/api/sessions/{session}/fork", json={}, headers=small)
        assert third.status_code == 507
        assert third.json() == {
            "code": "storage_quota_exceeded",
            "message": "the session was not forked: "
            "the tenant's stored files would pass quotas.storage_mb (2 MiB)",
        }
        assert await upload(small, 300 * KIB) == 507  # 1.8 MiB + 300 KiB > 2 MiB
        assert await upload(small, 100 * KIB) == 201
        for _ in range(4):  # another tenant stores past `small`'s quota: not its business
            assert await upload(other, 700 * KIB) == 201
        listed = (await client.get("/api/sessions", headers=small)).json()
        assert listed["total"] == 3  # the session and its two forks; nothing of the refused one
