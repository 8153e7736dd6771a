"""Results sent to validators that no validator decides: after ``verifier.validator_wait_s`` the
job is withdrawn from the validators and the result decided on the server's own checks, as a
skipped audit, so that neither the result nor its node's reward waits for ever on validators
that are down, unscoped or never finish."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest
from sqlalchemy import select

from api_schemas.verification import ValidatorVerdictIn
from orchestrator.admin.tokens import Principal, Role, create_token
from orchestrator.core.clock import FakeClock
from orchestrator.verification import jobs, validators
from orchestrator.verification.jobs import release_once, verify_once
from orchestrator.verification.models import ValidationJob
from orchestrator.verification.scoring import scorer_for
from tests.conftest import postgres_only, problem
from tests.tasks_helpers import pool_setup, task
from tests.test_feed import trainer_headers
from tests.verification_helpers import (
    FixedDraw,
    balances,
    books_balance,
    pending_matches_holds,
    submit,
    verdicts,
    verify_all,
)

WAIT_S = 600
ECON = {
    "min_stake_per_node": 1000,
    "reward_per_sample": 7,
    "reward_hold_s": 3600,
    "fraud_slash_amount": 200,
}
GOOD = {"exponent_mismatches": 4, "mantissa_error_mean": 2.5, "mantissa_error_median": 1.0}
SKIPPED = f"no validator posted a verdict within {WAIT_S} s"


@pytest.fixture(autouse=True)
def _audit_everything(app_state: Any) -> None:
    app_state.rng = FixedDraw(0.0)  # every result goes to the validators
    app_state.settings.verifier.validator_wait_s = WAIT_S


async def _validator(app_state: Any, pool_id: str) -> tuple[dict[str, str], Principal]:
    async with app_state.sessionmaker() as session, session.begin():
        token, row = await create_token(session, role=Role.validator, name="toploc", pool_ids=[pool_id])
    principal = Principal(token_id=row.id, name=row.name, role=Role.validator, pool_ids=frozenset([pool_id]))
    return {"Authorization": f"Bearer {token}"}, principal


async def _send(app_state: Any, s: Any, worker: Any, answers: list[str], key: str) -> None:
    """The worker answers one task; the verifier checks it and sends it to the validators."""
    await s.enqueue([task(n=len(answers))], key=key)
    await submit(worker, (await worker.claim(s.pool_id)).json()["leases"][0], answers)
    await verify_all(app_state)


async def _tick(app_state: Any, clock: FakeClock, seconds: float) -> Any:
    clock.advance(seconds)
    return await verify_once(app_state)


async def _claim(s: Any, headers: dict[str, str], **body: Any) -> list[dict[str, Any]]:
    r = await s.admin.post("/v1/validation/claim", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return list(r.json()["jobs"])


def _verdict_body(job: dict[str, Any], outcome: str = "valid") -> dict[str, Any]:
    reason = "toploc_ok" if outcome == "valid" else "toploc_mismatch"
    return {"fencing_token": job["fencing_token"], "outcome": outcome, "reason": reason, "evidence": GOOD}


async def test_a_result_no_validator_decides_is_decided_on_its_checks_after_the_wait(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """Decided as a result accepted on its checks is: the same reward, held as long, released
    when due, and the trainer feed serves the server's reward of each sample."""
    async with pool_setup(
        app, app_state, workers=1, economics=ECON, stake=1000, audit_method="validator", audit_rate_floor=1.0
    ) as s:
        w = s.workers[0]
        await _send(app_state, s, w, ["4", "5"], "audited")  # one sample right, one wrong
        app_state.rng = FixedDraw(1.0)  # the next result is not drawn for an audit
        await _send(app_state, s, w, ["4", "5"], "unaudited")
        [unaudited] = await verdicts(s.admin, s.headers, s.pool_id)
        v_headers, _ = await _validator(app_state, s.pool_id)

        # Within the wait nothing decides it: a validator could still come.
        report = await _tick(app_state, clock, WAIT_S - 1)
        assert report.ran and report.validator_waits_expired == 0
        assert len(await verdicts(s.admin, s.headers, s.pool_id)) == 1

        # Past the wait no claim is offered it, even before the housekeeping withdraws it.
        clock.advance(2)
        assert await _claim(s, v_headers) == []
        report = await verify_once(app_state)
        assert report.validator_waits_expired == 1
        _, audited = await verdicts(s.admin, s.headers, s.pool_id)
        assert audited["details"]["audit_skipped"] == SKIPPED
        assert audited["details"]["per_sample_rewards"] == [1.0, 0.0]
        same = (
            "outcome",
            "category",
            "reason",
            "verifier",
            "server_reward",
            "reward_amount",
            "slashed_amount",
        )
        assert {k: audited[k] for k in same} == {k: unaudited[k] for k in same}
        assert (audited["category"], audited["verifier"], audited["reward_amount"]) == ("valid", "reward", 7)

        b = await balances(s.admin, w)
        assert (b["rewards_pending"], b["rewards_claimable"], b["stake_locked"]) == (14, 0, 1000)
        trainer = await trainer_headers(app_state, [s.pool_id])
        items = (await s.admin.get(f"/v1/pools/{s.pool_id}/rollouts", headers=trainer)).json()["items"]
        assert [[x["reward"] for x in item["samples"]] for item in items] == [[1.0, 0.0], [1.0, 0.0]]

        # Withdrawn for good: never offered again, never decided twice.
        assert await _claim(s, v_headers) == []
        assert (await _tick(app_state, clock, WAIT_S + 1)).validator_waits_expired == 0
        assert len(await verdicts(s.admin, s.headers, s.pool_id)) == 2
        clock.advance(3600)
        await release_once(app_state)
        b = await balances(s.admin, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 14)
        await pending_matches_holds(app_state)
        await books_balance(app_state)


