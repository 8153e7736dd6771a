"""Limits the API advertises, kept by its own body limits and bounds: a shard manifest and a
proof of the largest size the schemas take fit the body limits; a fencing token beyond 64 bits
and a boolean that is not true or false are input errors, not a lease called expired or a
canary made of "yes"."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import pytest

from api_schemas.tasks import MAX_PROOF_BYTES
from tests.conftest import problem
from tests.tasks_helpers import pool_setup, result_body, task


@pytest.fixture
async def lenient(app: Any) -> Any:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
        yield c


async def test_a_shard_manifest_of_the_documented_maximum_can_be_published(
    app: Any, app_state: Any, lenient: Any
) -> None:
    """PolicyIn takes up to 10,000 shards (OpenAPI maxItems 10000), but the policies route had
    the general 1 MiB body limit: a manifest of 10,000 shards with ordinary names was 413."""
    async with pool_setup(app, app_state) as s:
        shards = [
            {
                "uri": f"s3://checkpoints/run-7/step-2/model-{i:05d}-of-10000.safetensors",
                "sha256": f"{i:064x}",
                "bytes": 1_000_000,
            }
            for i in range(10_000)
        ]
        body = {
            "step": 2,
            "uri": "s3://checkpoints/run-7/step-2/",
            "sha256": "a" * 64,
            "size": 10_000 * 1_000_000,
            "shards": shards,
        }
        r = await lenient.post(f"/v1/admin/pools/{s.pool_id}/policies", json=body, headers=s.headers)
        assert r.status_code == 201, (r.status_code, r.text[:300])
        assert len(r.json()["shards"]) == 10_000


async def test_a_proof_within_the_documented_proof_limit_is_not_refused_as_too_large(
    app: Any, app_state: Any, lenient: Any
) -> None:
    """ResultIn takes a proof of up to MAX_PROOF_BYTES (a larger one is 422). At 8 MiB its
    base64 (11.2 MB) could not fit the result route's default body limit
    (ORCH_LIMITS__MAX_RESULT_BODY_BYTES, 10 MiB, "proofs included"): 413. It is 7 MiB now."""
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        proof = base64.b64encode(bytes(MAX_PROOF_BYTES)).decode()
        r = await w.client.post(
            f"/v1/assignments/{lease['assignment_id']}/result",
            json=result_body(lease, proof=proof),
            auth=w.contributor.node_auth,
        )
        assert r.status_code == 201, (r.status_code, r.text[:300])


@pytest.mark.parametrize("token", [2**63, 2**64, 10**30])
async def test_a_fencing_token_beyond_64_bits_is_422_not_lease_expired(
    app: Any, app_state: Any, lenient: Any, token: int
) -> None:
    """Every integer of the protocol is within the signed 64-bit range, and a seed or policy_step
    beyond it is refused as input (422 validation_failed). A fencing_token beyond it was taken
    and answered 409 lease_expired ('this lease has expired or was reissued'), telling a worker
    to drop a lease that is live."""
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        r = await w.client.post(
            f"/v1/assignments/{lease['assignment_id']}/result",
            json=result_body(lease, fencing_token=token),
            auth=w.contributor.node_auth,
        )
        assert r.status_code == 422, (r.status_code, r.text[:300])
        assert problem(r, 422, "validation_failed")["errors"][0]["loc"] == ["body", "fencing_token"]
        # The lease it called expired is live: the same result with its own token is recorded.
        r = await w.client.post(
            f"/v1/assignments/{lease['assignment_id']}/result",
            json=result_body(lease),
            auth=w.contributor.node_auth,
        )
        assert r.status_code == 201, r.text


@pytest.mark.parametrize("value", ["yes", "on", "1", 1, 0.0])
async def test_a_boolean_field_takes_only_a_json_boolean(
    app: Any, app_state: Any, lenient: Any, value: Any
) -> None:
    """Request bodies refuse a string or true for a number (StrictModel), but a boolean field
    took a string or a number: "yes", "on" and "1" made a task a canary (whose wrong answers are
    judged fraud and slashed), 0.0 turned a pool's require_proof off. A JSON boolean is due."""
    async with pool_setup(app, app_state) as s:
        r = await lenient.post(
            f"/v1/admin/pools/{s.pool_id}/tasks",
            json={"batch_key": "canary", "tasks": [task(canary=value)]},
            headers=s.headers,
        )
        problem(r, 422, "validation_failed")
        r = await lenient.post(
            "/v1/admin/pools", json={"name": "p", "policy": {"require_proof": value}}, headers=s.headers
        )
        problem(r, 422, "validation_failed")
        # Nothing was stored by either refusal.
        listed = await lenient.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)
        assert listed.json()["items"] == []
