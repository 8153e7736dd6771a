"""Double-entry transfers with idempotency keys, and the stake flows built on them.

Every movement of money is one ``transfer``: it inserts an append-only row claiming a unique
idempotency key, then debits one account and credits another by the same amount, all inside
one savepoint. So:

* the sum of all balances is always zero (every account starts at zero);
* a retried call with the same key moves nothing and returns the first transfer, even when the
  retry races the original (the key's unique index decides; the loser reads the winner's row);
* the same key with a different debit, credit or amount is refused (``idempotency_key_reused``);
* an account that must not go negative never does: the debit is a conditional UPDATE under row
  locks taken in id order, and a CHECK constraint backs it up in the database.

Lock order: one transfer locks its two accounts in id order within one statement, but a
transaction that makes several transfers must not take its accounts transfer by transfer (two
such transactions would lock the same accounts in different orders across statements and
deadlock). It calls ``lock_accounts`` first, with every account it may touch: missing accounts
are created in key order, then all are locked in id order in one statement; the transfers that
follow find their locks already held. Locks on pools and memberships come before the accounts,
locks on reward holds, tasks and the rest after them (docs/architecture.md, "Lock order").

Account kinds for a provider: stake_free, stake_locked, stake_unbonding, rewards_pending,
rewards_claimable, withdrawn. System accounts (allowed to go negative, they face the outside
world): deposits (off-chain money coming in), rewards (what the pools pay out), slashed.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import structlog
from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.core.errors import Conflict
from orchestrator.core.sql import insert_ignore
from orchestrator.core.ticks import Keyset
from orchestrator.ledger.heirs import heirs
from orchestrator.ledger.models import LedgerAccount, LedgerTransfer, StakeUnbonding

log = structlog.get_logger(__name__)

MAX_AMOUNT = 10**15
# Balances are 64-bit integers (BIGINT). A transfer that would carry one past these bounds is
# refused (``BalanceLimitExceeded``): PostgreSQL would fail the statement (bigint out of range,
# a 500), and SQLite would silently turn the balance into a REAL and round it.
MAX_BALANCE = 2**63 - 1
MIN_BALANCE = -MAX_BALANCE


class ProviderAccount(enum.StrEnum):
    stake_free = "stake_free"
    stake_locked = "stake_locked"
    stake_unbonding = "stake_unbonding"
    rewards_pending = "rewards_pending"
    rewards_claimable = "rewards_claimable"
    withdrawn = "withdrawn"


class SystemAccount(enum.StrEnum):
    deposits = "deposits"
    rewards = "rewards"
    slashed = "slashed"


@dataclass(frozen=True)
class AccountRef:
    owner_type: str
    owner_id: str
    kind: str

    @property
    def allow_negative(self) -> bool:
        return self.owner_type == "system"

    def __str__(self) -> str:
        return f"{self.owner_type}:{self.owner_id}:{self.kind}"


def provider_account(provider_id: str, kind: ProviderAccount) -> AccountRef:
    return AccountRef("provider", provider_id, kind.value)


def system_account(kind: SystemAccount, shard: int = 0) -> AccountRef:
    """The system's account of ``kind``. The verifier's partitions each move money through
    their own (``system/1``, ``system/2``, ...; shard 0 is ``system``), so that concurrent
    batches do not queue on one row; the system's balance of a kind is the sum over shards."""
    return AccountRef("system", "system" if shard == 0 else f"system/{shard}", kind.value)


class InsufficientFunds(Conflict):
    code = "insufficient_funds"


class IdempotencyKeyReused(Conflict):
    code = "idempotency_key_reused"


class BalanceLimitExceeded(Conflict):
    code = "balance_limit_exceeded"


@dataclass(frozen=True)
class TransferResult:
    transfer: LedgerTransfer
    created: bool


