"""Shared set-up for the pool, membership, scoping and audit tests."""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import httpx
from nacl.signing import SigningKey

from tests.conftest import Contributor, new_contributor

_addresses = itertools.count(1)

H100 = "NVIDIA H100 80GB HBM3"


def client_from(app: Any, ip: str | None = None) -> httpx.AsyncClient:
    """A client whose requests come from ``ip`` (a fresh documentation address by default);
    a node registered through it gets that ``ip_address``."""
    n = next(_addresses)
    address = ip or f"198.51.{n // 256 % 256}.{n % 256}"
    transport = httpx.ASGITransport(app=app, client=(address, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://testserver")


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def create_pool(client: httpx.AsyncClient, headers: dict[str, str], **settings: Any) -> dict[str, Any]:
    body = {"name": settings.pop("name", "rollouts"), **settings}
    r = await client.post("/v1/admin/pools", json=body, headers=headers)
    assert r.status_code == 201, r.text
    return dict(r.json())


async def lifecycle(
    client: httpx.AsyncClient, headers: dict[str, str], pool_id: str, action: str
) -> dict[str, Any]:
    r = await client.post(f"/v1/admin/pools/{pool_id}/{action}", headers=headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def active_pool(client: httpx.AsyncClient, headers: dict[str, str], **settings: Any) -> dict[str, Any]:
    pool = await create_pool(client, headers, **settings)
    return await lifecycle(client, headers, pool["id"], "activate")


async def registered(
    client: httpx.AsyncClient, provider_key: SigningKey | None = None, **specs: Any
) -> Contributor:
    """A new node (of a new provider unless ``provider_key`` is given), registered via ``client``."""
    c = new_contributor(provider_key)
    r = await client.post("/v1/providers", json={"display_name": "lab"}, auth=c.provider_auth)
    assert r.status_code in (200, 201), r.text
    body = c.node_body()
    body["specs"].update(specs)
    r = await client.post("/v1/nodes", json=body, auth=c.node_auth)
    assert r.status_code in (200, 201), r.text
    return c


async def deposit(
    client: httpx.AsyncClient, admin_headers: dict[str, str], provider_id: str, amount: int
) -> None:
    r = await client.post(
        f"/v1/admin/providers/{provider_id}/deposits",
        json={"amount": amount},
        headers={**admin_headers, "Idempotency-Key": f"test-{uuid.uuid4().hex}"},
    )
    assert r.status_code == 201, r.text


async def balance(client: httpx.AsyncClient, c: Contributor) -> dict[str, int]:
    """The provider's balances, asked the way a provider would (signed by its key)."""
    r = await client.get("/v1/providers/me/balance", auth=c.provider_auth)
    assert r.status_code == 200, r.text
    return {k: v for k, v in r.json().items() if k != "provider_id"}


async def join(client: httpx.AsyncClient, c: Contributor, pool_id: str, **body: Any) -> httpx.Response:
    return await client.post(f"/v1/pools/{pool_id}/join", json=body, auth=c.node_auth)


async def leave(client: httpx.AsyncClient, c: Contributor, pool_id: str) -> httpx.Response:
    return await client.post(f"/v1/pools/{pool_id}/leave", auth=c.node_auth)


async def invite(
    client: httpx.AsyncClient, headers: dict[str, str], pool_id: str, expires_in_s: int = 3600
) -> str:
    r = await client.post(
        f"/v1/admin/pools/{pool_id}/invites", json={"expires_in_s": expires_in_s}, headers=headers
    )
    assert r.status_code == 201, r.text
    return str(r.json()["code"])


def reason_codes(response: httpx.Response) -> list[str]:
    return [r["code"] for r in response.json()["reasons"]]


async def new_token(app_state: Any, role: str, name: str = "test") -> tuple[dict[str, str], str]:
    """Bearer headers for a new token of ``role``, and the token's id (what the audit log names)."""
    from orchestrator.admin.tokens import Role, create_token

    async with app_state.sessionmaker() as session, session.begin():
        token, row = await create_token(session, role=Role(role), name=name)
    return auth(token), row.id
