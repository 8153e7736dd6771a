"""Withdrawals of claimable rewards, payouts marked paid or rejected by an admin, and the settlement
export."""

from __future__ import annotations

import asyncio
import csv
import datetime as dt
import io
import json
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from orchestrator.audit.models import AuditEntry
from orchestrator.ledger import service as ledger
from orchestrator.ledger.models import LedgerAccount, LedgerTransfer
from orchestrator.ledger.service import ProviderAccount, SystemAccount, provider_account, system_account
from orchestrator.payouts import export
from orchestrator.payouts import service as payouts
from orchestrator.payouts.models import Payout, PayoutRun
from tests.conftest import Contributor, asgi_stream, make_token, new_contributor, postgres_only, problem
from tests.verification_helpers import books_balance
from tests.waits import until_waiting

EXPORT_COLUMNS = [
    "payout_id",
    "provider_id",
    "amount",
    "status",
    "requested_at",
    "paid_at",
    "external_reference",
    "rejected_at",
    "rejection_reason",
    "run_id",
]


async def give_claimable(app_state: Any, provider_id: str, amount: int, key: str = "fund") -> None:
    async with app_state.sessionmaker() as session, session.begin():
        await ledger.transfer(
            session,
            debit=system_account(SystemAccount.rewards),
            credit=provider_account(provider_id, ProviderAccount.rewards_claimable),
            amount=amount,
            key=f"{key}:{provider_id}",
            reason="test",
            actor="test",
        )


async def withdraw(client: httpx.AsyncClient, who: Contributor, amount: Any, key: str) -> httpx.Response:
    return await client.post(
        "/v1/providers/me/withdrawals",
        json={"amount": amount},
        headers={"Idempotency-Key": key},
        auth=who.provider_auth,
    )


async def balances(app_state: Any, provider_id: str) -> dict[str, int]:
    async with app_state.sessionmaker() as session:
        return await ledger.provider_balances(session, provider_id)


async def count(app_state: Any, model: Any, *where: Any) -> int:
    async with app_state.sessionmaker() as session:
        return int(await session.scalar(select(func.count()).select_from(model).where(*where)) or 0)


async def ledger_sum(app_state: Any) -> int:
    async with app_state.sessionmaker() as session:
        return int(await session.scalar(select(func.coalesce(func.sum(LedgerAccount.balance), 0))))


async def mark_paid(
    client: httpx.AsyncClient, headers: dict[str, str], payout_id: int, reference: str
) -> httpx.Response:
    return await client.post(
        f"/v1/admin/payouts/{payout_id}/mark-paid", json={"external_reference": reference}, headers=headers
    )


async def reject(
    client: httpx.AsyncClient, headers: dict[str, str], payout_id: int, reason: Any
) -> httpx.Response:
    return await client.post(
        f"/v1/admin/payouts/{payout_id}/reject", json={"reason": reason}, headers=headers
    )


async def api_balances(client: httpx.AsyncClient, who: Contributor) -> dict[str, int]:
    r = await client.get("/v1/providers/me/balance", auth=who.provider_auth)
    assert r.status_code == 200, r.text
    body: dict[str, int] = r.json()
    return body


async def audit_actions(app_state: Any, payout_id: int) -> list[str]:
    async with app_state.sessionmaker() as session:
        return list(
            (
                await session.scalars(
                    select(AuditEntry.action)
                    .where(AuditEntry.target_type == "payout", AuditEntry.target_id == str(payout_id))
                    .order_by(AuditEntry.id)
                )
            ).all()
        )


def claimable_and_withdrawn(b: dict[str, int]) -> tuple[int, int]:
    return b["rewards_claimable"], b["withdrawn"]


# ------------------------------------------------------------------ withdrawals


async def test_a_withdrawal_moves_claimable_to_withdrawn_and_requests_a_payout(
    client: httpx.AsyncClient, app_state: Any, contributor: Contributor
) -> None:
    pid = contributor.provider_id
    await give_claimable(app_state, pid, 1000)

    r = await withdraw(client, contributor, 300, "withdraw-0001")
    assert r.status_code == 201, r.text
    body = r.json()
    payout = body["payout"]
    assert payout["provider_id"] == pid and payout["amount"] == 300
    assert payout["status"] == "requested"
    assert payout["paid_at"] is None and payout["external_reference"] is None
    assert claimable_and_withdrawn(body["balances"]) == (700, 300)
    assert claimable_and_withdrawn(await balances(app_state, pid)) == (700, 300)

    mine = (await client.get("/v1/providers/me/payouts", auth=contributor.provider_auth)).json()
    assert mine == {"items": [payout], "next_cursor": None}
    async with app_state.sessionmaker() as session:
        t = await session.get(LedgerTransfer, payout["transfer_id"])
    assert t is not None and (t.amount, t.reason) == (300, "withdrawal")
    assert await ledger_sum(app_state) == 0


async def test_a_retried_idempotency_key_returns_the_same_payout_and_moves_money_once(
    client: httpx.AsyncClient, app_state: Any, contributor: Contributor
) -> None:
    pid = contributor.provider_id
    await give_claimable(app_state, pid, 300)
    first = await withdraw(client, contributor, 300, "withdraw-0002")
    assert first.status_code == 201
    # The whole balance is gone, yet the retry is answered with the original, not refused.
    again = await withdraw(client, contributor, 300, "withdraw-0002")
    assert again.status_code == 200, again.text
    assert again.json()["payout"] == first.json()["payout"]
    assert claimable_and_withdrawn(again.json()["balances"]) == (0, 300)
    assert await count(app_state, Payout) == 1
    assert await count(app_state, LedgerTransfer, LedgerTransfer.reason == "withdrawal") == 1


async def test_a_key_reused_with_another_amount_is_refused(
    client: httpx.AsyncClient, app_state: Any, contributor: Contributor
) -> None:
    pid = contributor.provider_id
    await give_claimable(app_state, pid, 1000)
    assert (await withdraw(client, contributor, 100, "withdraw-0003")).status_code == 201
    problem(await withdraw(client, contributor, 200, "withdraw-0003"), 409, "idempotency_key_reused")
    assert claimable_and_withdrawn(await balances(app_state, pid)) == (900, 100)
    assert await count(app_state, Payout) == 1


