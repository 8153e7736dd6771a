"""Withdrawals and payouts.

A withdrawal is one ledger transfer, ``rewards_claimable -> withdrawn``, keyed by the
provider's ``Idempotency-Key``, plus a payout row naming that transfer. The money is the
ledger's business (its unique key means one transfer per key, even under races); the payout
row is unique per transfer, so a retried or concurrent request finds the same payout instead
of making a second one. An admin then settles the payout off-chain and marks it paid with an
external reference: ``requested -> paid``, once.
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
from orchestrator.ledger.service import ProviderAccount, provider_account
from orchestrator.payouts import repository as repo
from orchestrator.payouts.models import Payout


class PayoutNotFound(NotFound):
    code = "payout_not_found"


class PayoutAlreadyPaid(Conflict):
    code = "payout_already_paid"


def ledger_key(provider_id: str, idempotency_key: str) -> str:
    """The client's key, namespaced so two providers (or a deposit) never share one."""
    return f"withdrawal:{provider_id}:{idempotency_key}"


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