async def account_id(session: AsyncSession, ref: AccountRef) -> int:
    """The account's id, creating it (balance 0) if needed."""
    stmt = select(LedgerAccount.id).where(
        LedgerAccount.owner_type == ref.owner_type,
        LedgerAccount.owner_id == ref.owner_id,
        LedgerAccount.kind == ref.kind,
    )
    found = await session.scalar(stmt)
    if found is not None:
        return int(found)
    await insert_ignore(
        session,
        LedgerAccount,
        {
            "owner_type": ref.owner_type,
            "owner_id": ref.owner_id,
            "kind": ref.kind,
            "balance": 0,
            "allow_negative": ref.allow_negative,
        },
    )
    return int((await session.execute(stmt)).scalar_one())


async def lock_accounts(
    session: AsyncSession, refs: Iterable[AccountRef] = (), *, ids: Iterable[int] = ()
) -> dict[AccountRef, int]:
    """Lock the accounts ``refs`` and ``ids`` name (FOR NO KEY UPDATE) until the transaction
    ends, all in one statement in id order: the global order. Missing accounts are created
    first, in key order, before any account is locked. Returns the ids of ``refs``.

    Call it before the first transfer of a transaction that makes several, with every account
    those transfers may touch."""
    wanted_refs = set(refs)
    found = await _existing_ids(session, wanted_refs)
    for ref in sorted(wanted_refs - found.keys(), key=str):
        found[ref] = await account_id(session, ref)
    wanted = sorted({*found.values(), *ids})
    if wanted:
        await session.execute(
            select(LedgerAccount.id)
            .where(LedgerAccount.id.in_(wanted))
            .order_by(LedgerAccount.id)
            .with_for_update(key_share=True)
        )
    return found


async def _existing_ids(session: AsyncSession, refs: set[AccountRef]) -> dict[AccountRef, int]:
    """The ids of those of ``refs`` that exist, in one read (no lock)."""
    if not refs:
        return {}
    columns = (LedgerAccount.owner_type, LedgerAccount.owner_id, LedgerAccount.kind, LedgerAccount.id)
    rows = await session.execute(
        select(*columns).where(
            LedgerAccount.owner_type.in_({r.owner_type for r in refs}),  # the unique index's order
            LedgerAccount.owner_id.in_({r.owner_id for r in refs}),
        )
    )
    found = {AccountRef(t, o, k): int(i) for t, o, k, i in rows.all()}
    return {ref: found[ref] for ref in refs if ref in found}


def stake_accounts(provider_id: str) -> list[AccountRef]:
    """The accounts a membership's stake moves between (lock, unlock, unbond, slash)."""
    kinds = (ProviderAccount.stake_free, ProviderAccount.stake_locked, ProviderAccount.stake_unbonding)
    return [provider_account(provider_id, kind) for kind in kinds]


async def _existing(session: AsyncSession, key: str) -> LedgerTransfer | None:
    return (
        await session.execute(select(LedgerTransfer).where(LedgerTransfer.idempotency_key == key))
    ).scalar_one_or_none()


async def by_key(session: AsyncSession, key: str) -> LedgerTransfer | None:
    """The transfer made with idempotency key ``key``, if any."""
    return await _existing(session, key)


async def account_ref(session: AsyncSession, account_id: int) -> AccountRef:
    """The account with this id, as a reference for ``transfer``."""
    account = await session.get(LedgerAccount, account_id)
    if account is None:
        raise ValueError(f"no account {account_id}")
    return AccountRef(account.owner_type, account.owner_id, account.kind)


def _same(existing: LedgerTransfer, debit_id: int, credit_id: int, amount: int) -> LedgerTransfer:
    if (existing.debit_account_id, existing.credit_account_id, existing.amount) != (
        debit_id,
        credit_id,
        amount,
    ):
        raise IdempotencyKeyReused(
            "this idempotency key was already used for a different transfer",
            extra={"transfer_id": existing.id},
        )
    return existing