async def test_withdrawing_more_than_claimable_is_refused_and_changes_nothing(
    client: httpx.AsyncClient, app_state: Any, contributor: Contributor
) -> None:
    pid = contributor.provider_id
    problem(await withdraw(client, contributor, 1, "withdraw-0004"), 409, "insufficient_funds")
    await give_claimable(app_state, pid, 100)
    body = problem(await withdraw(client, contributor, 101, "withdraw-0005"), 409, "insufficient_funds")
    assert body["account"] == "rewards_claimable"
    assert claimable_and_withdrawn(await balances(app_state, pid)) == (100, 0)
    assert await count(app_state, Payout) == 0
    assert await count(app_state, LedgerTransfer, LedgerTransfer.reason == "withdrawal") == 0
    # A refused request does not burn its key.
    assert (await withdraw(client, contributor, 100, "withdraw-0005")).status_code == 201
    assert claimable_and_withdrawn(await balances(app_state, pid)) == (0, 100)


async def test_a_withdrawal_needs_a_signed_provider_a_key_and_a_whole_positive_amount(
    client: httpx.AsyncClient, app_state: Any, contributor: Contributor
) -> None:
    await give_claimable(app_state, contributor.provider_id, 1000)
    r = await client.post("/v1/providers/me/withdrawals", json={"amount": 10}, auth=contributor.provider_auth)
    problem(r, 400, "invalid_header")  # no Idempotency-Key
    for bad_key in ("short", "has space in it", "x" * 101):
        problem(await withdraw(client, contributor, 10, bad_key), 400, "invalid_header")
    for bad in (0, -5, 10**16, 1.5, "10", None):
        problem(await withdraw(client, contributor, bad, "withdraw-0006"), 422, "validation_failed")
    r = await client.post(
        "/v1/providers/me/withdrawals",
        json={"amount": 10, "to": "elsewhere"},
        headers={"Idempotency-Key": "withdraw-0006"},
        auth=contributor.provider_auth,
    )
    problem(r, 422, "validation_failed")
    problem(
        await client.post(
            "/v1/providers/me/withdrawals", json={"amount": 10}, headers={"Idempotency-Key": "withdraw-0006"}
        ),
        401,
        "signature_missing",
    )
    r = await client.post(
        "/v1/providers/me/withdrawals",
        json={"amount": 10},
        headers={"Idempotency-Key": "withdraw-0006"},
        auth=contributor.node_auth,
    )
    problem(r, 401, "unknown_key")
    assert claimable_and_withdrawn(await balances(app_state, contributor.provider_id)) == (1000, 0)


async def test_twenty_concurrent_withdrawals_with_one_key_make_one_payout(
    client: httpx.AsyncClient, app_state: Any, contributor: Contributor
) -> None:
    pid = contributor.provider_id
    await give_claimable(app_state, pid, 1000)
    responses = await asyncio.wait_for(
        asyncio.gather(*(withdraw(client, contributor, 100, "withdraw-same") for _ in range(20))), timeout=60
    )
    assert sorted(r.status_code for r in responses) == [200] * 19 + [201], [r.text for r in responses]
    assert len({r.json()["payout"]["id"] for r in responses}) == 1
    assert await count(app_state, Payout) == 1
    assert await count(app_state, LedgerTransfer, LedgerTransfer.reason == "withdrawal") == 1
    assert claimable_and_withdrawn(await balances(app_state, pid)) == (900, 100)
    assert await ledger_sum(app_state) == 0


async def test_twenty_concurrent_withdrawals_of_10_against_100_claimable_never_overdraw(
    client: httpx.AsyncClient, app_state: Any, contributor: Contributor
) -> None:
    pid = contributor.provider_id
    await give_claimable(app_state, pid, 100)
    responses = await asyncio.wait_for(
        asyncio.gather(*(withdraw(client, contributor, 10, f"withdraw-{i:04}") for i in range(20))),
        timeout=60,
    )
    ok = [r for r in responses if r.status_code == 201]
    refused = [r for r in responses if r.status_code != 201]
    assert len(ok) == 10
    for r in refused:
        problem(r, 409, "insufficient_funds")
    # Each success saw its own step down from 100: the withdrawals went one at a time.
    assert sorted(r.json()["balances"]["rewards_claimable"] for r in ok) == list(range(0, 100, 10))
    assert claimable_and_withdrawn(await balances(app_state, pid)) == (0, 100)
    assert await count(app_state, Payout) == 10
    assert (
        await count(
            app_state, LedgerAccount, LedgerAccount.allow_negative.is_(False), LedgerAccount.balance < 0
        )
        == 0
    )
    assert await ledger_sum(app_state) == 0


async def test_a_withdrawal_transfer_without_its_payout_gets_exactly_one_under_concurrent_retries(
    app_state: Any, contributor: Contributor, clock: Any
) -> None:
    """The payout row is idempotent on its own too (unique transfer): racing retries make one."""
    pid = contributor.provider_id
    await give_claimable(app_state, pid, 100)
    async with app_state.sessionmaker() as session, session.begin():
        await ledger.transfer(
            session,
            debit=provider_account(pid, ProviderAccount.rewards_claimable),
            credit=provider_account(pid, ProviderAccount.withdrawn),
            amount=40,
            key=payouts.ledger_key(pid, "withdraw-orphan"),
            reason="withdrawal",
            actor="test",
        )

    async def attempt() -> tuple[int, bool]:
        async with app_state.sessionmaker() as session, session.begin():
            payout, created = await payouts.request_withdrawal(
                session, pid, 40, "withdraw-orphan", now=clock.utcnow()
            )
            return payout.id, created

    results = await asyncio.wait_for(asyncio.gather(*(attempt() for _ in range(10))), timeout=60)
    assert len({payout_id for payout_id, _ in results}) == 1
    assert sorted(created for _, created in results) == [False] * 9 + [True]
    assert await count(app_state, Payout) == 1
    assert claimable_and_withdrawn(await balances(app_state, pid)) == (60, 40)


# ------------------------------------------------------------------ payouts


