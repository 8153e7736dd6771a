"""Where a retired provider's money goes: to its successor, now and as it matures.

An admin retires a provider whose key is lost or stolen (``identity.retirement``), naming a
successor. What the provider holds free then moves to the successor at once; what is not free
yet reaches the successor when it matures, in the transaction that matures it:

* a reward on hold released (``verification.service.release_due_rewards``): pending ->
  claimable of the retired provider, then claimable -> the successor's claimable;
* an unbonding completed (``ledger.service.release_due_unbondings``): unbonding -> free stake of
  the retired provider, then free stake -> the successor's free stake;
* a requested payout rejected (``payouts.service.reject``): withdrawn -> claimable of the
  retired provider, then claimable -> the successor's claimable;
* and anything else a retired provider is credited with later (an appeal giving back a
  forfeit or a slash, say) is swept to the successor by the reward release tick
  (``sweep``).

Each move is a ledger transfer of the whole balance of the retired provider's account (which
holds nothing at rest once it is retired), so nothing is left behind and nothing moves twice.
The successor that receives is the heir: the end of the chain of successors (a successor
retired in turn hands on to its own), read again once the accounts are locked. A retirement
locks every account of the provider and of its successor, so a heir read after those locks
cannot change before the transaction ends; a holder that finds the heir changed between its
read and its locks (a retirement committed in between) leaves that provider's money for the
next tick, or (a request) answers 503 ``transient_conflict`` so that it is sent again.
"""

from __future__ import annotations

from collections.abc import Iterable

import structlog
from sqlalchemy import func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.core.errors import ServiceUnavailable
from orchestrator.identity.models import Provider
from orchestrator.ledger import service as ledger
from orchestrator.ledger.heirs import heirs
from orchestrator.ledger.models import LedgerAccount, LedgerTransfer
from orchestrator.ledger.service import AccountRef, ProviderAccount, provider_account

log = structlog.get_logger(__name__)

REASON = "succession"
#: What a retired provider cannot keep, and the successor's account it goes to: its free stake,
#: stake locked by no membership any more (its nodes were all ejected; an appeal's reversed slash
#: of locked stake comes back there), and claimable rewards.
FORWARDED: dict[ProviderAccount, ProviderAccount] = {
    ProviderAccount.stake_free: ProviderAccount.stake_free,
    ProviderAccount.stake_locked: ProviderAccount.stake_free,
    ProviderAccount.rewards_claimable: ProviderAccount.rewards_claimable,
}


async def lock_with_heirs(
    session: AsyncSession,
    refs: Iterable[AccountRef],
    provider_ids: Iterable[str],
    heir_kinds: Iterable[ProviderAccount],
) -> tuple[dict[str, str], set[str]]:
    """``ledger.lock_accounts`` on ``refs`` and, for those of ``provider_ids`` that are retired,
    their heirs' accounts of ``heir_kinds``, in one statement. Returns the heirs read after the
    locks and the providers whose heir changed between the read before and the locks (their
    heir's accounts are not locked: leave their money be)."""
    providers = sorted(set(provider_ids))
    kinds = list(heir_kinds)
    before = await heirs(session, providers)
    heir_refs = [provider_account(h, k) for h in sorted(set(before.values())) for k in kinds]
    await ledger.lock_accounts(session, [*refs, *heir_refs])
    after = await heirs(session, providers)
    return after, {p for p in providers if before.get(p) != after.get(p)}


def heir_changed() -> ServiceUnavailable:
    """A request that found its provider retired (or its heir retired) between its read of the
    heir and its locks: it changed nothing, and is sent again."""
    return ServiceUnavailable(
        "a retirement of this provider (or of its successor) committed while this request was "
        "waiting for its accounts; nothing was recorded. Send the same request again.",
        code="transient_conflict",
        headers={"Retry-After": "1"},
        extra={"cause": "provider_retired"},
    )


async def forward(
    session: AsyncSession,
    provider_id: str,
    heir: str,
    kinds: Iterable[ProviderAccount],
    *,
    actor: str,
    memo: str | None = None,
) -> dict[str, int]:
    """Move the whole balance of each of the retired provider's accounts ``kinds`` (of
    ``FORWARDED``) to its heir's account ``FORWARDED`` names, with the accounts locked by the
    caller. Returns what moved, by kind. Each move's key names the last transfer on the account
    it empties: the same state moves once, whoever sends it again."""
    moved: dict[str, int] = {}
    for kind in kinds:
        source = provider_account(provider_id, kind)
        account = (
            await session.execute(
                select(LedgerAccount.id, LedgerAccount.balance).where(
                    LedgerAccount.owner_type == source.owner_type,
                    LedgerAccount.owner_id == source.owner_id,
                    LedgerAccount.kind == source.kind,
                )
            )
        ).first()
        if account is None or account.balance <= 0:
            continue
        last = await session.scalar(
            select(func.max(LedgerTransfer.id)).where(
                or_(
                    LedgerTransfer.debit_account_id == account.id,
                    LedgerTransfer.credit_account_id == account.id,
                )
            )
        )
        await ledger.transfer_in_parts(
            session,
            debit=source,
            credit=provider_account(heir, FORWARDED[kind]),
            amount=int(account.balance),
            key=f"succession:{provider_id}:{kind.value}:{last}",
            reason=REASON,
            actor=actor,
            memo=memo,
            reference=("provider", heir),
        )
        moved[kind.value] = int(account.balance)
    return moved


async def sweep(session: AsyncSession, *, limit: int = 200) -> int:
    """Forward what retired providers hold in ``FORWARDED`` accounts (credited by a path that
    does not forward itself, such as an appeal), up to ``limit`` of them; returns how many
    providers had something moved. A provider whose heir changed while this locked is left
    for the next call.

    Each provider's money moves in its own savepoint: one that cannot move (its heir's balance
    would pass the ledger's 64-bit bound, say) is logged and left, and the others still move.
    Before, that one refusal rolled back the whole sweep, at every tick, and no retired
    provider's later credit reached its heir."""
    retired = select(Provider.id).where(Provider.retired_at.is_not(None)).scalar_subquery()
    providers = list(
        (
            await session.execute(
                select(LedgerAccount.owner_id)
                .where(
                    LedgerAccount.owner_type == "provider",
                    LedgerAccount.owner_id.in_(retired),
                    LedgerAccount.kind.in_([k.value for k in FORWARDED]),
                    LedgerAccount.balance > 0,
                )
                .group_by(LedgerAccount.owner_id)
                .order_by(LedgerAccount.owner_id)
                .limit(limit)
            )
        ).scalars()
    )
    if not providers:
        return 0
    found, changed = await lock_with_heirs(
        session,
        [provider_account(p, k) for p in providers for k in FORWARDED],
        providers,
        sorted(set(FORWARDED.values())),
    )
    swept = 0
    for provider in providers:
        heir = found.get(provider)
        if heir is None or provider in changed:
            continue
        try:
            async with session.begin_nested():
                moved = await forward(session, provider, heir, FORWARDED, actor="system")
        except Exception:
            log.exception("succession_sweep_failed", provider_id=provider, heir=heir)
            continue
        if moved:
            log.info("succession_swept", provider_id=provider, heir=heir, moved=moved)
            swept += 1
    return swept
