"""Provider and node registration, GET /v1/nodes/me."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable

import httpx
from asgi_lifespan import LifespanManager
from nacl.signing import SigningKey

from orchestrator.app import create_app
from orchestrator.core.clock import FakeClock
from orchestrator.core.hotstore import HotStore
from orchestrator.core.keys import attest_node, generate_key, is_key_id, key_id_of
from orchestrator.core.signing import SignatureAuth
from orchestrator.settings import LimitSettings, Settings
from tests.conftest import Contributor, new_contributor, problem


async def test_provider_registration_is_idempotent(client: httpx.AsyncClient) -> None:
    c = new_contributor()
    first = await client.post("/v1/providers", json={"display_name": "lab"}, auth=c.provider_auth)
    assert first.status_code == 201
    assert first.json()["id"] == c.provider_id
    again = await client.post("/v1/providers", json={"display_name": "lab"}, auth=c.provider_auth)
    assert again.status_code == 200
    assert again.json() == first.json()


async def test_a_provider_registers_without_a_body(client: httpx.AsyncClient) -> None:
    """PROTOCOL.md names no field for a provider's registration (its display name is optional):
    a client that sends the signed POST without a body registers, as with {}. It was 422
    validation_failed ("body: Field required")."""
    c = new_contributor()
    first = await client.post("/v1/providers", auth=c.provider_auth)
    assert first.status_code == 201, first.text
    assert first.json()["id"] == c.provider_id and first.json()["display_name"] is None
    again = await client.post("/v1/providers", auth=c.provider_auth)
    assert again.status_code == 200 and again.json() == first.json()
    # A body, when sent, still validates.
    r = await client.post("/v1/providers", json={"display_name": ""}, auth=c.provider_auth)
    problem(r, 422, "validation_failed")


async def test_node_registration_then_me(client: httpx.AsyncClient, contributor: Contributor) -> None:
    r = await client.get("/v1/nodes/me", auth=contributor.node_auth)
    assert r.status_code == 200
    body = r.json()
    assert body["id"] == contributor.node_id
    assert body["provider_id"] == contributor.provider_id
    assert body["status"] == "waiting"
    assert body["specs"]["gpu_count"] == 1


async def test_reregistering_a_node_updates_specs_and_is_idempotent(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    specs = {"gpu_model": "NVIDIA A100-SXM4-80GB", "gpu_count": 8, "gpu_memory_mb": 81920, "cpu_cores": 64}
    body = contributor.node_body(version="0.2.0", specs={**contributor.node_body()["specs"], **specs})
    r = await client.post("/v1/nodes", json=body, auth=contributor.node_auth)
    assert r.status_code == 200
    assert r.json()["version"] == "0.2.0" and r.json()["specs"] == body["specs"]
    # Stored, as the node's own reads see it; and the same registration again changes nothing.
    me = (await client.get("/v1/nodes/me", auth=contributor.node_auth)).json()
    assert (me["version"], me["specs"]) == ("0.2.0", body["specs"])
    again = await client.post("/v1/nodes", json=body, auth=contributor.node_auth)
    assert again.status_code == 200 and again.json() == r.json()


async def test_node_key_bound_to_another_provider_conflicts(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    other = new_contributor()
    r = await client.post("/v1/providers", json={}, auth=other.provider_auth)
    assert r.status_code == 201
    body = {
        **contributor.node_body(),
        "provider_id": other.provider_id,
        "attestation": attest_node(other.provider_key, contributor.node_id),
    }
    problem(
        await client.post("/v1/nodes", json=body, auth=contributor.node_auth),
        409,
        "node_bound_to_other_provider",
    )


async def test_a_node_may_not_sign_with_its_providers_key(client: httpx.AsyncClient) -> None:
    """The provider key is who gets paid; a node registered with it would put it on a worker's
    machine (the README says to keep it safe). Refused, and nothing is registered."""
    c = new_contributor()
    assert (await client.post("/v1/providers", json={}, auth=c.provider_auth)).status_code == 201
    body = c.node_body(attestation=attest_node(c.provider_key, c.provider_id))
    body["provider_id"] = c.provider_id
    r = await client.post("/v1/nodes", json=body, auth=c.provider_auth)
    assert "keys generate" in problem(r, 422, "node_key_is_provider_key")["detail"]
    problem(await client.get("/v1/nodes/me", auth=c.provider_auth), 401, "unknown_key")


async def test_a_node_may_not_sign_with_another_providers_key(client: httpx.AsyncClient) -> None:
    """Only a node signing with its own provider's key was refused: another provider's key was
    registered as a node of the attesting provider (201), and that key, which gets paid, was on a
    worker's machine. Refused the same way, and nothing is registered."""
    paid, attesting = new_contributor(), new_contributor()
    for c in (paid, attesting):
        assert (await client.post("/v1/providers", json={}, auth=c.provider_auth)).status_code == 201
    body = attesting.node_body(attestation=attest_node(attesting.provider_key, paid.provider_id))
    r = await client.post("/v1/nodes", json=body, auth=paid.provider_auth)
    problem(r, 422, "node_key_is_provider_key")
    problem(await client.get("/v1/nodes/me", auth=paid.provider_auth), 401, "unknown_key")