async def test_an_admin_marks_a_payout_paid_once(
    client: httpx.AsyncClient, app_state: Any, contributor: Contributor, admin_headers: dict[str, str]
) -> None:
    await give_claimable(app_state, contributor.provider_id, 500)
    payout_id = (await withdraw(client, contributor, 500, "withdraw-0007")).json()["payout"]["id"]
    requested = (await client.get("/v1/admin/payouts?status=requested", headers=admin_headers)).json()
    assert [p["id"] for p in requested["items"]] == [payout_id]

    paid = await mark_paid(client, admin_headers, payout_id, "wire-2026-0001")
    assert paid.status_code == 200, paid.text
    first = paid.json()
    assert first["status"] == "paid" and first["external_reference"] == "wire-2026-0001"
    assert first["paid_at"] is not None and first["paid_by"].startswith("tok_")

    again = await mark_paid(client, admin_headers, payout_id, "wire-2026-0001")
    assert again.status_code == 200 and again.json() == first
    body = problem(
        await mark_paid(client, admin_headers, payout_id, "wire-2026-0002"), 409, "payout_already_paid"
    )
    assert body["external_reference"] == "wire-2026-0001"

    assert (await client.get("/v1/admin/payouts?status=requested", headers=admin_headers)).json()[
        "items"
    ] == []
    mine = (await client.get("/v1/providers/me/payouts", auth=contributor.provider_auth)).json()["items"]
    assert [(p["status"], p["external_reference"]) for p in mine] == [("paid", "wire-2026-0001")]
    assert "paid_by" not in mine[0]
    # Marking paid moves no money: it was withdrawn when requested.
    assert claimable_and_withdrawn(await balances(app_state, contributor.provider_id)) == (0, 500)
    async with app_state.sessionmaker() as session:
        entries = list(
            (
                await session.execute(select(AuditEntry).where(AuditEntry.action == "payout.mark_paid"))
            ).scalars()
        )
    assert len(entries) == 1
    assert (entries[0].actor, entries[0].target_id) == (first["paid_by"], str(payout_id))
    assert entries[0].after is not None and entries[0].after["external_reference"] == "wire-2026-0001"


async def test_two_admins_marking_one_payout_with_different_references_settle_it_once(
    client: httpx.AsyncClient, app_state: Any, contributor: Contributor, admin_headers: dict[str, str]
) -> None:
    await give_claimable(app_state, contributor.provider_id, 10)
    payout_id = (await withdraw(client, contributor, 10, "withdraw-0010")).json()["payout"]["id"]
    other_admin = {"Authorization": f"Bearer {await make_token(app_state, 'admin', 'second')}"}
    a, b = await asyncio.wait_for(
        asyncio.gather(
            mark_paid(client, admin_headers, payout_id, "wire-A"),
            mark_paid(client, other_admin, payout_id, "wire-B"),
        ),
        timeout=60,
    )
    assert sorted([a.status_code, b.status_code]) == [200, 409]
    winner, loser = (a, b) if a.status_code == 200 else (b, a)
    problem(loser, 409, "payout_already_paid")
    listed = (await client.get("/v1/admin/payouts", headers=admin_headers)).json()["items"]
    assert listed == [winner.json()]
    assert await count(app_state, AuditEntry, AuditEntry.action == "payout.mark_paid") == 1


async def test_mark_paid_refuses_unknown_payouts_and_bad_references(
    client: httpx.AsyncClient, app_state: Any, contributor: Contributor, admin_headers: dict[str, str]
) -> None:
    problem(await mark_paid(client, admin_headers, 999999, "wire-1"), 404, "payout_not_found")
    await give_claimable(app_state, contributor.provider_id, 10)
    payout_id = (await withdraw(client, contributor, 10, "withdraw-0008")).json()["payout"]["id"]
    for bad in ("", "x" * 201, "line\nbreak"):
        problem(await mark_paid(client, admin_headers, payout_id, bad), 422, "validation_failed")
    r = await client.post(f"/v1/admin/payouts/{payout_id}/mark-paid", json={}, headers=admin_headers)
    problem(r, 422, "validation_failed")
    listed = (await client.get("/v1/admin/payouts", headers=admin_headers)).json()["items"]
    assert [p["status"] for p in listed] == ["requested"]


async def test_payout_administration_is_for_admins_only(
    client: httpx.AsyncClient, app_state: Any, contributor: Contributor, operator_headers: dict[str, str]
) -> None:
    await give_claimable(app_state, contributor.provider_id, 10)
    payout_id = (await withdraw(client, contributor, 10, "withdraw-0009")).json()["payout"]["id"]
    validator = {"Authorization": f"Bearer {await make_token(app_state, 'validator')}"}
    trainer = {"Authorization": f"Bearer {await make_token(app_state, 'trainer')}"}
    for headers in (operator_headers, validator, trainer):
        problem(await client.get("/v1/admin/payouts", headers=headers), 403, "role_forbidden")
        problem(await client.get("/v1/admin/payouts/export", headers=headers), 403, "role_forbidden")
        problem(await mark_paid(client, headers, payout_id, "wire-1"), 403, "role_forbidden")
        problem(await reject(client, headers, payout_id, "bad destination"), 403, "role_forbidden")
    problem(await client.get("/v1/admin/payouts"), 401, "token_missing")
    r = await client.post(f"/v1/admin/payouts/{payout_id}/reject", json={"reason": "bad destination"})
    problem(r, 401, "token_missing")
    assert claimable_and_withdrawn(await api_balances(client, contributor)) == (0, 10)
    assert await audit_actions(app_state, payout_id) == []
    problem(await client.get("/v1/admin/payouts/export?format=jsonl"), 401, "token_missing")
    mine = (await client.get("/v1/providers/me/payouts", auth=contributor.provider_auth)).json()["items"]
    assert [p["status"] for p in mine] == ["requested"]


