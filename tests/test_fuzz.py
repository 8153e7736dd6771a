"""Every operation of the OpenAPI document, fed inputs its schema allows (schemathesis).

What a client notices: no route answers 500, every error is problem+json, and every answer
(status, media type, body) is one the document describes. Contributor routes are signed with a
registered node's (or its provider's) key, so their bodies get past the signature check, and
path ids point at real rows for half the cases. Bounded and deterministic: a few examples per
operation, drawn with a fixed seed (derandomize), one request at a time.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.errors import FailureGroup

from orchestrator.core.signing import SignatureAuth
from orchestrator.settings import LimitSettings, Settings
from tests.conftest import make_token, new_contributor

EXAMPLES = 10
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(name="settings")
def unlimited(settings: Settings) -> Settings:
    """No per-key or per-address limits, which a run would reach (the clock does not move)."""
    limits = LimitSettings(
        signed_per_key=0,
        signed_per_provider_key=0,
        registration_per_ip=10**6,
        registration_per_key=10**6,
        unseen_keys_per_ip=0,
    )
    return settings.model_copy(update={"limits": limits})


async def _real_objects(
    client: httpx.AsyncClient, app_state: Any
) -> tuple[dict[str, str], SignatureAuth, SignatureAuth, dict[str, Any]]:
    admin = {"Authorization": f"Bearer {await make_token(app_state, 'admin')}"}
    signer, other = new_contributor(), new_contributor()
    for c in (signer, other):
        await c.register(client)
        r = await client.post(
            f"/v1/admin/providers/{c.provider_id}/deposits",
            json={"amount": 10**6},
            headers={**admin, "Idempotency-Key": uuid.uuid4().hex},
        )
        assert r.status_code == 201, r.text
    pool_id = (await client.post("/v1/admin/pools", json={"name": "fuzz"}, headers=admin)).json()["id"]
    assert (await client.post(f"/v1/admin/pools/{pool_id}/activate", headers=admin)).status_code == 200
    policy = {"step": 1, "uri": "s3://ckpt/step-1", "sha256": "a" * 64, "size": 1024}
    r = await client.post(f"/v1/admin/pools/{pool_id}/policies", json=policy, headers=admin)
    assert r.status_code == 201, r.text
    tasks = [
        {"prompt": f"{i}+2?", "sampling": {"max_tokens": 8}, "verification": {"expected_answer": str(i + 2)}}
        for i in range(4)
    ]
    r = await client.post(
        f"/v1/admin/pools/{pool_id}/tasks", json={"batch_key": "b", "tasks": tasks}, headers=admin
    )
    assert r.status_code == 201, r.text
    for c in (signer, other):
        assert (await client.post(f"/v1/pools/{pool_id}/join", json={}, auth=c.node_auth)).status_code == 201
        assert (await c.beat(client)).status_code == 200
    claim = await client.post(
        "/v1/assignments/claim", json={"pool_id": pool_id, "max_tasks": 1}, auth=signer.node_auth
    )
    real = {
        "pool_id": pool_id,
        # Never the signer's own node: a ban would leave every signed route answering 403.
        "node_id": other.node_id,
        "provider_id": other.provider_id,
        "task_id": r.json()["first_task_id"],
        "assignment_id": claim.json()["leases"][0]["assignment_id"],
    }
    return admin, signer.node_auth, signer.provider_auth, real


def _cases(operation: Any, real: dict[str, Any]) -> list[Any]:
    """EXAMPLES cases the operation's schema allows, the same every run; path ids real in some."""
    cases: list[Any] = []

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(), use_real_ids=st.booleans())
    def draw(case: Any, use_real_ids: bool) -> None:
        if use_real_ids and case.path_parameters:
            case.path_parameters = {
                name: real.get(name, value) for name, value in case.path_parameters.items()
            }
        cases.append(case)

    draw()
    return cases


def _request(case: Any) -> dict[str, Any]:
    """schemathesis' requests-style arguments, for an httpx client."""
    kwargs = case.as_transport_kwargs(base_url="http://testserver")
    if "data" in kwargs:
        data = kwargs.pop("data")
        kwargs["content"] = data.encode() if isinstance(data, str) else data
    return {k: v for k, v in kwargs.items() if k in ("method", "url", "params", "headers", "json", "content")}


async def test_no_operation_answers_outside_its_documented_responses(app: Any, app_state: Any) -> None:
    # An exception the app does not handle is answered 500 and checked as any answer, not raised.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        await _fuzz(client, app_state)


async def _fuzz(client: httpx.AsyncClient, app_state: Any) -> None:
    admin, node_auth, provider_auth, real = await _real_objects(client, app_state)
    schema = schemathesis.openapi.from_dict((await client.get("/openapi.json")).json())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 60
    failures: list[str] = []
    sent = 0
    for operation in operations:
        security = [name for s in operation.definition.raw.get("security", []) for name in s]
        signed = "HttpMessageSignature" in security
        auth = (
            (provider_auth if operation.path.startswith("/v1/providers") else node_auth) if signed else None
        )
        for case in _cases(operation, real):
            request = _request(case)
            request["headers"] = {**request.get("headers", {}), **({} if signed else admin)}
            response = await client.request(**request, auth=auth or httpx.USE_CLIENT_DEFAULT)
            sent += 1
            try:
                case.validate_response(response, checks=CHECKS)
            except (AssertionError, FailureGroup) as exc:  # failed checks: collect them all, then fail
                failures.append(f"{case.method} {case.formatted_path}: {response.status_code} {exc}"[:2000])
    assert sent >= len(operations) * 3
    assert failures == []