async def test_a_nodes_key_may_not_register_as_a_provider(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    """The other way round: a node's key registered as a provider (201) made a key on a worker's
    machine one that gets paid. Refused, and no provider is registered."""
    r = await client.post("/v1/providers", json={}, auth=contributor.node_auth)
    assert "keys generate" in problem(r, 422, "provider_key_is_node_key")["detail"]
    r = await client.get("/v1/providers/me/balance", auth=contributor.node_auth)
    problem(r, 401, "unknown_key")
    assert (await client.get("/v1/nodes/me", auth=contributor.node_auth)).status_code == 200


async def test_attestation_must_be_the_providers(client: httpx.AsyncClient) -> None:
    c = new_contributor()
    assert (await client.post("/v1/providers", json={}, auth=c.provider_auth)).status_code == 201
    forged = attest_node(generate_key(), c.node_id)
    problem(
        await client.post("/v1/nodes", json=c.node_body(attestation=forged), auth=c.node_auth),
        403,
        "attestation_invalid",
    )
    # and nothing was registered
    problem(await client.get("/v1/nodes/me", auth=c.node_auth), 401, "unknown_key")


async def test_node_needs_a_registered_provider(client: httpx.AsyncClient) -> None:
    c = new_contributor()
    problem(await client.post("/v1/nodes", json=c.node_body(), auth=c.node_auth), 404, "provider_not_found")


async def test_specs_are_validated(client: httpx.AsyncClient) -> None:
    c = new_contributor()
    assert (await client.post("/v1/providers", json={}, auth=c.provider_auth)).status_code == 201
    bad_specs = [
        {"gpu_model": "H100", "gpu_count": 65, "gpu_memory_mb": 80000, "cpu_cores": 8, "ram_mb": 4096},
        {"gpu_model": "H100", "gpu_count": 1, "gpu_memory_mb": -1, "cpu_cores": 8, "ram_mb": 4096},
        {"gpu_model": None, "gpu_count": 2, "gpu_memory_mb": 80000, "cpu_cores": 8, "ram_mb": 4096},
        {"gpu_model": "H100", "gpu_count": 1, "gpu_memory_mb": 80000, "cpu_cores": 0, "ram_mb": 4096},
        {"gpu_model": "H100", "gpu_count": 1, "gpu_memory_mb": 80000, "cpu_cores": 8, "ram_mb": 1},
        {"gpu_model": "H100\n", "gpu_count": 1, "gpu_memory_mb": 80000, "cpu_cores": 8, "ram_mb": 4096},
        {
            "gpu_model": "H100",
            "gpu_count": 1,
            "gpu_memory_mb": 80000,
            "cpu_cores": 8,
            "ram_mb": 4096,
            "extra": 1,
        },
    ]
    for specs in bad_specs:
        body = problem(
            await client.post("/v1/nodes", json=c.node_body(specs=specs), auth=c.node_auth),
            422,
            "validation_failed",
        )
        assert body["errors"], body
    problem(await client.get("/v1/nodes/me", auth=c.node_auth), 401, "unknown_key")


async def test_cpu_only_node_is_accepted(client: httpx.AsyncClient) -> None:
    c = new_contributor()
    assert (await client.post("/v1/providers", json={}, auth=c.provider_auth)).status_code == 201
    specs = {"gpu_model": None, "gpu_count": 0, "gpu_memory_mb": 0, "cpu_cores": 4, "ram_mb": 8192}
    r = await client.post("/v1/nodes", json=c.node_body(specs=specs), auth=c.node_auth)
    assert r.status_code == 201, r.text


async def test_a_provider_key_cannot_act_as_a_node(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    problem(await client.get("/v1/nodes/me", auth=contributor.provider_auth), 401, "unknown_key")


async def test_the_openapi_schema_gives_the_exact_form_of_a_key_id(client: httpx.AsyncClient) -> None:
    """A key id is the canonical unpadded base64url of 32 bytes: 43 characters, the last of
    which carries 2 unused bits. The schema said only "43 characters", and a client following
    it got 422 (400 in a query, 404 in a path) for most such strings."""
    spec = (await client.get("/openapi.json")).json()
    body = spec["components"]["schemas"]["NodeRegister"]["properties"]["provider_id"]
    [path] = [p for p in spec["paths"]["/v1/admin/nodes/{node_id}"]["get"]["parameters"] if p["in"] == "path"]
    assert body["pattern"] == path["schema"]["pattern"]
    key_id = new_contributor().provider_id
    candidates = [key_id, key_id[:42] + "B", key_id[:42] + "w", key_id[:42] + "-", key_id[:42], key_id + "A"]
    candidates += [key_id[:42] + c for c in "AEIMQUYcgkosw048"] + ["+" * 43, "A" * 42 + "_"]
    for candidate in candidates:  # is_key_id: the check every key id of a request goes through
        assert (re.search(body["pattern"], candidate) is not None) is is_key_id(candidate), candidate


async def test_a_provider_and_a_node_registering_one_key_at_once_only_one_is_registered(
    settings: Settings, clock: FakeClock, hot_store: HotStore
) -> None:
    """The rule above was a read of one table and an insert into the other: on PostgreSQL a
    provider registration and a node registration signed with the same new key, at the same
    moment, both saw no other and both committed (201 and 201), and the key was both. Now, for
    each of many keys raced that way, one registration wins and the other is refused with its
    422, whichever came first; and the key is only what the winner registered. (On SQLite every
    transaction holds the one write lock from its start, so the two never overlapped there.)"""
    pairs = 25
    # Every attempt is a new key's registration, from one address: above the default limit.
    unlimited = settings.model_copy(
        update={"limits": LimitSettings(registration_per_ip=10**6, registration_per_key=10**6)}
    )
    application = create_app(unlimited, clock=clock, hot_store=hot_store)
    async with (
        LifespanManager(application),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=application), base_url="http://testserver"
        ) as client,
    ):
        attesting = new_contributor()
        assert (await client.post("/v1/providers", json={}, auth=attesting.provider_auth)).status_code == 201
        keys = [generate_key() for _ in range(pairs)]

        def as_node(key: SigningKey) -> Awaitable[httpx.Response]:
            body = attesting.node_body(attestation=attest_node(attesting.provider_key, key_id_of(key)))
            return client.post("/v1/nodes", json=body, auth=SignatureAuth(key))

        def as_provider(key: SigningKey) -> Awaitable[httpx.Response]:
            return client.post("/v1/providers", json={}, auth=SignatureAuth(key))

        replies = await asyncio.gather(*(call(k) for k in keys for call in (as_provider, as_node)))
        outcomes = []
        for i, key in enumerate(keys):
            provider_reply, node_reply = replies[2 * i], replies[2 * i + 1]
            # What the key is now, as its own signed requests see it.
            is_node = (await client.get("/v1/nodes/me", auth=SignatureAuth(key))).status_code == 200
            is_provider = (
                await client.get("/v1/providers/me/balance", auth=SignatureAuth(key))
            ).status_code == 200
            outcomes.append((provider_reply.status_code, node_reply.status_code, is_provider, is_node))
            if outcomes[-1] == (201, 422, True, False):
                problem(node_reply, 422, "node_key_is_provider_key")
            elif outcomes[-1] == (422, 201, False, True):
                problem(provider_reply, 422, "provider_key_is_node_key")
        both = [o for o in outcomes if o not in ((201, 422, True, False), (422, 201, False, True))]
        assert not both, f"{len(both)} of {pairs} keys (provider, node, is provider, is node): {both}"
