"""Withdrawals and payouts.

A withdrawal is one ledger transfer, ``rewards_claimable -> withdrawn``, keyed by the
provider's ``Idempotency-Key``, plus a payout row naming that transfer. The money is the
ledger's business (its unique key means one transfer per key, even under races); the payout
row is unique per transfer, so a retried or concurrent request finds the same payout instead
of making a second one. An admin then settles the payout off-chain and marks it paid with an
external reference: ``requested -> paid``, once. Or the admin cannot settle it and rejects it:
``requested -> rejected``, once, with a transfer ``withdrawn -> rewards_claimable`` keyed by the
payout (and reversing its withdrawal transfer, which the ledger lets be reversed once only).

Both settle a payout under its row lock, taken first: a mark-paid and a reject of one payout
queue on it, and the second finds the first's status. A reject then locks the provider's
``withdrawn`` and ``rewards_claimable`` accounts (one transfer); no transaction locks a payout
after a ledger account (a withdrawal inserts its payout and locks none), so this order cannot
deadlock (docs/architecture.md, "Lock order").

A payout run takes requested payouts for settlement together: the oldest that no run holds, up to
a number, once per ``Idempotency-Key``. Its export lists those payouts alone, however often it is
downloaded, and a later run never takes them again, so two settlement files never list one
payout twice. It locks payouts only (``SKIP LOCKED``: a payout being marked paid or rejected, or
taken by another run, is left to that transaction).
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from api_schemas.payouts import PayoutStatus
from orchestrator.admin.tokens import Principal
from orchestrator.audit.service import record
from orchestrator.core.errors import Conflict, NotFound
from orchestrator.ledger import service as ledger
from orchestrator.ledger import succession
from orchestrator.ledger.service import IdempotencyKeyReused, ProviderAccount, provider_account
from orchestrator.payouts import repository as repo
from orchestrator.payouts.models import Payout, PayoutRun


class PayoutNotFound(NotFound):
    code = "payout_not_found"


class PayoutAlreadyPaid(Conflict):
    code = "payout_already_paid"


class PayoutRejected(Conflict):
    code = "payout_rejected"


class PayoutRunNotFound(NotFound):
    code = "payout_run_not_found"


class NothingToSettle(Conflict):
    code = "nothing_to_settle"


def ledger_key(provider_id: str, idempotency_key: str) -> str:
    """The client's key, namespaced so two providers (or a deposit) never share one."""
    return f"withdrawal:{provider_id}:{idempotency_key}"


def reject_key(payout_id: int) -> str:
    """The idempotency key of the transfer that gives a rejected payout's money back: one per payout."""
    return f"payout-reject:{payout_id}"


async def request_withdrawal(
    session: AsyncSession, provider_id: str, amount: int, key: str, *, now: dt.datetime
) -> tuple[Payout, bool]:
    """Move ``amount`` of claimable rewards to withdrawn and record a payout; once per ``key``.

    Returns the payout and whether this call created it. ``InsufficientFunds`` (409) if the
    provider has less claimable; ``IdempotencyKeyReused`` (409) for a known key with another
    amount; both leave everything as it was.
    """
    result = await ledger.transfer(
        session,
        debit=provider_account(provider_id, ProviderAccount.rewards_claimable),
        credit=provider_account(provider_id, ProviderAccount.withdrawn),
        amount=amount,
        key=ledger_key(provider_id, key),
        reason="withdrawal",
        actor=f"provider:{provider_id}",
    )
    transfer = result.transfer
    found = await repo.by_transfer(session, transfer.id)
    if found is not None:
        return found, False
    payout = Payout(
        provider_id=provider_id,
        amount=transfer.amount,
        status=PayoutStatus.requested.value,
        idempotency_key=transfer.idempotency_key,
        transfer_id=transfer.id,
        requested_at=now,
    )
    try:
        async with session.begin_nested():
            session.add(payout)
            await session.flush()  # the unique transfer_id decides a race; the loser reads the winner
    except IntegrityError:
        found = await repo.by_transfer(session, transfer.id)
        if found is None:
            raise
        return found, False
    return payout, True


async def mark_paid(
    session: AsyncSession,
    principal: Principal,
    payout_id: int,
    external_reference: str,
    *,
    now: dt.datetime,
) -> tuple[Payout, bool]:
    """``requested -> paid`` with the settlement's external reference; returns (payout, changed).

    Marking it paid again with the same reference changes nothing; with another reference it
    is refused (``payout_already_paid``), since the payout was settled once already.
    """
    payout = await repo.get(session, payout_id, for_update=True)
    if payout is None:
        raise PayoutNotFound("no payout with this id")
    if payout.status == PayoutStatus.rejected.value:
        raise PayoutRejected(
            "this payout was rejected and its amount given back to the provider; it cannot be paid",
            extra={"payout_id": payout.id, "rejection_reason": payout.rejection_reason},
        )
    if payout.status == PayoutStatus.paid.value:
        if payout.external_reference == external_reference:
            return payout, False
        raise PayoutAlreadyPaid(
            "this payout is already marked paid with another external reference",
            extra={"payout_id": payout.id, "external_reference": payout.external_reference},
        )
    payout.status = PayoutStatus.paid.value
    payout.external_reference = external_reference
    payout.paid_at = now
    payout.paid_by = principal.token_id
    await session.flush()
    await record(
        session,
        principal,
        "payout.mark_paid",
        target_type="payout",
        target_id=str(payout.id),
        before={"status": PayoutStatus.requested.value},
        after={
            "status": payout.status,
            "external_reference": external_reference,
            "provider_id": payout.provider_id,
            "amount": payout.amount,
        },
    )
    return payout, True