async def transfer(
    session: AsyncSession,
    *,
    debit: AccountRef,
    credit: AccountRef,
    amount: int,
    key: str,
    reason: str,
    actor: str,
    memo: str | None = None,
    reference: tuple[str, str] | None = None,
    reverses: int | None = None,
) -> TransferResult:
    """Move ``amount`` from ``debit`` to ``credit`` exactly once per ``key``."""
    if not 0 < amount <= MAX_AMOUNT:
        raise ValueError(f"amount must be in 1..{MAX_AMOUNT}")
    if debit == credit:
        raise ValueError("debit and credit must be different accounts")
    ids = await _existing_ids(session, {debit, credit})  # one read; a missing account is created
    for ref in sorted({debit, credit} - ids.keys(), key=str):
        ids[ref] = await account_id(session, ref)
    debit_id, credit_id = ids[debit], ids[credit]
    existing = await _existing(session, key)
    if existing is not None:
        return TransferResult(_same(existing, debit_id, credit_id, amount), created=False)
    row = LedgerTransfer(
        idempotency_key=key,
        debit_account_id=debit_id,
        credit_account_id=credit_id,
        amount=amount,
        reason=reason,
        memo=memo,
        reference_type=reference[0] if reference else None,
        reference_id=reference[1] if reference else None,
        reverses_transfer_id=reverses,
        actor=actor,
        created_at=dt.datetime.now(dt.UTC),
    )
    try:
        async with session.begin_nested():
            session.add(row)
            await session.flush()  # claims the key; a concurrent twin waits here, then fails
            await session.execute(
                select(LedgerAccount.id)
                .where(LedgerAccount.id.in_([debit_id, credit_id]))
                .order_by(LedgerAccount.id)
                # NO KEY UPDATE: compatible with the KEY SHARE locks that the transfer row's
                # foreign keys take, so two transfers on one account queue instead of deadlocking.
                .with_for_update(key_share=True)
            )
            # The bounds are computed here, not in SQL: the arithmetic must not overflow either.
            debited = await session.execute(
                update(LedgerAccount)
                .where(
                    LedgerAccount.id == debit_id,
                    LedgerAccount.balance >= MIN_BALANCE + amount,
                    or_(LedgerAccount.allow_negative, LedgerAccount.balance >= amount),
                )
                .values(balance=LedgerAccount.balance - amount)
                .returning(LedgerAccount.id)
                .execution_options(synchronize_session=False)
            )
            if debited.scalar_one_or_none() is None:
                if debit.allow_negative:
                    raise _limit(debit, amount)
                raise InsufficientFunds(
                    f"{debit.kind} holds less than {amount}", extra={"account": debit.kind, "needed": amount}
                )
            credited = await session.execute(
                update(LedgerAccount)
                .where(LedgerAccount.id == credit_id, LedgerAccount.balance <= MAX_BALANCE - amount)
                .values(balance=LedgerAccount.balance + amount)
                .returning(LedgerAccount.id)
                .execution_options(synchronize_session=False)
            )
            if credited.scalar_one_or_none() is None:
                raise _limit(credit, amount)
    except IntegrityError:
        existing = await _existing(session, key)
        if existing is None:
            raise
        return TransferResult(_same(existing, debit_id, credit_id, amount), created=False)
    return TransferResult(row, created=True)


def _limit(account: AccountRef, amount: int) -> BalanceLimitExceeded:
    return BalanceLimitExceeded(
        f"moving {amount} would carry the {account.kind} account past the ledger's largest balance "
        f"(+/-{MAX_BALANCE}); nothing moved",
        extra={"account": account.kind, "amount": amount},
    )


async def transfer_in_parts(
    session: AsyncSession,
    *,
    debit: AccountRef,
    credit: AccountRef,
    amount: int,
    key: str,
    reason: str,
    actor: str,
    memo: str | None = None,
    reference: tuple[str, str] | None = None,
) -> list[TransferResult]:
    """Move ``amount``, which may exceed ``MAX_AMOUNT``, in transfers of at most ``MAX_AMOUNT``
    keyed ``key``, ``key:1``, ``key:2``, ... (an amount that fits is one transfer keyed ``key``).
    For sums of several amounts, such as every reward a node still has on hold."""
    if amount <= 0:
        raise ValueError("amount must be positive")
    results: list[TransferResult] = []
    while amount > 0:
        part = min(amount, MAX_AMOUNT)
        results.append(
            await transfer(
                session,
                debit=debit,
                credit=credit,
                amount=part,
                key=key if not results else f"{key}:{len(results)}",
                reason=reason,
                actor=actor,
                memo=memo,
                reference=reference,
            )
        )
        amount -= part
    return results


