"""Property test: any sequence of ledger operations keeps the books balanced.

A hypothesis state machine runs deposits (with retried and reused keys), locks, unlocks,
unbondings, releases and reversals against the real database and a simple model, and checks
after every step: the sum over all accounts is zero, no account that must not go negative
does, every balance equals its credits minus its debits, and each provider's balances match
the model (so a retry never moves money twice and a refusal never moves any).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.core.db import make_engine, make_sessionmaker
from orchestrator.identity.repository import insert_provider
from orchestrator.ledger import service as ledger
from orchestrator.ledger.models import LedgerAccount, LedgerTransfer
from orchestrator.ledger.service import IdempotencyKeyReused, InsufficientFunds
from orchestrator.settings import DatabaseSettings

T = TypeVar("T")
AMOUNTS = st.integers(min_value=1, max_value=500)
PROVIDERS = st.integers(min_value=0, max_value=1)


class LedgerMachine(RuleBasedStateMachine):
    database_url: str = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.engine = make_engine(DatabaseSettings(url=self.database_url))
        self.sessions = make_sessionmaker(self.engine)
        run = uuid.uuid4().hex[:8]
        self.providers = [f"prop-{run}-{i}".ljust(43, "x") for i in range(2)]
        self.model = {p: {k.value: 0 for k in ledger.ProviderAccount} for p in self.providers}
        self.deposit_keys: dict[str, tuple[str, int]] = {}
        self.transfers: list[int] = []
        self.reversed: set[int] = set()
        self.run = run
        self.counter = 0

    def _run(self, coro: Awaitable[T]) -> T:
        return self.loop.run_until_complete(coro)  # type: ignore[arg-type]

    async def _tx(self, fn: Any) -> Any:
        async with self.sessions() as session, session.begin():
            return await fn(session)

    def _key(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}-{self.run}-{self.counter}"

    @initialize()
    def create_providers(self) -> None:
        async def create(session: AsyncSession) -> None:
            for p in self.providers:
                await insert_provider(session, p, None, None)

        self._run(self._tx(create))

    def _move(self, provider: str, src: str, dst: str, amount: int, op: Any, **kw: Any) -> None:
        key = self._key(op.__name__)
        try:
            result = self._run(self._tx(lambda s: op(s, provider, amount, key=key, actor="prop", **kw)))
        except InsufficientFunds:
            assert self.model[provider][src] < amount
            return
        assert self.model[provider][src] >= amount
        self.model[provider][src] -= amount
        self.model[provider][dst] += amount
        transfer_id = result.transfer.id if hasattr(result, "transfer") else result.start_transfer_id
        self.transfers.append(transfer_id)

    @rule(p=PROVIDERS, amount=AMOUNTS, key=st.integers(min_value=0, max_value=5))
    def deposit(self, p: int, amount: int, key: int) -> None:
        provider = self.providers[p]
        idem = f"dep-{self.run}-{key}"
        try:
            result = self._run(
                self._tx(
                    lambda s: ledger.deposit(s, provider, amount, key=idem, actor="prop", reference=None)
                )
            )
        except IdempotencyKeyReused:
            assert self.deposit_keys[idem] != (provider, amount)
            return
        if idem in self.deposit_keys:
            assert not result.created and self.deposit_keys[idem] == (provider, amount)
            return
        assert result.created
        self.deposit_keys[idem] = (provider, amount)
        self.model[provider]["stake_free"] += amount
        self.transfers.append(result.transfer.id)

    @rule(p=PROVIDERS, amount=AMOUNTS)
    def lock(self, p: int, amount: int) -> None:
        self._move(self.providers[p], "stake_free", "stake_locked", amount, ledger.lock_stake)

    @rule(p=PROVIDERS, amount=AMOUNTS)
    def unlock(self, p: int, amount: int) -> None:
        self._move(self.providers[p], "stake_locked", "stake_free", amount, ledger.unlock_stake)

    @rule(p=PROVIDERS, amount=AMOUNTS, due=st.booleans())
    def unbond(self, p: int, amount: int, due: bool) -> None:
        when = dt.datetime.now(dt.UTC) + (dt.timedelta(seconds=-1) if due else dt.timedelta(days=7))
        self._move(
            self.providers[p],
            "stake_locked",
            "stake_unbonding",
            amount,
            ledger.start_unbonding,
            release_at=when,
        )

    @rule()
    def release(self) -> None:
        now = dt.datetime.now(dt.UTC)

        async def due_amounts(session: AsyncSession) -> dict[str, int]:
            from orchestrator.ledger.models import StakeUnbonding

            rows = (
                await session.execute(
                    select(StakeUnbonding.provider_id, StakeUnbonding.amount).where(
                        StakeUnbonding.released.is_(False),
                        StakeUnbonding.release_at <= now,
                        StakeUnbonding.provider_id.in_(self.providers),
                    )
                )
            ).all()
            out: dict[str, int] = {}
            for provider, amount in rows:
                out[provider] = out.get(provider, 0) + amount
            return out

        expected = self._run(self._tx(due_amounts))
        self._run(self._tx(lambda s: ledger.release_due_unbondings(s, now, limit=10_000)))
        for provider, amount in expected.items():
            self.model[provider]["stake_unbonding"] -= amount
            self.model[provider]["stake_free"] += amount

    @rule(data=st.data())
    def reverse(self, data: st.DataObject) -> None:
        candidates = [t for t in self.transfers if t not in self.reversed]
        if not candidates:
            return
        transfer_id = data.draw(st.sampled_from(candidates))

        async def info(session: AsyncSession) -> tuple[str, str, str, str, int]:
            t = await session.get(LedgerTransfer, transfer_id)
            assert t is not None
            debit = await session.get(LedgerAccount, t.debit_account_id)
            credit = await session.get(LedgerAccount, t.credit_account_id)
            assert debit is not None and credit is not None
            return debit.owner_id, debit.kind, credit.owner_id, credit.kind, t.amount

        d_owner, d_kind, c_owner, c_kind, amount = self._run(self._tx(info))
        if c_kind == "stake_unbonding":
            return  # an unbonding is undone by its release, not by a reversal
        key = self._key("rev")
        try:
            self._run(self._tx(lambda s: ledger.reverse(s, transfer_id, key=key, actor="prop", memo="test")))
        except InsufficientFunds:
            assert c_owner in self.model and self.model[c_owner][c_kind] < amount
            return
        self.reversed.add(transfer_id)
        if c_owner in self.model:
            self.model[c_owner][c_kind] -= amount
        if d_owner in self.model:
            self.model[d_owner][d_kind] += amount

    @invariant()
    def books_balance(self) -> None:
        async def check(session: AsyncSession) -> None:
            total = await session.scalar(select(func.coalesce(func.sum(LedgerAccount.balance), 0)))
            assert total == 0
            negative = await session.scalar(
                select(func.count())
                .select_from(LedgerAccount)
                .where(LedgerAccount.allow_negative.is_(False), LedgerAccount.balance < 0)
            )
            assert negative == 0
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
                assert account.balance == credits.get(account.id, 0) - debits.get(account.id, 0)
            for provider in self.providers:
                assert await ledger.provider_balances(session, provider) == self.model[provider]

        self._run(self._tx(check))

    def teardown(self) -> None:
        self._run(self.engine.dispose())
        self.loop.close()


@pytest.mark.timeout(300)
def test_ledger_invariants_hold_for_any_sequence_of_operations(database_url: str) -> None:
    LedgerMachine.database_url = database_url
    run_state_machine_as_test(
        LedgerMachine,
        settings=settings(
            max_examples=15,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