async def test_a_provider_sees_only_its_own_payouts_newest_first(
    client: httpx.AsyncClient, app_state: Any, contributor: Contributor, admin_headers: dict[str, str]
) -> None:
    other = new_contributor()
    await other.register(client)
    await give_claimable(app_state, contributor.provider_id, 1000)
    await give_claimable(app_state, other.provider_id, 1000)
    mine = [
        (await withdraw(client, contributor, 10 + i, f"withdraw-{i:04}")).json()["payout"] for i in range(5)
    ]
    # The same client key from another provider is another withdrawal.
    theirs = (await withdraw(client, other, 7, "withdraw-0000")).json()["payout"]
    assert theirs["id"] not in {p["id"] for p in mine}

    seen: list[dict[str, Any]] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = (
            await client.get("/v1/providers/me/payouts", params=params, auth=contributor.provider_auth)
        ).json()
        seen += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == list(reversed(mine))
    theirs_listed = (await client.get("/v1/providers/me/payouts", auth=other.provider_auth)).json()["items"]
    assert theirs_listed == [theirs]
    problem(
        await client.get("/v1/providers/me/payouts?cursor=bogus", auth=contributor.provider_auth),
        400,
        "cursor_invalid",
    )

    everyone = (await client.get("/v1/admin/payouts", headers=admin_headers)).json()["items"]
    assert [p["id"] for p in everyone] == [theirs["id"], *(p["id"] for p in reversed(mine))]
    filtered = await client.get(
        "/v1/admin/payouts", params={"provider_id": other.provider_id}, headers=admin_headers
    )
    assert [p["id"] for p in filtered.json()["items"]] == [theirs["id"]]


# ------------------------------------------------------------------ rejections


async def test_rejecting_a_payout_gives_its_amount_back_to_claimable_once(
    client: httpx.AsyncClient, app_state: Any, contributor: Contributor, admin_headers: dict[str, str]
) -> None:
    await give_claimable(app_state, contributor.provider_id, 1000)
    requested = (await withdraw(client, contributor, 300, "withdraw-0011")).json()["payout"]
    assert claimable_and_withdrawn(await api_balances(client, contributor)) == (700, 300)

    r = await reject(client, admin_headers, requested["id"], "the IBAN does not exist")
    assert r.status_code == 200, r.text
    rejected = r.json()
    assert rejected["status"] == "rejected"
    assert rejected["rejection_reason"] == "the IBAN does not exist"
    assert rejected["rejected_at"] is not None and rejected["rejected_by"].startswith("tok_")
    assert (rejected["paid_at"], rejected["paid_by"], rejected["external_reference"]) == (None, None, None)
    assert {k: rejected[k] for k in ("id", "amount", "transfer_id", "requested_at")} == {
        k: requested[k] for k in ("id", "amount", "transfer_id", "requested_at")
    }
    assert claimable_and_withdrawn(await api_balances(client, contributor)) == (1000, 0)
    await books_balance(app_state)

    # The transfer that gave it back is keyed by the payout and reverses the withdrawal.
    async with app_state.sessionmaker() as session:
        back = await ledger.by_key(session, payouts.reject_key(requested["id"]))
    assert back is not None
    assert (back.amount, back.reason, back.reverses_transfer_id) == (
        300,
        "payout_rejected",
        requested["transfer_id"],
    )
    assert (back.reference_type, back.reference_id) == ("payout", str(requested["id"]))

    # Again (a retry, or another admin with another reason): the same answer, nothing moves.
    for reason in ("the IBAN does not exist", "another reason"):
        again = await reject(client, admin_headers, requested["id"], reason)
        assert again.status_code == 200 and again.json() == rejected
    assert claimable_and_withdrawn(await api_balances(client, contributor)) == (1000, 0)
    assert await count(app_state, LedgerTransfer, LedgerTransfer.reason == "payout_rejected") == 1
    assert await audit_actions(app_state, requested["id"]) == ["payout.reject"]
    async with app_state.sessionmaker() as session:
        entry = (
            await session.execute(select(AuditEntry).where(AuditEntry.action == "payout.reject"))
        ).scalar_one()
    assert (entry.actor, entry.before) == (rejected["rejected_by"], {"status": "requested"})
    assert entry.after == {
        "status": "rejected",
        "reason": "the IBAN does not exist",
        "provider_id": contributor.provider_id,
        "amount": 300,
        "transfer_id": back.id,
    }

    # Both views show it, the provider's without the admin's token id.
    mine = (await client.get("/v1/providers/me/payouts", auth=contributor.provider_auth)).json()["items"]
    assert mine == [{k: v for k, v in rejected.items() if k not in ("paid_by", "rejected_by", "run_id")}]
    listed = (await client.get("/v1/admin/payouts?status=rejected", headers=admin_headers)).json()["items"]
    assert listed == [rejected]
    assert (await client.get("/v1/admin/payouts?status=requested", headers=admin_headers)).json()[
        "items"
    ] == []


async def test_the_money_of_a_rejected_payout_can_be_withdrawn_again(
    client: httpx.AsyncClient, app_state: Any, contributor: Contributor, admin_headers: dict[str, str]
) -> None:
    await give_claimable(app_state, contributor.provider_id, 500)
    first = (await withdraw(client, contributor, 500, "withdraw-0012")).json()["payout"]
    assert (await reject(client, admin_headers, first["id"], "provider asked to cancel")).status_code == 200

    # A retry of the first withdrawal's key is still that (rejected) withdrawal: nothing moves.
    retry = await withdraw(client, contributor, 500, "withdraw-0012")
    assert retry.status_code == 200, retry.text
    assert (retry.json()["payout"]["id"], retry.json()["payout"]["status"]) == (first["id"], "rejected")
    assert claimable_and_withdrawn(retry.json()["balances"]) == (500, 0)

    second = await withdraw(client, contributor, 500, "withdraw-0013")
    assert second.status_code == 201, second.text
    assert claimable_and_withdrawn(second.json()["balances"]) == (0, 500)
    second_id = second.json()["payout"]["id"]
    assert (await mark_paid(client, admin_headers, second_id, "wire-0013")).status_code == 200
    mine = (await client.get("/v1/providers/me/payouts", auth=contributor.provider_auth)).json()["items"]
    assert [(p["id"], p["status"]) for p in mine] == [(second_id, "paid"), (first["id"], "rejected")]
    problem(await withdraw(client, contributor, 1, "withdraw-0014"), 409, "insufficient_funds")
    assert claimable_and_withdrawn(await api_balances(client, contributor)) == (0, 500)
    await books_balance(app_state)