async def reverse(
    session: AsyncSession, transfer_id: int, *, key: str, actor: str, memo: str
) -> TransferResult:
    """A compensating transfer (credit back to the original debit), never an edit."""
    original = await session.get(LedgerTransfer, transfer_id)
    if original is None:
        raise ValueError(f"no transfer {transfer_id}")
    accounts = {
        a.id: a
        for a in (
            await session.execute(
                select(LedgerAccount).where(
                    LedgerAccount.id.in_([original.debit_account_id, original.credit_account_id])
                )
            )
        ).scalars()
    }
    debit, credit = accounts[original.credit_account_id], accounts[original.debit_account_id]
    return await transfer(
        session,
        debit=AccountRef(debit.owner_type, debit.owner_id, debit.kind),
        credit=AccountRef(credit.owner_type, credit.owner_id, credit.kind),
        amount=original.amount,
        key=key,
        reason=f"reversal:{original.reason}",
        actor=actor,
        memo=memo,
        reference=("transfer", str(original.id)),
        reverses=original.id,
    )


async def balances(session: AsyncSession, owner_type: str, owner_id: str) -> dict[str, int]:
    rows = (
        await session.execute(
            select(LedgerAccount.kind, LedgerAccount.balance).where(
                LedgerAccount.owner_type == owner_type, LedgerAccount.owner_id == owner_id
            )
        )
    ).all()
    return {kind: int(balance) for kind, balance in rows}


async def provider_balances(session: AsyncSession, provider_id: str) -> dict[str, int]:
    found = await balances(session, "provider", provider_id)
    return {kind.value: found.get(kind.value, 0) for kind in ProviderAccount}


# ----------------------------------------------------------------------- stake flows


async def deposit(
    session: AsyncSession, provider_id: str, amount: int, *, key: str, actor: str, reference: str | None
) -> TransferResult:
    """Stake paid in off-chain, credited to the provider's free stake. A retry with the same
    ``key`` returns the first deposit; the same key with another amount or ``reference`` is
    refused (``IdempotencyKeyReused``): it names another payment, which must not be dropped."""
    # The payment reference is free text of up to 200 characters: it is kept as the memo only
    # (``reference_id`` names a record of this service and holds 100; a longer reference written
    # there as well failed the deposit on PostgreSQL).
    result = await transfer(
        session,
        debit=system_account(SystemAccount.deposits),
        credit=provider_account(provider_id, ProviderAccount.stake_free),
        amount=amount,
        key=key,
        reason="deposit",
        actor=actor,
        memo=reference,
    )
    if not result.created and result.transfer.memo != reference:
        raise IdempotencyKeyReused(
            "this idempotency key was already used for a deposit with another reference",
            extra={"transfer_id": result.transfer.id},
        )
    return result


async def lock_stake(
    session: AsyncSession,
    provider_id: str,
    amount: int,
    *,
    key: str,
    actor: str,
    reference: tuple[str, str] | None = None,
) -> TransferResult:
    """Free stake -> locked (a node joins a pool). ``InsufficientFunds`` if there is too little."""
    return await transfer(
        session,
        debit=provider_account(provider_id, ProviderAccount.stake_free),
        credit=provider_account(provider_id, ProviderAccount.stake_locked),
        amount=amount,
        key=key,
        reason="stake_lock",
        actor=actor,
        reference=reference,
    )


