"""The double-entry ledger: idempotent transfers, no negative balances, stake flows, deposits."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, text, update
from sqlalchemy.exc import DBAPIError

from orchestrator.core.clock import FakeClock
from orchestrator.core.keys import generate_key, key_id_of
from orchestrator.ledger import jobs as ledger_jobs
from orchestrator.ledger import service as ledger
from orchestrator.ledger.jobs import release_once
from orchestrator.ledger.models import LedgerAccount, LedgerTransfer, StakeUnbonding
from orchestrator.ledger.service import InsufficientFunds, ProviderAccount
from tests.conftest import Contributor, postgres_only, problem
from tests.waits import taking


async def ledger_sum(app_state: Any) -> int:
    async with app_state.sessionmaker() as session:
        return int(await session.scalar(select(func.coalesce(func.sum(LedgerAccount.balance), 0))))


async def balances(app_state: Any, provider_id: str) -> dict[str, int]:
    async with app_state.sessionmaker() as session:
        return await ledger.provider_balances(session, provider_id)


async def deposit(
    client: httpx.AsyncClient, headers: dict[str, str], provider_id: str, amount: int, key: str
) -> httpx.Response:
    return await client.post(
        f"/v1/admin/providers/{provider_id}/deposits",
        json={"amount": amount, "reference": "wire-123"},
        headers={**headers, "Idempotency-Key": key},
    )


async def test_a_retried_deposit_moves_money_once(
    client: httpx.AsyncClient, admin_headers: dict[str, str], contributor: Contributor, app_state: Any
) -> None:
    first = await deposit(client, admin_headers, contributor.provider_id, 5000, "pay-0001")
    assert first.status_code == 201
    assert first.json()["balances"]["stake_free"] == 5000
    again = await deposit(client, admin_headers, contributor.provider_id, 5000, "pay-0001")
    assert again.status_code == 200
    assert again.json()["transfer"]["id"] == first.json()["transfer"]["id"]
    assert again.json()["balances"]["stake_free"] == 5000
    other = await deposit(client, admin_headers, contributor.provider_id, 700, "pay-0002")
    assert other.json()["balances"]["stake_free"] == 5700
    assert await ledger_sum(app_state) == 0


async def test_a_key_reused_for_a_different_amount_is_refused(
    client: httpx.AsyncClient, admin_headers: dict[str, str], contributor: Contributor
) -> None:
    assert (await deposit(client, admin_headers, contributor.provider_id, 100, "pay-0003")).status_code == 201
    problem(
        await deposit(client, admin_headers, contributor.provider_id, 101, "pay-0003"),
        409,
        "idempotency_key_reused",
    )
    me = await client.get("/v1/providers/me/balance", auth=contributor.provider_auth)
    assert me.json()["stake_free"] == 100


async def test_a_key_reused_for_another_payment_reference_is_refused(
    client: httpx.AsyncClient, admin_headers: dict[str, str], contributor: Contributor
) -> None:
    """Same key, same amount, another wire: a second real payment, which must not be answered
    with the first deposit and dropped."""
    url = f"/v1/admin/providers/{contributor.provider_id}/deposits"
    h = {**admin_headers, "Idempotency-Key": "pay-0007"}
    first = await client.post(url, json={"amount": 5000, "reference": "wire-AAA"}, headers=h)
    assert first.status_code == 201
    body = problem(
        await client.post(url, json={"amount": 5000, "reference": "wire-BBB"}, headers=h),
        409,
        "idempotency_key_reused",
    )
    assert body["transfer_id"] == first.json()["transfer"]["id"]
    problem(await client.post(url, json={"amount": 5000}, headers=h), 409, "idempotency_key_reused")
    again = await client.post(url, json={"amount": 5000, "reference": "wire-AAA"}, headers=h)
    assert again.status_code == 200 and again.json()["transfer"]["id"] == first.json()["transfer"]["id"]
    me = await client.get("/v1/providers/me/balance", auth=contributor.provider_auth)
    assert me.json()["stake_free"] == 5000


async def test_a_deposit_reference_of_the_longest_allowed_length_is_kept(
    client: httpx.AsyncClient, admin_headers: dict[str, str], contributor: Contributor
) -> None:
    """A reference may be 200 characters; one over 100 was written into a 100-character column
    as well and failed on PostgreSQL (500, nothing credited)."""
    url = f"/v1/admin/providers/{contributor.provider_id}/deposits"
    h = {**admin_headers, "Idempotency-Key": "pay-long-ref"}
    wire = "W" * 200
    first = await client.post(url, json={"amount": 300, "reference": wire}, headers=h)
    assert first.status_code == 201, first.text
    assert first.json()["transfer"]["memo"] == wire
    again = await client.post(url, json={"amount": 300, "reference": wire}, headers=h)
    assert again.status_code == 200 and again.json()["transfer"]["id"] == first.json()["transfer"]["id"]
    other = "X" * 199 + "Y"
    problem(
        await client.post(url, json={"amount": 300, "reference": other}, headers=h),
        409,
        "idempotency_key_reused",
    )
    me = await client.get("/v1/providers/me/balance", auth=contributor.provider_auth)
    assert me.json()["stake_free"] == 300


async def test_deposits_need_an_admin_a_key_and_a_known_provider(
    client: httpx.AsyncClient,
    admin_headers: dict[str, str],
    operator_headers: dict[str, str],
    contributor: Contributor,
) -> None:
    problem(
        await deposit(client, operator_headers, contributor.provider_id, 100, "pay-0004"),
        403,
        "role_forbidden",
    )
    r = await client.post(
        f"/v1/admin/providers/{contributor.provider_id}/deposits", json={"amount": 100}, headers=admin_headers
    )
    problem(r, 400, "invalid_header")  # no Idempotency-Key
    problem(
        await deposit(client, admin_headers, key_id_of(generate_key()), 100, "pay-0005"),
        404,
        "provider_not_found",
    )
    for bad in (0, -5, 10**16, 1.5, "100"):
        r = await client.post(
            f"/v1/admin/providers/{contributor.provider_id}/deposits",
            json={"amount": bad},
            headers={**admin_headers, "Idempotency-Key": "pay-0006"},
        )
        problem(r, 422, "validation_failed")
    me = await client.get("/v1/providers/me/balance", auth=contributor.provider_auth)
    assert me.json() == {
        "provider_id": contributor.provider_id,
        "stake_free": 0,
        "stake_locked": 0,
        "stake_unbonding": 0,
        "rewards_pending": 0,
        "rewards_claimable": 0,
        "withdrawn": 0,
    }


async def test_balance_is_only_for_the_signing_provider(
    client: httpx.AsyncClient, contributor: Contributor
) -> None:
    problem(await client.get("/v1/providers/me/balance", auth=contributor.node_auth), 401, "unknown_key")
    problem(await client.get("/v1/providers/me/balance"), 401, "signature_missing")


async def test_insufficient_stake_moves_nothing(app_state: Any, contributor: Contributor) -> None:
    pid = contributor.provider_id
    async with app_state.sessionmaker() as session, session.begin():
        await ledger.deposit(session, pid, 100, key="d1", actor="test", reference=None)
    async with app_state.sessionmaker() as session:
        with pytest.raises(InsufficientFunds):
            async with session.begin():
                await ledger.lock_stake(session, pid, 101, key="lock-too-much", actor="test")
    async with app_state.sessionmaker() as session:
        assert (
            await session.scalar(
                select(func.count())
                .select_from(LedgerTransfer)
                .where(LedgerTransfer.idempotency_key == "lock-too-much")
            )
            == 0
        )
    assert (await balances(app_state, pid))["stake_free"] == 100


async def test_a_caught_insufficient_funds_leaves_no_half_transfer(
    app_state: Any, contributor: Contributor
) -> None:
    """A caller that catches the refusal and carries on commits nothing of the refused transfer."""
    pid = contributor.provider_id
    async with app_state.sessionmaker() as session, session.begin():
        await ledger.deposit(session, pid, 50, key="d2", actor="test", reference=None)
        with pytest.raises(InsufficientFunds):
            await ledger.lock_stake(session, pid, 80, key="lock-80", actor="test")
        await ledger.lock_stake(session, pid, 30, key="lock-30", actor="test")
    assert await balances(app_state, pid) == {
        **{k.value: 0 for k in ProviderAccount},
        "stake_free": 20,
        "stake_locked": 30,
    }
    async with app_state.sessionmaker() as session:
        keys = set((await session.execute(select(LedgerTransfer.idempotency_key))).scalars())
    assert keys == {"d2", "lock-30"}


async def test_reversal_is_a_compensating_transfer(app_state: Any, contributor: Contributor) -> None:
    pid = contributor.provider_id
    async with app_state.sessionmaker() as session, session.begin():
        original = (await ledger.deposit(session, pid, 300, key="d3", actor="test", reference=None)).transfer
        rev = await ledger.reverse(session, original.id, key="rev-d3", actor="admin", memo="wrong provider")
        again = await ledger.reverse(session, original.id, key="rev-d3", actor="admin", memo="wrong provider")
    assert rev.created and not again.created
    assert rev.transfer.reverses_transfer_id == original.id
    assert (await balances(app_state, pid))["stake_free"] == 0
    async with app_state.sessionmaker() as session:
        assert await session.scalar(select(func.count()).select_from(LedgerTransfer)) == 2
    assert await ledger_sum(app_state) == 0


async def test_unbonded_stake_becomes_free_after_the_period_once(
    app_state: Any, contributor: Contributor, clock: FakeClock
) -> None:
    pid = contributor.provider_id
    release_at = clock.utcnow() + dt.timedelta(days=7)
    async with app_state.sessionmaker() as session, session.begin():
        await ledger.deposit(session, pid, 1000, key="d4", actor="test", reference=None)
        await ledger.lock_stake(session, pid, 1000, key="lock-d4", actor="test")
        await ledger.start_unbonding(session, pid, 600, release_at=release_at, key="unbond-1", actor="test")
        await ledger.start_unbonding(session, pid, 600, release_at=release_at, key="unbond-1", actor="test")
    b = await balances(app_state, pid)
    assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (400, 600, 0)

    clock.advance(6 * 86400)
    assert (await release_once(app_state)).released == 0
    clock.advance(86400 + 31)
    reports = await asyncio.gather(release_once(app_state), release_once(app_state))
    assert sorted(r.released for r in reports) == [0, 1]
    b = await balances(app_state, pid)
    assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (400, 0, 600)
    clock.advance(60)
    assert (await release_once(app_state)).released == 0
    assert await ledger_sum(app_state) == 0


async def unbondings_due(
    app_state: Any, pid: str, clock: FakeClock, count: int, *, unreleasable: int = 0
) -> list[int]:
    """1,000 staked and locked, ``count`` unbondings of 100 started, the first ``unreleasable``
    of them (in release order) grown to 10,000, more than the provider's unbonding stake, so
    their transfers fail; then the clock past their day. Their ids, in release order."""
    release_at = clock.utcnow() + dt.timedelta(days=1)
    async with app_state.sessionmaker() as session, session.begin():
        await ledger.deposit(session, pid, 1000, key="d-backlog", actor="test", reference=None)
        await ledger.lock_stake(session, pid, 1000, key="lock-backlog", actor="test")
        for i in range(count):
            await ledger.start_unbonding(session, pid, 100, release_at=release_at, key=f"u{i}", actor="test")
        ids = list(
            await session.scalars(
                select(StakeUnbonding.id).order_by(StakeUnbonding.release_at, StakeUnbonding.id)
            )
        )
        if unreleasable:
            await session.execute(
                update(StakeUnbonding).where(StakeUnbonding.id.in_(ids[:unreleasable])).values(amount=10_000)
            )
    clock.advance(86400 + 31)
    return ids


async def test_one_tick_releases_a_backlog_of_unbondings_larger_than_a_batch(
    app_state: Any, contributor: Contributor, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tick released at most one batch (500), whatever was due: after a large pool completed,
    its members' stake came free at 16 a second, hours past their unbonding period. (Within the
    tick's 30 s budget, on the app's clock, on which the batches take no time here.)"""
    monkeypatch.setattr(ledger_jobs, "RELEASE_BATCH", 3)
    pid = contributor.provider_id
    await unbondings_due(app_state, pid, clock, 7)
    report = await release_once(app_state)
    assert (report.ran, report.released) == (True, 7)
    b = await balances(app_state, pid)
    assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (300, 0, 700)
    assert await ledger_sum(app_state) == 0