async def reject(
    session: AsyncSession,
    principal: Principal,
    payout_id: int,
    reason: str,
    *,
    now: dt.datetime,
) -> tuple[Payout, bool]:
    """``requested -> rejected``, giving the amount back (``withdrawn -> rewards_claimable``);
    returns (payout, changed).

    Rejecting it again changes nothing (whatever the reason: the first is kept); a paid payout
    is refused (``payout_already_paid``), since its money has left. A retired provider's
    amount goes on to its heir's claimable rewards in the same transaction
    (``ledger.succession``); a retirement committed while this locked is 503
    ``transient_conflict`` (nothing changed: send it again).
    """
    payout = await repo.get(session, payout_id, for_update=True)
    if payout is None:
        raise PayoutNotFound("no payout with this id")
    if payout.status == PayoutStatus.rejected.value:
        return payout, False
    if payout.status == PayoutStatus.paid.value:
        raise PayoutAlreadyPaid(
            "this payout is already marked paid; it cannot be rejected",
            extra={"payout_id": payout.id, "external_reference": payout.external_reference},
        )
    provider = payout.provider_id
    claimable = provider_account(provider, ProviderAccount.rewards_claimable)
    heir_of, unsettled = await succession.lock_with_heirs(
        session,
        [provider_account(provider, ProviderAccount.withdrawn), claimable],
        [provider],
        [ProviderAccount.rewards_claimable],
    )
    if unsettled:
        raise succession.heir_changed()
    returned = await ledger.transfer(
        session,
        debit=provider_account(provider, ProviderAccount.withdrawn),
        credit=claimable,
        amount=payout.amount,
        key=reject_key(payout.id),
        reason="payout_rejected",
        actor=principal.token_id,
        memo=reason,
        reference=("payout", str(payout.id)),
        reverses=payout.transfer_id,
    )
    if (heir := heir_of.get(provider)) is not None:
        # The provider was retired: what comes back goes on to its heir (``ledger.succession``).
        await ledger.transfer(
            session,
            debit=claimable,
            credit=provider_account(heir, ProviderAccount.rewards_claimable),
            amount=payout.amount,
            key=f"{reject_key(payout.id)}:succession",
            reason=succession.REASON,
            actor=principal.token_id,
            reference=("payout", str(payout.id)),
        )
    payout.status = PayoutStatus.rejected.value
    payout.rejected_at = now
    payout.rejected_by = principal.token_id
    payout.rejection_reason = reason
    await session.flush()
    await record(
        session,
        principal,
        "payout.reject",
        target_type="payout",
        target_id=str(payout.id),
        before={"status": PayoutStatus.requested.value},
        after={
            "status": payout.status,
            "reason": reason,
            "provider_id": payout.provider_id,
            "amount": payout.amount,
            "transfer_id": returned.transfer.id,
        },
    )
    return payout, True


def _same_run(run: PayoutRun, max_payouts: int) -> PayoutRun:
    if run.max_payouts != max_payouts:
        raise IdempotencyKeyReused(
            "this Idempotency-Key started a payout run with another max_payouts",
            extra={"run_id": run.id, "max_payouts": run.max_payouts},
        )
    return run


# A run's total is a 64-bit column: 10,000 payouts of up to ledger.MAX_AMOUNT each could pass it
# (a 500 on PostgreSQL, an overflow on SQLite). A run stops taking payouts before its total would.
MAX_RUN_AMOUNT = ledger.MAX_BALANCE


def _within_total(taken: list[Payout]) -> list[Payout]:
    """The oldest of ``taken`` whose total stays within ``MAX_RUN_AMOUNT`` (the first always
    does: a payout is at most ledger.MAX_AMOUNT); the rest wait for the next run."""
    total = 0
    for i, payout in enumerate(taken):
        total += payout.amount
        if total > MAX_RUN_AMOUNT:
            return taken[: max(i, 1)]
    return taken


async def start_run(
    session: AsyncSession, principal: Principal, key: str, max_payouts: int, *, now: dt.datetime
) -> tuple[PayoutRun, bool]:
    """Take up to ``max_payouts`` requested payouts that no run holds, oldest first, into a new
    run; returns (run, created). The same key again returns its run and takes nothing more (with
    another ``max_payouts``: ``IdempotencyKeyReused``). With nothing to take, ``NothingToSettle``
    (409), and no run is recorded."""
    found = await repo.run_by_key(session, key)
    if found is not None:
        return _same_run(found, max_payouts), False
    run = PayoutRun(
        idempotency_key=key,
        max_payouts=max_payouts,
        payouts=1,  # set below, once the payouts are taken
        amount=1,
        created_at=now,
        created_by=principal.token_id,
    )
    try:
        async with session.begin_nested():
            session.add(run)
            await session.flush()  # the unique key decides a race; the loser reads the winner
    except IntegrityError:
        found = await repo.run_by_key(session, key)
        if found is None:
            raise
        return _same_run(found, max_payouts), False
    taken = _within_total(await repo.take_for_run(session, limit=max_payouts))
    if not taken:
        raise NothingToSettle("no requested payout is waiting outside a run")
    for payout in taken:
        payout.run_id = run.id
    run.payouts = len(taken)
    run.amount = sum(p.amount for p in taken)
    await session.flush()
    await record(
        session,
        principal,
        "payout.run",
        target_type="payout_run",
        target_id=str(run.id),
        after={
            "payouts": run.payouts,
            "amount": run.amount,
            "first_payout_id": taken[0].id,
            "last_payout_id": taken[-1].id,
        },
    )
    return run, True


async def get_run(session: AsyncSession, run_id: int) -> PayoutRun:
    run = await repo.run(session, run_id)
    if run is None:
        raise PayoutRunNotFound("no payout run with this id")
    return run
