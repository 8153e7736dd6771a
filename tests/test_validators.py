"""External validators: scoped, leased validation jobs and idempotent verdicts with evidence."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
from typing import Any

import pytest
from sqlalchemy import text

from orchestrator.admin.tokens import Role, create_token
from orchestrator.core.clock import FakeClock
from orchestrator.verification import service
from orchestrator.verification.jobs import verify_once
from orchestrator.verification.validators import expired_leases
from tests.conftest import problem
from tests.scoring_helpers import Gate
from tests.tasks_helpers import pool_setup, task
from tests.verification_helpers import FixedDraw, submit, verdicts, verify_all
from tests.waits import HANG_S


async def validator_headers(app_state: Any, pool_ids: list[str]) -> dict[str, str]:
    async with app_state.sessionmaker() as session, session.begin():
        token, _ = await create_token(session, role=Role.validator, name="toploc", pool_ids=pool_ids)
    return {"Authorization": f"Bearer {token}"}


GOOD = {"exponent_mismatches": 4, "mantissa_error_mean": 2.5, "mantissa_error_median": 1.0}


async def test_validators_lease_jobs_and_post_idempotent_verdicts(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    app_state.rng = FixedDraw(0.0)  # audit everything
    async with pool_setup(app, app_state, workers=2, audit_method="validator", audit_rate_floor=1.0) as s:
        for w in s.workers:
            await s.enqueue([task()], key=f"v-{w.node_id[:8]}")
            lease = (await w.claim(s.pool_id)).json()["leases"][0]
            await submit(w, lease, ["4"], proof="AAEC")
        await verify_all(app_state)
        assert await verdicts(s.admin, s.headers, s.pool_id) == []

        mine = await validator_headers(app_state, [s.pool_id])
        stranger = await validator_headers(app_state, ["pool_0000000000000000"])
        assert (
            await s.admin.post("/v1/validation/claim", json={"max_jobs": 5}, headers=stranger)
        ).json() == {"jobs": []}
        problem(await s.admin.post("/v1/validation/claim", json={}, headers=s.headers), 403, "role_forbidden")

        jobs = (await s.admin.post("/v1/validation/claim", json={"max_jobs": 5}, headers=mine)).json()["jobs"]
        assert len(jobs) == 2
        job = jobs[0]
        assert job["result"]["proof"] == "AAEC" and job["task"]["verification"] == {"expected_answer": "4"}
        assert (await s.admin.post("/v1/validation/claim", json={}, headers=mine)).json() == {"jobs": []}

        body = {
            "fencing_token": job["fencing_token"],
            "outcome": "valid",
            "reason": "toploc_ok",
            "evidence": GOOD,
        }
        first = await s.admin.post(f"/v1/validation/jobs/{job['job_id']}/verdict", json=body, headers=mine)
        assert first.status_code == 200, first.text
        assert (
            first.json()["verdict"]["category"] == "valid"
            and first.json()["verdict"]["verifier"] == "validator"
        )
        again = await s.admin.post(f"/v1/validation/jobs/{job['job_id']}/verdict", json=body, headers=mine)
        assert again.json() == first.json()
        # The trainer feed says who checked the rollout.
        feed = await s.admin.get(f"/v1/pools/{s.pool_id}/rollouts", headers=s.headers)
        assert [r["verified_by"] for r in feed.json()["items"]] == ["validator"]
        changed = {**body, "outcome": "fraud", "reason": "toploc_mismatch"}
        problem(
            await s.admin.post(f"/v1/validation/jobs/{job['job_id']}/verdict", json=changed, headers=mine),
            409,
            "verdict_conflict",
        )
        problem(
            await s.admin.post(f"/v1/validation/jobs/{job['job_id']}/verdict", json=body, headers=stranger),
            404,
            "validation_job_not_found",
        )

        # The second job: evidence that contradicts "valid" is refused; a fraud verdict slashes.
        other = jobs[1]
        bad = {
            "fencing_token": other["fencing_token"],
            "outcome": "valid",
            "reason": "toploc_ok",
            "evidence": {"exponent_mismatches": 60, "mantissa_error_mean": 2.0, "mantissa_error_median": 1.0},
        }
        problem(
            await s.admin.post(f"/v1/validation/jobs/{other['job_id']}/verdict", json=bad, headers=mine),
            422,
            "evidence_contradicts",
        )
        fraud = {**bad, "outcome": "fraud", "reason": "toploc_mismatch"}
        r = await s.admin.post(f"/v1/validation/jobs/{other['job_id']}/verdict", json=fraud, headers=mine)
        assert (
            r.json()["verdict"]["category"] == "fraud" and r.json()["verdict"]["reason"] == "toploc_mismatch"
        )
        assert len(await verdicts(s.admin, s.headers, s.pool_id)) == 2


async def test_a_claim_takes_no_more_result_bytes_than_one_result_may_have(app: Any, app_state: Any) -> None:
    """A claim answered up to 50 jobs, each with its signed result whole: results of up to
    ORCH_LIMITS__MAX_RESULT_BODY_BYTES (10 MiB) each, with TOPLOC proofs of up to 7 MiB, the
    nodes' choice, so one claim read, parsed and sent some 500 MB, on the event loop. Fresh
    nodes' first results are all audited, so a few sybils with large results made it so. A claim
    now takes jobs in order while their results add up to at most that limit (the first one
    whatever its size); the others stay open for the next claim."""
    app_state.rng = FixedDraw(0.0)  # audit everything
    limit = app_state.settings.limits.max_result_body_bytes
    proof = base64.b64encode(b"\x01" * (limit * 3 // 10)).decode()  # 40 % of the limit
    async with pool_setup(app, app_state, workers=3, audit_method="validator", audit_rate_floor=1.0) as s:
        for w in s.workers:
            await s.enqueue([task()], key=f"v-{w.node_id[:8]}")
            lease = (await w.claim(s.pool_id)).json()["leases"][0]
            await submit(w, lease, ["4"], proof=proof)
        await verify_all(app_state)
        mine = await validator_headers(app_state, [s.pool_id])

        first = (await s.admin.post("/v1/validation/claim", json={"max_jobs": 50}, headers=mine)).json()[
            "jobs"
        ]
        assert [len(job["result"]["proof"]) for job in first] == [len(proof)] * 2  # a third: 120 %
        second = (await s.admin.post("/v1/validation/claim", json={"max_jobs": 50}, headers=mine)).json()[
            "jobs"
        ]
        assert len(second) == 1
        assert len({job["job_id"] for job in first + second}) == 3


async def test_an_expired_validator_lease_returns_to_the_queue(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    app_state.rng = FixedDraw(0.0)
    async with pool_setup(app, app_state, workers=1, audit_method="validator", audit_rate_floor=1.0) as s:
        w = s.workers[0]
        await s.enqueue([task()])
        await submit(w, (await w.claim(s.pool_id)).json()["leases"][0], ["4"])
        await verify_all(app_state)
        v = await validator_headers(app_state, [s.pool_id])
        job = (await s.admin.post("/v1/validation/claim", json={}, headers=v)).json()["jobs"][0]
        clock.advance(301)
        report = await verify_once(app_state)
        assert report.validator_leases_expired == 1
        again = (await s.admin.post("/v1/validation/claim", json={}, headers=v)).json()["jobs"][0]
        assert again["job_id"] == job["job_id"] and again["fencing_token"] == job["fencing_token"] + 1
        stale = {"fencing_token": job["fencing_token"], "outcome": "valid", "reason": "ok", "evidence": GOOD}
        problem(
            await s.admin.post(f"/v1/validation/jobs/{job['job_id']}/verdict", json=stale, headers=v),
            409,
            "lease_expired",
        )


async def test_only_pools_that_route_to_validators_make_validator_jobs(app: Any, app_state: Any) -> None:
    app_state.rng = FixedDraw(0.0)
    async with pool_setup(app, app_state, workers=2, audit_rate_floor=1.0) as s:  # audit_method: replicate
        await s.enqueue([task()])
        await submit(s.workers[0], (await s.workers[0].claim(s.pool_id)).json()["leases"][0], ["4"])
        await verify_all(app_state)
        v = await validator_headers(app_state, [s.pool_id])
        assert (await s.admin.post("/v1/validation/claim", json={}, headers=v)).json() == {"jobs": []}


async def test_a_validator_verdict_keeps_the_servers_reward_per_sample_for_the_feed(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    from tests.test_feed import trainer_headers

    app_state.rng = FixedDraw(0.0)  # every result audited
    async with pool_setup(app, app_state, workers=1, audit_method="validator", audit_rate_floor=1.0) as s:
        w = s.workers[0]
        await s.enqueue([task(n=2)])
        lease = (await w.claim(s.pool_id)).json()["leases"][0]
        await submit(w, lease, ["4", "5"])  # one right, one wrong
        await verify_all(app_state)
        v = await validator_headers(app_state, [s.pool_id])
        job = (await s.admin.post("/v1/validation/claim", json={}, headers=v)).json()["jobs"][0]
        body = {"fencing_token": job["fencing_token"], "outcome": "valid", "reason": "ok", "evidence": GOOD}
        r = await s.admin.post(f"/v1/validation/jobs/{job['job_id']}/verdict", json=body, headers=v)
        assert r.status_code == 200, r.text
        trainer = await trainer_headers(app_state, [s.pool_id])
        [item] = (await s.admin.get(f"/v1/pools/{s.pool_id}/rollouts", headers=trainer)).json()["items"]
        assert [x["reward"] for x in item["samples"]] == [1.0, 0.0]


async def test_a_validator_verdict_does_not_wait_behind_the_verifiers_scoring(
    app: Any, app_state: Any, clock: FakeClock, gate: Gate
) -> None:
    """The verdict route scores in a pool of its own: while the verifier loop's scoring process
    spends its whole time limit on one result (an answer SymPy cannot finish, say), a
    validator's verdict is answered at once (it used to queue behind it, in the one scoring
    process). The verifier's result is held in scoring here until the verdict is answered: a
    verdict that queued behind it would never be."""
    app_state.settings.verifier.reward_timeout_s = 600
    app_state.rng = FixedDraw(0.0)
    async with pool_setup(
        app, app_state, workers=2, reward_function="gated", audit_method="validator", audit_rate_floor=1.0
    ) as s:
        honest, held = s.workers
        for i in range(2):
            await s.enqueue([task(prompt="What is 2 + 2?", verification={"answer": "4"})], key=f"h{i}")
            await submit(honest, (await honest.claim(s.pool_id)).json()["leases"][0], ["4"])
        assert await verify_all(app_state) == 2
        v = await validator_headers(app_state, [s.pool_id])
        jobs = (await s.admin.post("/v1/validation/claim", json={"max_jobs": 2}, headers=v)).json()["jobs"]
        assert len(jobs) == 2

        async def post(job: dict[str, Any]) -> Any:
            body = {
                "fencing_token": job["fencing_token"],
                "outcome": "valid",
                "reason": "ok",
                "evidence": GOOD,
            }
            return await s.admin.post(f"/v1/validation/jobs/{job['job_id']}/verdict", json=body, headers=v)

        assert (await post(jobs[0])).status_code == 200  # its scoring process is started now

        await s.enqueue(
            [task(prompt="What is 2 + 2?", verification={"answer": "4", **gate.spec})], key="held"
        )
        lease = (await held.claim(s.pool_id)).json()["leases"][0]
        await submit(held, lease, ["4"])
        verifier = asyncio.create_task(verify_all(app_state))
        await gate.scoring_started()  # the verifier's scoring process is held on it
        r = await asyncio.wait_for(post(jobs[1]), HANG_S)
        assert r.status_code == 200, r.text
        assert not verifier.done()  # the verdict did not wait for the verifier's scoring
        gate.open()
        assert await verifier == 1


async def test_a_claim_naming_a_pool_id_with_a_nul_is_a_body_that_does_not_validate(
    client: Any, admin_headers: dict[str, str]
) -> None:
    """PostgreSQL text cannot hold a NUL: an admin's claim naming such a pool answered 500."""
    r = await client.post("/v1/validation/claim", json={"pool_id": "pool_\x00"}, headers=admin_headers)
    body = problem(r, 422, "validation_failed")
    assert body["errors"][0]["loc"] == ["body", "pool_id"]


