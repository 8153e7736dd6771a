"""Helpers for the verification tests: controlled audit draws, result bodies, balances."""

from __future__ import annotations

import asyncio
import datetime as dt
import random
from typing import Any

from sqlalchemy import func, select

from orchestrator.ledger.models import LedgerAccount
from orchestrator.tasks.models import Submission
from orchestrator.verification import service as verification
from orchestrator.verification.jobs import drain
from orchestrator.verification.models import VerificationJob


class FixedDraw(random.Random):
    """An audit random source that always draws ``value`` (1.0: never audit; 0.0: always)."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


def answer_body(lease: dict[str, Any], answers: list[str], **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "fencing_token": lease["fencing_token"],
        "policy_step": lease["policy"]["step"],
        "seed": lease["seed"],
        "samples": [
            {
                "completion": f"Let me think.\n{a}",
                "finish_reason": "stop",
                "prompt_tokens": 10,
                "completion_tokens": 5,
            }
            for a in answers
        ],
    }
    body.update(overrides)
    return body


async def submit(worker: Any, lease: dict[str, Any], answers: list[str], **overrides: Any) -> Any:
    r = await worker.client.post(
        f"/v1/assignments/{lease['assignment_id']}/result",
        json=answer_body(lease, answers, **overrides),
        auth=worker.contributor.node_auth,
    )
    assert r.status_code == 201, r.text
    return r.json()


async def verify_all(app_state: Any) -> int:
    return await drain(app_state)


async def balances(client: Any, worker: Any) -> dict[str, int]:
    """Through the admin view, which needs no signature (the tests move the server's clock)."""
    from orchestrator.core.state import AppState

    state: AppState = client._transport.app.state.orch
    from tests.conftest import make_token

    token = await make_token(state, "admin", name="balance-reader")
    r = await client.get(
        f"/v1/admin/providers/{worker.contributor.provider_id}/balance",
        headers={"Authorization": f"Bearer {token}"},
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


async def books_balance(app_state: Any) -> None:
    async with app_state.sessionmaker() as session:
        total = await session.scalar(select(func.coalesce(func.sum(LedgerAccount.balance), 0)))
        negative = await session.scalar(
            select(func.count())
            .select_from(LedgerAccount)
            .where(LedgerAccount.allow_negative.is_(False), LedgerAccount.balance < 0)
        )
    assert total == 0
    assert negative == 0


async def books_sound(app_state: Any) -> None:
    """The ledger balances and every provider's pending rewards match its holds
    (``books_balance``, ``pending_matches_holds``)."""
    await pending_matches_holds(app_state)
    await books_balance(app_state)


async def pending_matches_holds(app_state: Any) -> None:
    """Every provider's rewards_pending is exactly the provider's part of its rewards on hold:
    what the release loop will move, no more and no less (no money stuck, none missing)."""
    from orchestrator.verification.models import RewardHold

    async with app_state.sessionmaker() as session:
        pending = dict(
            (
                await session.execute(
                    select(LedgerAccount.owner_id, LedgerAccount.balance).where(
                        LedgerAccount.owner_type == "provider", LedgerAccount.kind == "rewards_pending"
                    )
                )
            ).all()
        )
        held = dict(
            (
                await session.execute(
                    select(RewardHold.provider_id, func.sum(RewardHold.amount - RewardHold.forfeited_amount))
                    .where(RewardHold.status == "held")
                    .group_by(RewardHold.provider_id)
                )
            ).all()
        )
    assert {p: int(b) for p, b in pending.items() if b} == {p: int(b) for p, b in held.items() if b}


async def verdicts(admin: Any, headers: dict[str, str], pool_id: str) -> list[dict[str, Any]]:
    r = await admin.get(f"/v1/admin/pools/{pool_id}/verdicts", headers=headers)
    assert r.status_code == 200, r.text
    return list(reversed(r.json()["items"]))


async def track_record(s: Any, worker: Any) -> dict[str, int]:
    """The worker's node's track record in the pool, as the operator's member list shows it."""
    r = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/members", headers=s.headers)
    assert r.status_code == 200, r.text
    [member] = [m for m in r.json()["items"] if m["node_id"] == worker.node_id]
    return dict(member["track_record"])


async def accept_in_transaction(
    app_state: Any,
    submission_id: int,
    decided: asyncio.Event | None = None,
    release: asyncio.Event | None = None,
    *,
    samples: int = 1,
    now: dt.datetime | None = None,
) -> None:
    """Accept a result (``samples`` right samples) in a transaction of its own, as a verifier
    batch does: its verdict dated ``now`` (the app's clock by default: when the batch started),
    ``decided`` set once it is written, and the transaction held open until ``release`` is set."""
    async with app_state.sessionmaker() as session, session.begin():
        job = (
            await session.execute(
                select(VerificationJob).where(VerificationJob.submission_id == submission_id)
            )
        ).scalar_one()
        submission = await session.get(Submission, submission_id)
        assert submission is not None
        details = {"per_sample_rewards": [1.0] * samples}
        decision = verification.Decision(
            "accepted", "valid", "verified", "test", details, paid_samples=samples
        )
        await verification.decide(session, job, submission, decision, now=now or app_state.clock.utcnow())
        if decided is not None:
            decided.set()
        if release is not None:
            await release.wait()