async def unlock_stake(
    session: AsyncSession,
    provider_id: str,
    amount: int,
    *,
    key: str,
    actor: str,
    reference: tuple[str, str] | None = None,
) -> TransferResult:
    """Locked stake straight back to free (a join that never became active: rejected, withdrawn)."""
    return await transfer(
        session,
        debit=provider_account(provider_id, ProviderAccount.stake_locked),
        credit=provider_account(provider_id, ProviderAccount.stake_free),
        amount=amount,
        key=key,
        reason="stake_unlock",
        actor=actor,
        reference=reference,
    )


async def start_unbonding(
    session: AsyncSession,
    provider_id: str,
    amount: int,
    *,
    release_at: dt.datetime,
    key: str,
    actor: str,
    reference: tuple[str, str] | None = None,
) -> StakeUnbonding:
    """Locked stake -> unbonding, released to free stake at ``release_at`` by the release job."""
    result = await transfer(
        session,
        debit=provider_account(provider_id, ProviderAccount.stake_locked),
        credit=provider_account(provider_id, ProviderAccount.stake_unbonding),
        amount=amount,
        key=key,
        reason="stake_unbond",
        actor=actor,
        reference=reference,
    )
    found = (
        await session.execute(
            select(StakeUnbonding).where(StakeUnbonding.start_transfer_id == result.transfer.id)
        )
    ).scalar_one_or_none()
    if found is not None:
        return found
    unbonding = StakeUnbonding(
        provider_id=provider_id,
        amount=amount,
        release_at=release_at,
        released=False,
        start_transfer_id=result.transfer.id,
        created_at=dt.datetime.now(dt.UTC),
    )
    session.add(unbonding)
    await session.flush()
    return unbonding


async def slash_unbonding(
    session: AsyncSession,
    start_keys: Sequence[str],
    amount: int,
    *,
    now: dt.datetime,
    credit: AccountRef,
    key: str,
    actor: str,
    memo: str | None = None,
    reference: tuple[str, str] | None = None,
) -> int:
    """Slash up to ``amount`` of the stake still unbonding from the unbondings that the
    transfers keyed ``start_keys`` started (``stake_unbonding -> credit``, one transfer): from
    the first of them, in that order, that is not yet due, and what it lacks from the next, and
    so on. The unbonding period is when stake that left a pool can still be slashed, whatever
    happened since (a membership that left, joined again and ended again has an unbonding per
    episode, every one of them slashable until it is due: looking at its latest episode alone
    let a pending join withdrawn at once, which unbonds nothing, hide the earlier one, and
    taking from one episode only let an earlier slash that had left little of the latest one
    spare the others). Each unbonding keeps the rest, released when due; one slashed wholly is
    marked released (nothing is left to release). Returns the amount slashed: 0 if there is no
    such unbonding, they are due or released, or the release job holds them right now (taken
    ``SKIP LOCKED``: the release job locks unbondings before their accounts, so a caller holding
    the accounts must not wait). Once per ``key``: again, it returns what the first call took
    and changes nothing."""
    if not start_keys:
        return 0
    done = await _existing(session, key)
    if done is not None:
        return done.amount
    order = {k: i for i, k in enumerate(start_keys)}
    starts = (
        await session.execute(
            select(LedgerTransfer.id, LedgerTransfer.idempotency_key).where(
                LedgerTransfer.idempotency_key.in_(list(start_keys))
            )
        )
    ).all()
    if not starts:
        return 0
    rank = {transfer_id: order[k] for transfer_id, k in starts}
    candidates = list(
        (
            await session.execute(
                select(StakeUnbonding)
                .where(
                    StakeUnbonding.start_transfer_id.in_(list(rank)),
                    StakeUnbonding.released.is_(False),
                    StakeUnbonding.release_at > now,
                )
                .order_by(StakeUnbonding.id)
                .with_for_update(skip_locked=True)
                .execution_options(populate_existing=True)
            )
        ).scalars()
    )
    takes: list[tuple[StakeUnbonding, int]] = []
    left = amount
    for unbonding in sorted(candidates, key=lambda u: rank[u.start_transfer_id]):
        if left <= 0:
            break
        take = min(left, unbonding.amount)
        takes.append((unbonding, take))
        left -= take
    total = amount - left
    if total <= 0:
        return 0
    provider_ids = {u.provider_id for u, _ in takes}
    assert len(provider_ids) == 1, "one membership's unbondings are of one provider"
    result = await transfer(
        session,
        debit=provider_account(provider_ids.pop(), ProviderAccount.stake_unbonding),
        credit=credit,
        amount=total,
        key=key,
        reason="slash_stake",
        actor=actor,
        memo=memo,
        reference=reference,
    )
    if result.created:
        for unbonding, take in takes:
            if take == unbonding.amount:
                unbonding.released = True
            else:
                unbonding.amount -= take
        await session.flush()
    return result.transfer.amount