async def test_a_paid_payout_cannot_be_rejected_nor_a_rejected_one_paid(
    client: httpx.AsyncClient, app_state: Any, contributor: Contributor, admin_headers: dict[str, str]
) -> None:
    await give_claimable(app_state, contributor.provider_id, 100)
    paid_id = (await withdraw(client, contributor, 60, "withdraw-0015")).json()["payout"]["id"]
    rejected_id = (await withdraw(client, contributor, 40, "withdraw-0016")).json()["payout"]["id"]
    paid = (await mark_paid(client, admin_headers, paid_id, "wire-0015")).json()
    rejected = (await reject(client, admin_headers, rejected_id, "sanctions hold")).json()

    body = problem(await reject(client, admin_headers, paid_id, "too late"), 409, "payout_already_paid")
    assert body["external_reference"] == "wire-0015"
    body = problem(await mark_paid(client, admin_headers, rejected_id, "wire-0016"), 409, "payout_rejected")
    assert body["rejection_reason"] == "sanctions hold"

    listed = {
        p["id"]: p for p in (await client.get("/v1/admin/payouts", headers=admin_headers)).json()["items"]
    }
    assert listed == {paid_id: paid, rejected_id: rejected}
    assert claimable_and_withdrawn(await api_balances(client, contributor)) == (40, 60)
    assert await audit_actions(app_state, paid_id) == ["payout.mark_paid"]
    assert await audit_actions(app_state, rejected_id) == ["payout.reject"]
    await books_balance(app_state)


async def test_reject_refuses_unknown_payouts_and_bad_reasons(
    client: httpx.AsyncClient, app_state: Any, contributor: Contributor, admin_headers: dict[str, str]
) -> None:
    for unknown in ("999999", "0", "not-a-number", str(2**63)):
        r = await client.post(
            f"/v1/admin/payouts/{unknown}/reject", json={"reason": "no such payout"}, headers=admin_headers
        )
        problem(r, 404, "payout_not_found")
    await give_claimable(app_state, contributor.provider_id, 10)
    payout_id = (await withdraw(client, contributor, 10, "withdraw-0017")).json()["payout"]["id"]
    for bad in ("", "x" * 501, "nul\x00inside", None, 7):
        problem(await reject(client, admin_headers, payout_id, bad), 422, "validation_failed")
    url = f"/v1/admin/payouts/{payout_id}/reject"
    for body in ({}, {"reason": "ok", "refund": True}):
        problem(await client.post(url, json=body, headers=admin_headers), 422, "validation_failed")
    problem(await client.post(url, headers=admin_headers), 422, "validation_failed")
    listed = (await client.get("/v1/admin/payouts", headers=admin_headers)).json()["items"]
    assert [p["status"] for p in listed] == ["requested"]
    assert claimable_and_withdrawn(await api_balances(client, contributor)) == (0, 10)
    assert await audit_actions(app_state, payout_id) == []
    # The longest reason is kept whole.
    r = await reject(client, admin_headers, payout_id, "é" * 500)
    assert r.status_code == 200 and r.json()["rejection_reason"] == "é" * 500


async def _held(app_state: Any, payout_id: int, *requests: Any) -> list[httpx.Response]:
    """Start ``requests`` (one after another, each once the one before waits for the lock)
    while another transaction holds the payout's row lock, so that they all read the payout
    before any of them settles it."""
    async with app_state.sessionmaker() as session, session.begin():
        await session.execute(select(Payout).where(Payout.id == payout_id).with_for_update())
        started = []
        for request in requests:
            started.append(asyncio.create_task(request))
            await until_waiting(app_state, len(started), *started, on="row")
        assert not any(t.done() for t in started)
    return list(await asyncio.wait_for(asyncio.gather(*started), timeout=60))


@postgres_only
@pytest.mark.parametrize("first", ["reject", "mark-paid"])
async def test_a_reject_racing_a_mark_paid_settles_the_payout_one_way(
    client: httpx.AsyncClient,
    app_state: Any,
    contributor: Contributor,
    admin_headers: dict[str, str],
    first: str,
) -> None:
    await give_claimable(app_state, contributor.provider_id, 100)
    payout_id = (await withdraw(client, contributor, 100, "withdraw-0018")).json()["payout"]["id"]
    other_admin = {"Authorization": f"Bearer {await make_token(app_state, 'admin', 'second')}"}
    rejecting = reject(client, admin_headers, payout_id, "bad destination")
    paying = mark_paid(client, other_admin, payout_id, "wire-0018")
    ordered = (rejecting, paying) if first == "reject" else (paying, rejecting)
    responses = await _held(app_state, payout_id, *ordered)
    rejected, paid = responses if first == "reject" else reversed(responses)

    assert sorted([rejected.status_code, paid.status_code]) == [200, 409], [rejected.text, paid.text]
    listed = (await client.get("/v1/admin/payouts", headers=admin_headers)).json()["items"]
    if rejected.status_code == 200:
        problem(paid, 409, "payout_rejected")
        assert listed == [rejected.json()]
        assert claimable_and_withdrawn(await api_balances(client, contributor)) == (100, 0)
        assert await audit_actions(app_state, payout_id) == ["payout.reject"]
    else:
        problem(rejected, 409, "payout_already_paid")
        assert listed == [paid.json()]
        assert claimable_and_withdrawn(await api_balances(client, contributor)) == (0, 100)
        assert await audit_actions(app_state, payout_id) == ["payout.mark_paid"]
    await books_balance(app_state)