async def test_a_wrong_answer_no_validator_decides_is_invalid_on_its_checks(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(
        app, app_state, workers=1, economics=ECON, stake=1000, audit_method="validator", audit_rate_floor=1.0
    ) as s:
        await _send(app_state, s, s.workers[0], ["5"], "wrong")
        assert (await _tick(app_state, clock, WAIT_S + 1)).validator_waits_expired == 1
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["outcome"], v["category"], v["reason"], v["reward_amount"]) == (
            "rejected",
            "invalid",
            "wrong_answer",
            0,
        )
        assert v["details"]["audit_skipped"] == SKIPPED


async def test_a_live_validator_lease_is_honoured_past_the_wait(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A validator that claimed within the wait keeps its leases past it: its verdict counts,
    and a job whose lease then runs out unanswered is withdrawn at the next tick."""
    async with pool_setup(
        app, app_state, workers=2, economics=ECON, stake=1000, audit_method="validator", audit_rate_floor=1.0
    ) as s:
        for i, w in enumerate(s.workers):
            await _send(app_state, s, w, ["4"], f"t{i}")
        v_headers, _ = await _validator(app_state, s.pool_id)
        clock.advance(WAIT_S - 10)
        decided, unanswered = await _claim(s, v_headers, max_jobs=2, lease_s=900)

        # Past the wait, both leases live: nothing is withdrawn from under them.
        for _ in range(4):
            report = await _tick(app_state, clock, 200)
            assert (report.validator_leases_expired, report.validator_waits_expired) == (0, 0)
        url = f"/v1/validation/jobs/{decided['job_id']}/verdict"
        r = await s.admin.post(url, json=_verdict_body(decided), headers=v_headers)
        assert r.status_code == 200, r.text
        assert r.json()["verdict"]["verifier"] == "validator"
        assert "audit_skipped" not in r.json()["verdict"]["details"]

        report = await _tick(app_state, clock, 101)  # 901 s after the claim
        assert (report.validator_leases_expired, report.validator_waits_expired) == (1, 1)
        vs = await verdicts(s.admin, s.headers, s.pool_id)
        assert [(v["submission_id"], v["verifier"], "audit_skipped" in v["details"]) for v in vs] == [
            (decided["submission_id"], "validator", False),
            (unanswered["submission_id"], "reward", True),
        ]


async def test_extending_a_lease_cannot_hold_a_job_past_the_wait_and_one_longest_lease(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """Extended again and again, a lease stops 3600 s (the longest lease) past the job's wait:
    it runs out there, and the job is withdrawn and decided."""
    async with pool_setup(
        app, app_state, workers=1, economics=ECON, stake=1000, audit_method="validator", audit_rate_floor=1.0
    ) as s:
        await _send(app_state, s, s.workers[0], ["4"], "held")
        made = clock.utcnow()
        v_headers, _ = await _validator(app_state, s.pool_id)
        clock.advance(WAIT_S - 10)
        [job] = await _claim(s, v_headers, lease_s=900)
        extend = f"/v1/validation/jobs/{job['job_id']}/extend"

        async def extended_to(lease_s: int) -> Any:
            body = {"fencing_token": job["fencing_token"], "lease_s": lease_s}
            return await s.admin.post(extend, json=body, headers=v_headers)

        def expiry(r: Any) -> dt.datetime:
            assert r.status_code == 200, r.text
            return dt.datetime.fromisoformat(r.json()["lease_expires_at"])

        assert expiry(await extended_to(1200)) == clock.utcnow() + dt.timedelta(seconds=1200)  # as asked
        bound = made + dt.timedelta(seconds=WAIT_S + 3600)
        for _ in range(3):
            report = await _tick(app_state, clock, 1000)
            assert (report.validator_leases_expired, report.validator_waits_expired) == (0, 0)
            assert expiry(await extended_to(3600)) == bound
        clock.advance((bound - clock.utcnow()).total_seconds() + 1)
        problem(await extended_to(3600), 409, "lease_expired")
        report = await verify_once(app_state)
        assert (report.validator_leases_expired, report.validator_waits_expired) == (1, 1)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["verifier"], v["details"]["audit_skipped"]) == ("reward", SKIPPED)


async def test_a_verdict_posted_after_the_withdrawal_is_refused_and_changes_nothing(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """The validator's lease ran out within the wait and the job was withdrawn after it; its
    fraud verdict, posted late, must neither slash the stake nor take back the reward."""
    async with pool_setup(
        app, app_state, workers=1, economics=ECON, stake=1000, audit_method="validator", audit_rate_floor=1.0
    ) as s:
        w = s.workers[0]
        await _send(app_state, s, w, ["4"], "late")
        v_headers, _ = await _validator(app_state, s.pool_id)
        [job] = await _claim(s, v_headers, lease_s=60)
        assert (await _tick(app_state, clock, 61)).validator_leases_expired == 1
        assert (await _tick(app_state, clock, WAIT_S)).validator_waits_expired == 1
        before = (await verdicts(s.admin, s.headers, s.pool_id), await balances(s.admin, w))

        url = f"/v1/validation/jobs/{job['job_id']}"
        body = problem(
            await s.admin.post(f"{url}/verdict", json=_verdict_body(job, "fraud"), headers=v_headers),
            409,
            "validation_withdrawn",
        )
        assert "decided on the server's checks" in body["detail"]
        extend = {"fencing_token": job["fencing_token"], "lease_s": 300}
        problem(
            await s.admin.post(f"{url}/extend", json=extend, headers=v_headers), 409, "validation_withdrawn"
        )
        after = (await verdicts(s.admin, s.headers, s.pool_id), await balances(s.admin, w))
        assert after == before
        assert before[1]["stake_locked"] == 1000 and before[1]["rewards_pending"] == 7
        await books_balance(app_state)


async def test_the_withdrawal_works_in_bounded_batches_oldest_first(
    app: Any, app_state: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs, "VALIDATOR_WAIT_BATCH", 2)
    async with pool_setup(
        app, app_state, workers=1, economics=ECON, stake=1000, audit_method="validator", audit_rate_floor=1.0
    ) as s:
        for i in range(3):
            await _send(app_state, s, s.workers[0], ["4"], f"b{i}")
            clock.advance(1)
        async with app_state.sessionmaker() as session:
            stmt = select(ValidationJob.submission_id).order_by(ValidationJob.created_at)
            oldest_first = list((await session.scalars(stmt)).all())
        assert (await _tick(app_state, clock, WAIT_S)).validator_waits_expired == 2
        assert [v["submission_id"] for v in await verdicts(s.admin, s.headers, s.pool_id)] == oldest_first[:2]
        assert (await _tick(app_state, clock, 1)).validator_waits_expired == 1
        assert (await _tick(app_state, clock, 1)).validator_waits_expired == 0
        assert len(await verdicts(s.admin, s.headers, s.pool_id)) == 3


@postgres_only
async def test_a_verdict_waiting_for_a_withdrawal_in_progress_is_refused(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """The verdict was sent while its lease was live, but the housekeeping (its clock a little
    later, past the lease and the wait) took the job first: the verdict waits for it, then finds
    the job withdrawn. One verdict, one reward."""
    async with pool_setup(
        app, app_state, workers=1, economics=ECON, stake=1000, audit_method="validator", audit_rate_floor=1.0
    ) as s:
        w = s.workers[0]
        await _send(app_state, s, w, ["4"], "race")
        v_headers, _ = await _validator(app_state, s.pool_id)
        clock.advance(WAIT_S - 30)
        [job] = await _claim(s, v_headers, lease_s=30)
        clock.advance(29)  # the validator's clock: its lease runs 1 s more
        later = clock.utcnow() + dt.timedelta(seconds=2)  # the housekeeping's
        async with app_state.sessionmaker() as session:
            await session.begin()
            assert await validators.expire_leases(session, now=later) == 1
            assert await validators.expire_waits(session, now=later, wait_s=WAIT_S) == 1
            url = f"/v1/validation/jobs/{job['job_id']}/verdict"
            posting = asyncio.create_task(s.admin.post(url, json=_verdict_body(job), headers=v_headers))
            await asyncio.sleep(1.0)
            assert not posting.done()  # waiting for the job the withdrawal holds
            await session.commit()
        problem(await posting, 409, "validation_withdrawn")
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["verifier"], v["details"]["audit_skipped"]) == ("reward", SKIPPED)
        assert (await balances(s.admin, w))["rewards_pending"] == 7
        await pending_matches_holds(app_state)
        await books_balance(app_state)


@postgres_only
async def test_a_verdict_in_progress_keeps_its_job_from_the_withdrawal(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """The other order: the validator's verdict holds the job (its lease live by its clock) when
    the housekeeping, past the lease and the wait, runs. The tick leaves that job to the verdict
    and withdraws another that nobody holds (whose verdict waits for the system accounts the
    validator's verdict holds, until it commits); the validator's verdict decides, once."""
    async with pool_setup(
        app, app_state, workers=2, economics=ECON, stake=1000, audit_method="validator", audit_rate_floor=1.0
    ) as s:
        w, other = s.workers
        await _send(app_state, s, w, ["4"], "race")
        await _send(app_state, s, other, ["4"], "nobody")
        v_headers, principal = await _validator(app_state, s.pool_id)
        clock.advance(WAIT_S - 30)
        [job] = await _claim(s, v_headers, lease_s=30)
        clock.advance(29)
        body = ValidatorVerdictIn.model_validate(_verdict_body(job))
        scorer = scorer_for(app_state.settings.verifier, "requests")
        async with app_state.sessionmaker() as session:
            await session.begin()
            await validators.post_verdict(
                session, principal, job["job_id"], body, now=clock.utcnow(), scorer=scorer
            )
            clock.advance(2)  # the housekeeping's clock: past the lease and the wait
            tick = asyncio.create_task(verify_once(app_state))
            await asyncio.sleep(1.0)
            await session.commit()
        report = await asyncio.wait_for(tick, timeout=30)
        assert report.ran
        assert (report.validator_leases_expired, report.validator_waits_expired) == (0, 1)
        assert (await _tick(app_state, clock, 1)).validator_waits_expired == 0
        by_node = {v["node_id"]: v for v in await verdicts(s.admin, s.headers, s.pool_id)}
        assert len(by_node) == 2
        mine, nobodys = by_node[w.node_id], by_node[other.node_id]
        assert mine["verifier"] == "validator" and "audit_skipped" not in mine["details"]
        assert (nobodys["verifier"], nobodys["details"]["audit_skipped"]) == ("reward", SKIPPED)
        assert (await balances(s.admin, w))["rewards_pending"] == 7
        await books_balance(app_state)