async def release_due_unbondings(
    session: AsyncSession, now: dt.datetime, *, limit: int = 500, keyset: Keyset | None = None
) -> int:
    """Move the unbondings whose time has come back to free stake, up to ``limit`` of them (after
    ``keyset``'s place, which is moved on); returns how many were released. A retired
    provider's goes on to its heir's free stake in the same savepoint (``ledger.succession``);
    one whose provider was retired while this batch locked is left for the next tick.

    Each is released in its own savepoint: one whose transfer fails (its provider's unbonding
    stake holds less than it, say) is logged and left unreleased, and the others are still
    released; before, one such unbonding failed its whole batch, tick after tick, and no stake
    came free for anyone."""
    keyset = keyset or Keyset()
    stmt = (
        select(StakeUnbonding)
        .where(
            StakeUnbonding.released.is_(False),
            StakeUnbonding.release_at <= now,
            keyset.where(StakeUnbonding.release_at, StakeUnbonding.id),
        )
        .order_by(StakeUnbonding.release_at, StakeUnbonding.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    due = list((await session.execute(stmt)).scalars())
    keyset.saw([(u.release_at, u.id) for u in due])
    # A retired provider's stake goes on to its heir (``ledger.succession``): the heirs' free
    # stake is locked with the rest, and read again once it is.
    providers = sorted({u.provider_id for u in due})
    heirs_before = await heirs(session, providers)
    await lock_accounts(
        session,
        [
            *(
                provider_account(p, kind)
                for p in providers
                for kind in (ProviderAccount.stake_unbonding, ProviderAccount.stake_free)
            ),
            *(provider_account(h, ProviderAccount.stake_free) for h in sorted(set(heirs_before.values()))),
        ],
    )
    heir_of = await heirs(session, providers)
    released = 0
    for unbonding, unbonding_id, provider_id in [(u, u.id, u.provider_id) for u in due]:
        heir = heir_of.get(provider_id)
        if heir != heirs_before.get(provider_id):
            continue  # retired while this locked: its heir's stake is not locked; the next tick
        try:
            async with session.begin_nested():
                result = await transfer(
                    session,
                    debit=provider_account(provider_id, ProviderAccount.stake_unbonding),
                    credit=provider_account(provider_id, ProviderAccount.stake_free),
                    amount=unbonding.amount,
                    key=f"unbonding-release:{unbonding_id}",
                    reason="stake_release",
                    actor="system",
                    reference=("unbonding", str(unbonding_id)),
                )
                if heir is not None:
                    await transfer(
                        session,
                        debit=provider_account(provider_id, ProviderAccount.stake_free),
                        credit=provider_account(heir, ProviderAccount.stake_free),
                        amount=unbonding.amount,
                        key=f"unbonding-release:{unbonding_id}:succession",
                        reason="succession",
                        actor="system",
                        reference=("unbonding", str(unbonding_id)),
                    )
                unbonding.released = True
                unbonding.release_transfer_id = result.transfer.id
                await session.flush()  # in the savepoint: a failure rolls back the transfer with it
        except Exception:  # a rolled-back savepoint expires the row: log with what was read
            log.exception("stake_release_failed", unbonding_id=unbonding_id, provider_id=provider_id)
            continue
        released += 1
    return released