@postgres_only
async def test_two_rejects_at_once_give_the_money_back_once_and_are_audited_once(
    client: httpx.AsyncClient, app_state: Any, contributor: Contributor, admin_headers: dict[str, str]
) -> None:
    await give_claimable(app_state, contributor.provider_id, 100)
    payout_id = (await withdraw(client, contributor, 100, "withdraw-0019")).json()["payout"]["id"]
    other_admin = {"Authorization": f"Bearer {await make_token(app_state, 'admin', 'second')}"}
    a, b = await _held(
        app_state,
        payout_id,
        reject(client, admin_headers, payout_id, "bad destination"),
        reject(client, other_admin, payout_id, "sanctions hold"),
    )
    assert (a.status_code, b.status_code) == (200, 200), [a.text, b.text]
    assert a.json() == b.json()
    assert claimable_and_withdrawn(await api_balances(client, contributor)) == (100, 0)
    assert await count(app_state, LedgerTransfer, LedgerTransfer.reason == "payout_rejected") == 1
    assert await audit_actions(app_state, payout_id) == ["payout.reject"]
    await books_balance(app_state)


# ------------------------------------------------------------------ export


async def _settlement_fixture(
    client: httpx.AsyncClient, app_state: Any, admin_headers: dict[str, str], contributor: Contributor
) -> list[dict[str, Any]]:
    """Five payouts from two providers, two of them paid and one rejected; returns the admin view,
    oldest first."""
    other = new_contributor()
    await other.register(client)
    await give_claimable(app_state, contributor.provider_id, 1000)
    await give_claimable(app_state, other.provider_id, 1000)
    for i, who in enumerate((contributor, other, contributor, other, contributor)):
        assert (await withdraw(client, who, 100 + i, f"withdraw-{i:04}")).status_code == 201
    listed = (await client.get("/v1/admin/payouts", headers=admin_headers)).json()["items"]
    oldest_first = list(reversed(listed))
    for p, ref in ((oldest_first[1], 'bank "A", batch 7'), (oldest_first[3], "0xabc=1+2")):
        assert (await mark_paid(client, admin_headers, p["id"], ref)).status_code == 200
    assert (
        await reject(client, admin_headers, oldest_first[2]["id"], 'bad IBAN, "DE00"\n')
    ).status_code == 200
    return list(reversed((await client.get("/v1/admin/payouts", headers=admin_headers)).json()["items"]))


def _expected(p: dict[str, Any]) -> dict[str, Any]:
    return {
        "payout_id": p["id"],
        "provider_id": p["provider_id"],
        "amount": p["amount"],
        "status": p["status"],
        "requested_at": dt.datetime.fromisoformat(p["requested_at"]),
        "paid_at": dt.datetime.fromisoformat(p["paid_at"]) if p["paid_at"] else None,
        "external_reference": p["external_reference"],
        "rejected_at": dt.datetime.fromisoformat(p["rejected_at"]) if p["rejected_at"] else None,
        "rejection_reason": p["rejection_reason"],
        "run_id": p["run_id"],
    }


def _parsed(record: dict[str, Any]) -> dict[str, Any]:
    return {
        **record,
        "payout_id": int(record["payout_id"]),
        "amount": int(record["amount"]),
        "requested_at": dt.datetime.fromisoformat(record["requested_at"]),
        "paid_at": dt.datetime.fromisoformat(record["paid_at"]) if record["paid_at"] else None,
        "external_reference": record["external_reference"] or None,
        "rejected_at": dt.datetime.fromisoformat(record["rejected_at"]) if record["rejected_at"] else None,
        "rejection_reason": record["rejection_reason"] or None,
        "run_id": int(record["run_id"]) if record["run_id"] not in (None, "") else None,
    }


@pytest.mark.parametrize("chunk_size", [2, 500])
async def test_the_csv_export_parses_back_to_the_payouts(
    client: httpx.AsyncClient,
    app_state: Any,
    admin_headers: dict[str, str],
    contributor: Contributor,
    monkeypatch: pytest.MonkeyPatch,
    chunk_size: int,
) -> None:
    monkeypatch.setattr(export, "CHUNK_SIZE", chunk_size)
    payouts = await _settlement_fixture(client, app_state, admin_headers, contributor)

    r = await client.get("/v1/admin/payouts/export?format=csv", headers=admin_headers)
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/csv; charset=utf-8"
    assert r.headers["content-disposition"].startswith('attachment; filename="payouts-all-')
    assert r.headers["content-disposition"].endswith('.csv"')
    reader = csv.DictReader(io.StringIO(r.text, newline=""))
    assert reader.fieldnames == EXPORT_COLUMNS
    assert [_parsed(row) for row in reader] == [_expected(p) for p in payouts]

    paid = await client.get("/v1/admin/payouts/export", params={"status": "paid"}, headers=admin_headers)
    assert 'filename="payouts-paid-' in paid.headers["content-disposition"]
    rows = [_parsed(row) for row in csv.DictReader(io.StringIO(paid.text, newline=""))]
    assert rows == [_expected(p) for p in payouts if p["status"] == "paid"]
    assert [row["external_reference"] for row in rows] == ['bank "A", batch 7', "0xabc=1+2"]

    rejected = await client.get("/v1/admin/payouts/export?status=rejected", headers=admin_headers)
    rows = [_parsed(row) for row in csv.DictReader(io.StringIO(rejected.text, newline=""))]
    assert rows == [_expected(p) for p in payouts if p["status"] == "rejected"]
    assert [row["rejection_reason"] for row in rows] == ['bad IBAN, "DE00"\n']


@pytest.mark.parametrize("chunk_size", [2, 500])
async def test_the_jsonl_export_parses_back_to_the_payouts(
    client: httpx.AsyncClient,
    app_state: Any,
    admin_headers: dict[str, str],
    contributor: Contributor,
    monkeypatch: pytest.MonkeyPatch,
    chunk_size: int,
) -> None:
    monkeypatch.setattr(export, "CHUNK_SIZE", chunk_size)
    payouts = await _settlement_fixture(client, app_state, admin_headers, contributor)

    r = await client.get("/v1/admin/payouts/export?format=jsonl&status=requested", headers=admin_headers)
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/x-ndjson"
    assert r.headers["content-disposition"].startswith('attachment; filename="payouts-requested-')
    assert r.headers["content-disposition"].endswith('.jsonl"')
    assert r.text.endswith("\n")
    records = [json.loads(line) for line in r.text.splitlines()]
    assert all(list(record) == EXPORT_COLUMNS for record in records)
    assert [_parsed(record) for record in records] == [
        _expected(p) for p in payouts if p["status"] == "requested"
    ]
    assert all(isinstance(record["amount"], int) and record["paid_at"] is None for record in records)