async def test_a_stake_release_tick_that_spends_its_budget_stops_and_the_next_goes_on(
    app_state: Any, contributor: Contributor, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tick takes no new batch once its interval (30 s) has gone by; the next tick releases
    what it left. Each batch of three takes 20 s on the app's clock here: two batches a tick."""
    monkeypatch.setattr(ledger_jobs, "RELEASE_BATCH", 3)
    taking(monkeypatch, ledger_jobs, "release_due_unbondings", clock, 20)
    pid = contributor.provider_id
    await unbondings_due(app_state, pid, clock, 7)
    report = await release_once(app_state)
    assert (report.ran, report.released) == (True, 6)
    b = await balances(app_state, pid)
    assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (300, 100, 600)
    report = await release_once(app_state)  # the next tick: the clock has moved 40 s
    assert (report.ran, report.released) == (True, 1)
    b = await balances(app_state, pid)
    assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (300, 0, 700)
    assert await ledger_sum(app_state) == 0


async def test_unbondings_that_cannot_be_released_do_not_hold_up_the_others(
    app_state: Any, contributor: Contributor, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One unbonding whose transfer failed (its provider's unbonding stake holding less than
    it) rolled back its whole batch, tick after tick: no stake came free for anyone. Each is
    released in its own savepoint now, and a batch full of such unbondings at the head of the
    queue does not stop the tick before the ones behind them."""
    monkeypatch.setattr(ledger_jobs, "RELEASE_BATCH", 2)
    pid = contributor.provider_id
    ids = await unbondings_due(app_state, pid, clock, 5, unreleasable=2)
    report = await release_once(app_state)
    assert (report.ran, report.released) == (True, 3)
    b = await balances(app_state, pid)
    assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (500, 200, 300)
    async with app_state.sessionmaker() as session:
        left = await session.scalars(select(StakeUnbonding.id).where(StakeUnbonding.released.is_(False)))
        assert sorted(left) == sorted(ids[:2])
    clock.advance(31)  # the next tick tries them again, and releases nothing twice
    assert (await release_once(app_state)).released == 0
    assert (await balances(app_state, pid))["stake_free"] == 300
    assert await ledger_sum(app_state) == 0


async def test_concurrent_locks_never_overdraw(app_state: Any, contributor: Contributor) -> None:
    """50 concurrent lock attempts against 200 of free stake: exactly 20 of 10 succeed."""
    pid = contributor.provider_id
    async with app_state.sessionmaker() as session, session.begin():
        await ledger.deposit(session, pid, 200, key="d5", actor="test", reference=None)

    async def attempt(i: int) -> bool:
        try:
            async with app_state.sessionmaker() as session, session.begin():
                await ledger.lock_stake(session, pid, 10, key=f"lock-{i}", actor="test")
            return True
        except InsufficientFunds:
            return False

    results = await asyncio.gather(*(attempt(i) for i in range(50)))
    assert sum(results) == 20
    b = await balances(app_state, pid)
    assert (b["stake_free"], b["stake_locked"]) == (0, 200)
    assert await ledger_sum(app_state) == 0


async def test_concurrent_lock_and_unlock_keep_every_balance_non_negative(
    app_state: Any, contributor: Contributor
) -> None:
    pid = contributor.provider_id
    async with app_state.sessionmaker() as session, session.begin():
        await ledger.deposit(session, pid, 100, key="d6", actor="test", reference=None)
        await ledger.lock_stake(session, pid, 50, key="lock-base", actor="test")

    async def attempt(i: int) -> str:
        move = ledger.lock_stake if i % 2 else ledger.unlock_stake
        try:
            async with app_state.sessionmaker() as session, session.begin():
                await move(session, pid, 15, key=f"move-{i}", actor="test")
            return "ok"
        except InsufficientFunds:
            return "refused"

    await asyncio.gather(*(attempt(i) for i in range(50)))
    b = await balances(app_state, pid)
    assert b["stake_free"] >= 0 and b["stake_locked"] >= 0
    assert b["stake_free"] + b["stake_locked"] == 100
    async with app_state.sessionmaker() as session:
        negative = await session.scalar(
            select(func.count())
            .select_from(LedgerAccount)
            .where(LedgerAccount.allow_negative.is_(False), LedgerAccount.balance < 0)
        )
    assert negative == 0
    assert await ledger_sum(app_state) == 0


async def test_the_same_transfer_delivered_32_times_at_once_credits_once(
    app_state: Any, contributor: Contributor
) -> None:
    pid = contributor.provider_id

    async def attempt() -> bool:
        async with app_state.sessionmaker() as session, session.begin():
            return (
                await ledger.deposit(session, pid, 77, key="same-key", actor="test", reference=None)
            ).created

    created = await asyncio.gather(*(attempt() for _ in range(32)))
    assert sum(created) == 1
    assert (await balances(app_state, pid))["stake_free"] == 77
    assert await ledger_sum(app_state) == 0


async def test_balances_equal_the_sum_of_their_transfers(app_state: Any, contributor: Contributor) -> None:
    pid = contributor.provider_id
    async with app_state.sessionmaker() as session, session.begin():
        await ledger.deposit(session, pid, 900, key="d7", actor="test", reference=None)
        await ledger.lock_stake(session, pid, 400, key="l7", actor="test")
        await ledger.unlock_stake(session, pid, 150, key="u7", actor="test")
    await assert_balances_match_transfers(app_state)


async def assert_balances_match_transfers(app_state: Any) -> None:
    async with app_state.sessionmaker() as session:
        credits = dict(
            (
                await session.execute(
                    select(LedgerTransfer.credit_account_id, func.sum(LedgerTransfer.amount)).group_by(
                        LedgerTransfer.credit_account_id
                    )
                )
            ).all()
        )
        debits = dict(
            (
                await session.execute(
                    select(LedgerTransfer.debit_account_id, func.sum(LedgerTransfer.amount)).group_by(
                        LedgerTransfer.debit_account_id
                    )
                )
            ).all()
        )
        for account in (await session.execute(select(LedgerAccount))).scalars():
            assert account.balance == credits.get(account.id, 0) - debits.get(account.id, 0), account.kind


@postgres_only
async def test_transfers_are_append_only_in_the_database(app_state: Any, contributor: Contributor) -> None:
    async with app_state.sessionmaker() as session, session.begin():
        await ledger.deposit(session, contributor.provider_id, 10, key="d8", actor="test", reference=None)
    for stmt in (update(LedgerTransfer).values(amount=1_000_000), text("DELETE FROM ledger_transfers")):
        async with app_state.sessionmaker() as session:
            with pytest.raises(DBAPIError, match="append-only"):
                async with session.begin():
                    await session.execute(stmt)


async def test_negative_balances_are_refused_by_the_database_too(
    app_state: Any, contributor: Contributor
) -> None:
    async with app_state.sessionmaker() as session, session.begin():
        await ledger.deposit(session, contributor.provider_id, 10, key="d9", actor="test", reference=None)
    async with app_state.sessionmaker() as session:
        with pytest.raises(DBAPIError):
            async with session.begin():
                await session.execute(
                    update(LedgerAccount)
                    .where(LedgerAccount.owner_id == contributor.provider_id)
                    .values(balance=-1)
                )


BIGINT_MAX = 2**63 - 1


async def _set_balance(app_state: Any, ref: ledger.AccountRef, balance: int) -> None:
    async with app_state.sessionmaker() as session, session.begin():
        await ledger.account_id(session, ref)
        await session.execute(
            update(LedgerAccount)
            .where(
                LedgerAccount.owner_type == ref.owner_type,
                LedgerAccount.owner_id == ref.owner_id,
                LedgerAccount.kind == ref.kind,
            )
            .values(balance=balance)
        )


async def test_a_transfer_past_the_largest_balance_is_refused_and_moves_nothing(
    client: httpx.AsyncClient, admin_headers: dict[str, str], contributor: Contributor, app_state: Any
) -> None:
    """Balances are 64-bit: a credit (or a system account's debit) past that bound is a precise
    409 that moves nothing, not a 500 (PostgreSQL: bigint out of range) or a balance silently
    turned into a float (SQLite: integer arithmetic that overflows gives a REAL)."""
    pid = contributor.provider_id
    free = ledger.provider_account(pid, ProviderAccount.stake_free)
    deposits = ledger.system_account(ledger.SystemAccount.deposits)
    await _set_balance(app_state, free, BIGINT_MAX - 5)
    await _set_balance(app_state, deposits, -(BIGINT_MAX - 5))
    over = await deposit(client, admin_headers, pid, 10, "pay-over-1")
    problem(over, 409, "balance_limit_exceeded")
    assert (await balances(app_state, pid))["stake_free"] == BIGINT_MAX - 5
    fits = await deposit(client, admin_headers, pid, 5, "pay-fits-1")
    assert fits.status_code == 201, fits.text
    assert fits.json()["balances"]["stake_free"] == BIGINT_MAX
    async with app_state.sessionmaker() as session:
        if app_state.engine.dialect.name == "sqlite":  # no balance turned into a REAL
            types = (await session.execute(select(func.typeof(LedgerAccount.balance)).distinct())).scalars()
            assert set(types) == {"integer"}
        assert await session.scalar(select(func.count()).select_from(LedgerTransfer)) == 1
    assert await ledger_sum(app_state) == 0


async def test_a_system_account_debit_past_the_smallest_balance_is_refused(
    app_state: Any, contributor: Contributor
) -> None:
    pid = contributor.provider_id
    deposits = ledger.system_account(ledger.SystemAccount.deposits)
    await _set_balance(app_state, deposits, -BIGINT_MAX + 3)
    async with app_state.sessionmaker() as session:
        with pytest.raises(ledger.BalanceLimitExceeded):
            async with session.begin():
                await ledger.deposit(session, pid, 4, key="d-under", actor="test", reference=None)
    assert (await balances(app_state, pid))["stake_free"] == 0
    async with app_state.sessionmaker() as session, session.begin():
        await ledger.deposit(session, pid, 3, key="d-fits", actor="test", reference=None)
    assert (await balances(app_state, pid))["stake_free"] == 3