async def test_a_validator_chooses_its_lease_and_extends_a_live_one(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A check that takes longer than 300 s was lost: the lease was fixed at 300 s, and its
    verdict was refused lease_expired. The claim takes lease_s; the holder extends a live lease."""
    app_state.rng = FixedDraw(0.0)
    async with pool_setup(app, app_state, workers=2, audit_method="validator", audit_rate_floor=1.0) as s:
        for w in s.workers:
            await s.enqueue([task()], key=f"e-{w.node_id[:8]}")
            await submit(w, (await w.claim(s.pool_id)).json()["leases"][0], ["4"])
        await verify_all(app_state)
        v = await validator_headers(app_state, [s.pool_id])
        other = await validator_headers(app_state, [s.pool_id])
        claimed = await s.admin.post("/v1/validation/claim", json={"lease_s": 900}, headers=v)
        long_job = claimed.json()["jobs"][0]
        short_job = (await s.admin.post("/v1/validation/claim", json={}, headers=v)).json()["jobs"][0]
        start = clock.utcnow()

        def expiry(job: dict[str, Any]) -> float:
            return (dt.datetime.fromisoformat(job["lease_expires_at"]) - start).total_seconds()

        assert expiry(long_job) == 900 and expiry(short_job) == 300
        clock.advance(250)
        url = f"/v1/validation/jobs/{short_job['job_id']}/extend"
        body = {"fencing_token": short_job["fencing_token"], "lease_s": 600}
        problem(await s.admin.post(url, json=body, headers=other), 409, "lease_expired")
        stale = {**body, "fencing_token": short_job["fencing_token"] + 1}
        problem(await s.admin.post(url, json=stale, headers=v), 409, "lease_expired")
        r = await s.admin.post(url, json=body, headers=v)
        assert r.status_code == 200, r.text
        assert r.json()["fencing_token"] == short_job["fencing_token"] and expiry(r.json()) == 850

        clock.advance(450)  # 700 s after the claims: past the old 300 s, within both leases
        assert (await verify_once(app_state)).validator_leases_expired == 0
        for job in (long_job, short_job):
            verdict = {
                "fencing_token": job["fencing_token"],
                "outcome": "valid",
                "reason": "ok",
                "evidence": GOOD,
            }
            r = await s.admin.post(f"/v1/validation/jobs/{job['job_id']}/verdict", json=verdict, headers=v)
            assert r.status_code == 200, r.text
        # A decided job's lease is over; so is one that ran out.
        problem(await s.admin.post(url, json=body, headers=v), 409, "lease_expired")
        for bad in ({"lease_s": 29}, {"lease_s": 3601}):
            problem(await s.admin.post("/v1/validation/claim", json=bad, headers=v), 422, "validation_failed")
            problem(await s.admin.post(url, json={**body, **bad}, headers=v), 422, "validation_failed")
        problem(
            await s.admin.post("/v1/validation/jobs/999999/extend", json=body, headers=v),
            404,
            "validation_job_not_found",
        )


async def test_a_claim_naming_a_pool_out_of_scope_or_unknown_is_404_not_an_empty_answer(
    app: Any, app_state: Any
) -> None:
    """An empty list looked like a pool with nothing to check, hiding a typo in the pool id."""
    async with pool_setup(app, app_state, audit_method="validator") as s:
        v = await validator_headers(app_state, [s.pool_id])
        for pool_id in ("pool_0000000000000000", "pool-typo"):
            r = await s.admin.post("/v1/validation/claim", json={"pool_id": pool_id}, headers=v)
            problem(r, 404, "pool_not_found")
            r = await s.admin.post("/v1/validation/claim", json={"pool_id": pool_id}, headers=s.admin_headers)
            problem(r, 404, "pool_not_found")
        r = await s.admin.post("/v1/validation/claim", json={"pool_id": s.pool_id}, headers=v)
        assert r.json() == {"jobs": []}


async def test_a_validator_verdict_scores_without_holding_up_other_writes(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On SQLite every transaction holds the one write lock: the verdict route scored the result
    inside its own, so every claim, result and registration waited as long as the reward
    function ran (up to reward_timeout_s, 10 s by default, for an answer SymPy cannot finish).
    Only a job made before migration 0031 is scored again (a later one keeps the checks'
    rewards per sample)."""
    app_state.rng = FixedDraw(0.0)
    async with pool_setup(app, app_state, workers=2, audit_method="validator", audit_rate_floor=1.0) as s:
        first, second = s.workers
        await s.enqueue([task(), task()])
        await submit(first, (await first.claim(s.pool_id)).json()["leases"][0], ["4"])
        await verify_all(app_state)
        v = await validator_headers(app_state, [s.pool_id])
        job = (await s.admin.post("/v1/validation/claim", json={}, headers=v)).json()["jobs"][0]
        async with app_state.sessionmaker() as session, session.begin():  # as made before 0031
            await session.execute(text("UPDATE validation_jobs SET per_sample_rewards = NULL"))

        entered, release = asyncio.Event(), asyncio.Event()
        score_result = service.score_result

        async def held(given: Any, scorer: Any) -> Any:
            entered.set()
            await release.wait()  # the reward function is still running
            return await score_result(given, scorer)

        monkeypatch.setattr(service, "score_result", held)
        body = {"fencing_token": job["fencing_token"], "outcome": "valid", "reason": "ok", "evidence": GOOD}
        posting = asyncio.create_task(
            s.admin.post(f"/v1/validation/jobs/{job['job_id']}/verdict", json=body, headers=v)
        )
        await asyncio.wait_for(entered.wait(), timeout=30)
        claimed = await asyncio.wait_for(second.claim(s.pool_id), timeout=10)
        assert len(claimed.json()["leases"]) == 1, claimed.text
        release.set()
        r = await posting
        assert r.status_code == 200, r.text
        assert r.json()["verdict"]["category"] == "valid"
        assert r.json()["verdict"]["details"]["per_sample_rewards"] == [1.0]


async def test_a_validator_verdict_takes_the_rewards_the_checks_kept_without_scoring_again(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks scored the result before sending it to the validators, and the job keeps their
    reward per sample: the verdict carries those (the feed serves them), and runs no reward
    function again (which could take up to reward_timeout_s, or answer otherwise since)."""
    app_state.rng = FixedDraw(0.0)
    async with pool_setup(app, app_state, workers=1, audit_method="validator", audit_rate_floor=1.0) as s:
        w = s.workers[0]
        await s.enqueue([task(n=2)])
        await submit(w, (await w.claim(s.pool_id)).json()["leases"][0], ["4", "5"])
        await verify_all(app_state)
        v = await validator_headers(app_state, [s.pool_id])
        job = (await s.admin.post("/v1/validation/claim", json={}, headers=v)).json()["jobs"][0]

        async def scored_again(given: Any, scorer: Any) -> Any:
            raise AssertionError("the result was scored again")

        monkeypatch.setattr(service, "score_result", scored_again)
        body = {"fencing_token": job["fencing_token"], "outcome": "valid", "reason": "ok", "evidence": GOOD}
        r = await s.admin.post(f"/v1/validation/jobs/{job['job_id']}/verdict", json=body, headers=v)
        assert r.status_code == 200, r.text
        details = r.json()["verdict"]["details"]
        assert (details["per_sample_rewards"], details["server_reward"]) == ([1.0, 0.0], 0.5)


async def test_reopening_expired_validator_leases_reads_only_the_leased_jobs(app_state: Any) -> None:
    """The verifier's housekeeping reopens expired validator leases every second: the pick is
    served by the partial index on the leased jobs, not a scan of every job ever decided."""
    stmt = expired_leases(dt.datetime.now(dt.UTC))
    async with app_state.engine.connect() as conn:
        sql = str(stmt.compile(conn, compile_kwargs={"literal_binds": True}))
        if conn.dialect.name == "postgresql":
            await conn.execute(text("SET LOCAL enable_seqscan = off"))  # any usable index is used
            plan = "\n".join((await conn.execute(text("EXPLAIN " + sql))).scalars())
        else:
            plan = "\n".join(str(row[-1]) for row in await conn.execute(text("EXPLAIN QUERY PLAN " + sql)))
        await conn.rollback()
    assert "ix_validation_jobs_leased_expiry" in plan, plan