async def test_an_export_stops_when_its_admin_token_is_revoked_while_it_streams(
    app: Any,
    client: httpx.AsyncClient,
    app_state: Any,
    admin_headers: dict[str, str],
    contributor: Contributor,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A settlement file kept streaming to an admin token revoked while it was read (a leaked
    token being cut off), every payout's provider and amount; it now breaks off, unfinished."""
    monkeypatch.setattr(export, "CHUNK_SIZE", 1)
    await _settlement_fixture(client, app_state, admin_headers, contributor)
    leaked = await make_token(app_state, "admin", name="leaked")
    [row] = [
        t
        for t in (await client.get("/v1/admin/tokens", headers=admin_headers)).json()["items"]
        if t["name"] == "leaked"
    ]

    async def revoke() -> None:
        r = await client.post(f"/v1/admin/tokens/{row['id']}/revoke", headers=admin_headers)
        assert r.status_code == 200, r.text

    parts, completed = await asgi_stream(app, "/v1/admin/payouts/export?format=jsonl", leaked, revoke)
    assert len(b"".join(parts).splitlines()) == 1  # of five: the chunk sent before the revocation
    assert not completed


async def test_an_empty_export_is_a_header_or_nothing(
    client: httpx.AsyncClient, admin_headers: dict[str, str]
) -> None:
    r = await client.get("/v1/admin/payouts/export?format=csv", headers=admin_headers)
    assert r.status_code == 200 and r.text == ",".join(EXPORT_COLUMNS) + "\r\n"
    r = await client.get("/v1/admin/payouts/export?format=jsonl", headers=admin_headers)
    assert r.status_code == 200 and r.text == ""
    problem(
        await client.get("/v1/admin/payouts/export?format=xlsx", headers=admin_headers),
        400,
        "invalid_query",
    )
    problem(
        await client.get("/v1/admin/payouts/export?status=lost", headers=admin_headers),
        400,
        "invalid_query",
    )


# ------------------------------------------------------------------ payout runs


async def start_run(
    client: httpx.AsyncClient, headers: dict[str, str], key: str | None, **body: Any
) -> httpx.Response:
    return await client.post(
        "/v1/admin/payouts/runs",
        json=body or None,
        headers={**headers, **({"Idempotency-Key": key} if key else {})},
    )


async def test_a_payout_run_takes_the_requested_payouts_that_no_run_holds_once(
    client: httpx.AsyncClient, app_state: Any, admin_headers: dict[str, str], contributor: Contributor
) -> None:
    """The export listed every requested payout each time: two exports before the payouts were
    marked paid listed them twice, and an operator could pay them twice outside. A run takes the
    requested payouts no run holds, and its export lists those alone, however often it is
    downloaded."""
    payouts = await _settlement_fixture(client, app_state, admin_headers, contributor)
    for i in range(3):
        assert (await withdraw(client, contributor, 10 + i, f"withdraw-later-{i}")).status_code == 201
    listed = (await client.get("/v1/admin/payouts?status=requested", headers=admin_headers)).json()
    requested = sorted(listed["items"], key=lambda p: p["id"])
    assert len(requested) == 5 and all(p["run_id"] is None for p in requested)
    before = await api_balances(client, contributor)

    r = await start_run(client, admin_headers, "run-0001", max_payouts=3)
    assert r.status_code == 201, r.text
    first = r.json()
    oldest = requested[:3]
    assert (first["max_payouts"], first["payouts"], first["amount"]) == (
        3,
        3,
        sum(p["amount"] for p in oldest),
    )
    assert first["by_status"] == {"requested": {"payouts": 3, "amount": first["amount"]}}
    assert first["created_by"].startswith("tok_")
    # A retry (the same key and body) is the same run and takes nothing more; another body is refused.
    again = await start_run(client, admin_headers, "run-0001", max_payouts=3)
    assert again.status_code == 200 and again.json() == first
    problem(await start_run(client, admin_headers, "run-0001", max_payouts=2), 409, "idempotency_key_reused")
    in_first = (await client.get(f"/v1/admin/payouts?run_id={first['id']}", headers=admin_headers)).json()
    assert sorted(p["id"] for p in in_first["items"]) == [p["id"] for p in oldest]

    second = (await start_run(client, admin_headers, "run-0002")).json()  # no body: up to 1,000
    assert (second["max_payouts"], second["payouts"]) == (1000, 2)
    problem(await start_run(client, admin_headers, "run-0003"), 409, "nothing_to_settle")
    runs = (await client.get("/v1/admin/payouts/runs", headers=admin_headers)).json()["items"]
    assert [run["id"] for run in runs] == [second["id"], first["id"]]  # no run recorded for run-0003

    # The run's file: its payouts alone, the same on every download, with the run's id.
    url = f"/v1/admin/payouts/export?run_id={first['id']}"
    files = [await client.get(url, headers=admin_headers) for _ in range(2)]
    assert f'filename="payouts-run-{first["id"]}-all-' in files[0].headers["content-disposition"]
    rows = [_parsed(row) for row in csv.DictReader(io.StringIO(files[0].text, newline=""))]
    assert [row["payout_id"] for row in rows] == [p["id"] for p in oldest]
    assert {row["run_id"] for row in rows} == {first["id"]} and files[1].text == files[0].text
    everything = await client.get("/v1/admin/payouts/export", headers=admin_headers)
    ran = [_parsed(row) for row in csv.DictReader(io.StringIO(everything.text, newline=""))]
    assert [row["run_id"] for row in ran if row["status"] != "requested"] == [None] * 3  # settled before

    # Settling the run shows in it: one paid, one rejected, one still to do.
    assert (await mark_paid(client, admin_headers, oldest[0]["id"], "wire-77")).status_code == 200
    assert (await reject(client, admin_headers, oldest[1]["id"], "closed account")).status_code == 200
    now = (await client.get(f"/v1/admin/payouts/runs/{first['id']}", headers=admin_headers)).json()
    assert now["by_status"] == {
        "paid": {"payouts": 1, "amount": oldest[0]["amount"]},
        "rejected": {"payouts": 1, "amount": oldest[1]["amount"]},
        "requested": {"payouts": 1, "amount": oldest[2]["amount"]},
    }
    # A run moves no money: the provider's balances are what its withdrawals and the reject made.
    after = await api_balances(client, contributor)
    assert claimable_and_withdrawn(after) == (
        before["rewards_claimable"]
        + oldest[1]["amount"] * (oldest[1]["provider_id"] == contributor.provider_id),
        before["withdrawn"] - oldest[1]["amount"] * (oldest[1]["provider_id"] == contributor.provider_id),
    )
    async with app_state.sessionmaker() as session:
        entries = (
            await session.scalars(
                select(AuditEntry).where(AuditEntry.action == "payout.run").order_by(AuditEntry.id)
            )
        ).all()
    assert [(e.target_id, e.after["payouts"]) for e in entries] == [
        (str(first["id"]), 3),
        (str(second["id"]), 2),
    ]
    assert payouts  # the fixture's paid and rejected payouts were never taken
    await books_balance(app_state)


async def test_a_payout_run_stops_before_its_total_passes_what_it_can_record(
    client: httpx.AsyncClient,
    app_state: Any,
    admin_headers: dict[str, str],
    contributor: Contributor,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """10,000 payouts of up to 10^15 each could total more than the run's 64-bit amount (a 500
    on PostgreSQL). Here the bound is 25: of payouts of 10, 11 and 12, a run takes the first two
    (21) and leaves the third for the next run."""
    monkeypatch.setattr(payouts, "MAX_RUN_AMOUNT", 25)
    await give_claimable(app_state, contributor.provider_id, 100)
    for amount in (10, 11, 12):
        assert (await withdraw(client, contributor, amount, f"bounded-{amount}")).status_code == 201
    first = (await start_run(client, admin_headers, "bounded-run-1", max_payouts=3)).json()
    assert (first["payouts"], first["amount"]) == (2, 21)
    second = (await start_run(client, admin_headers, "bounded-run-2", max_payouts=3)).json()
    assert (second["payouts"], second["amount"]) == (1, 12)
    problem(await start_run(client, admin_headers, "bounded-run-3"), 409, "nothing_to_settle")


async def test_payout_runs_need_an_admin_and_a_key_and_name_real_runs(
    client: httpx.AsyncClient, app_state: Any, admin_headers: dict[str, str], operator_headers: dict[str, str]
) -> None:
    trainer = {"Authorization": f"Bearer {await make_token(app_state, 'trainer')}"}
    for headers in (operator_headers, trainer):
        problem(await start_run(client, headers, "run-0009"), 403, "role_forbidden")
        problem(await client.get("/v1/admin/payouts/runs", headers=headers), 403, "role_forbidden")
    problem(await start_run(client, admin_headers, None), 400, "invalid_header")
    for bad in (0, 10_001, True, "5", 5.0):  # a count, strict as the amounts are: 5.0 is not one
        problem(await start_run(client, admin_headers, "run-0010", max_payouts=bad), 422, "validation_failed")
    problem(await client.get("/v1/admin/payouts/runs/7", headers=admin_headers), 404, "payout_run_not_found")
    r = await client.get("/v1/admin/payouts/export?run_id=7", headers=admin_headers)
    problem(r, 404, "payout_run_not_found")
    async with app_state.sessionmaker() as session:
        assert await session.scalar(select(func.count()).select_from(PayoutRun)) == 0


@postgres_only
async def test_concurrent_payout_runs_never_take_one_payout_twice(
    client: httpx.AsyncClient, app_state: Any, admin_headers: dict[str, str]
) -> None:
    who = [new_contributor() for _ in range(4)]
    for c in who:
        await c.register(client)
        await give_claimable(app_state, c.provider_id, 1000)
    for i in range(60):  # more than the runs below take in all: each takes its whole count
        assert (await withdraw(client, who[i % 4], 5, f"withdraw-{i:04}")).status_code == 201
    distinct = await asyncio.gather(
        *(start_run(client, admin_headers, f"run-{i:04}", max_payouts=3) for i in range(12))
    )
    same = await asyncio.gather(
        *(start_run(client, admin_headers, "run-same", max_payouts=5) for _ in range(12))
    )
    assert sorted(r.status_code for r in distinct) == [201] * 12, [r.text for r in distinct]
    assert sorted(r.status_code for r in same) == [200] * 11 + [201]
    assert len({r.json()["id"] for r in same}) == 1
    async with app_state.sessionmaker() as session:
        taken = (await session.execute(select(Payout.run_id, func.count()).group_by(Payout.run_id))).all()
        runs = {run.id: run.payouts for run in (await session.scalars(select(PayoutRun))).all()}
    per_run = {run_id: n for run_id, n in taken if run_id is not None}
    assert per_run == runs and len(runs) == 13
    assert sum(runs.values()) == 60 - dict(taken).get(None, 0) == 12 * 3 + 5


async def test_two_idempotency_keys_are_refused_and_move_nothing(
    client: httpx.AsyncClient, app_state: Any, admin_headers: dict[str, str], contributor: Contributor
) -> None:
    """Two Idempotency-Key headers were taken silently, one of them used: the client could not
    know which operation its retries would repeat."""
    await give_claimable(app_state, contributor.provider_id, 100)
    two = [("Idempotency-Key", "withdraw-0001"), ("Idempotency-Key", "withdraw-0002")]
    r = await client.post(
        "/v1/providers/me/withdrawals", json={"amount": 10}, headers=two, auth=contributor.provider_auth
    )
    problem(r, 400, "invalid_header")
    r = await client.post(
        f"/v1/admin/providers/{contributor.provider_id}/deposits",
        json={"amount": 10},
        headers=[*admin_headers.items(), *two],
    )
    problem(r, 400, "invalid_header")
    r = await client.post("/v1/admin/payouts/runs", headers=[*admin_headers.items(), *two])
    problem(r, 400, "invalid_header")
    assert await count(app_state, Payout) == 0
    assert claimable_and_withdrawn(await api_balances(client, contributor)) == (100, 0)
    assert (await balances(app_state, contributor.provider_id))["stake_free"] == 0
