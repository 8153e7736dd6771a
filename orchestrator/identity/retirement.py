"""An admin retires a provider whose key is lost or stolen, naming a successor for its money.

A provider's id is its Ed25519 public key (PROTOCOL.md), so the key cannot be rotated in place:
a provider that lost it stranded its stake and rewards for good, and a thief who holds it could
withdraw its claimable rewards and register nodes. A retirement, in one transaction:

* records it on the provider (``retired_at``, ``successor_id``, ``retirement_reason``,
  ``retirement_key``, ``retired_by``): every request the key signs is then refused 403
  ``provider_retired`` (its registration included: the key never comes back), and so is a
  node's registration naming it (``identity.auth``, ``identity.service``);
* revokes every node of the provider as the provider's own revocation does
  (``identity.revocation.revoke_locked``: banned for good, ejected from its pools, its leases
  reissued at once, its stake unbonding), audited ``node.revoke`` with the admin as the actor;
* blacklists the successor in every pool that blacklists the provider (an admin's tool must
  not become a way out of a blacklist), ending the successor's memberships there as any
  blacklisting does; the copies are the admin's (an appeal of the verifier's strikes against
  the retired provider's nodes does not lift them: an operator removes them). The blacklists
  are read under the locks (``_lock_in_order``), so a ban committed while the retirement
  waited is copied too; any blacklisting of the provider after the retirement, an operator's
  or the verifier's, in any pool, blacklists its heir there (``pools.service.blacklist_locked``);
* moves what is free now to the successor (``ledger.succession.forward``): free stake, stake
  no membership locks any more, claimable rewards. What is not free yet (rewards on hold,
  stake unbonding) reaches the successor as it matures (``ledger.succession``); a requested
  payout is left for an admin to settle or reject, and a rejected one's amount goes to the
  successor.

Lock order: the two providers' rows in id order, both ``FOR NO KEY UPDATE`` (a retirement of the
successor in flight is waited for, and then refuses this one; and a join, ban or revocation of
one of the successor's nodes, which holds its provider's row ``FOR SHARE`` before the node,
waits for the retirement there holding nothing: with the successor's row only shared, such a
join held the node that the blacklisting copied to the successor ends the membership of, while
it waited for the pool the retirement held, and PostgreSQL aborted one of them), then the
global order (docs/architecture.md, "Lock order"): the pools (by id: every pool the provider
has a membership in, and those that blacklist it), the memberships there of the
provider and the successor (by provider, then id), every account of both at once, the
provider's nodes (by id), then what the ejections and blacklistings lock after (the successor's
nodes, leases).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.admin.tokens import Principal
from orchestrator.audit.models import AuditEntry
from orchestrator.audit.service import record
from orchestrator.core.errors import Conflict, NotFound, UnprocessableEntity
from orchestrator.core.state import AppState
from orchestrator.identity import repository as repo
from orchestrator.identity.models import Node, Provider
from orchestrator.identity.revocation import revoke_locked
from orchestrator.ledger import service as ledger
from orchestrator.ledger import succession
from orchestrator.ledger.service import IdempotencyKeyReused, ProviderAccount, provider_account
from orchestrator.payouts.models import Payout
from orchestrator.pools import repository as pools_repo
from orchestrator.pools import service as pools_service
from orchestrator.pools.models import PoolMembership, PoolProviderBlacklist

ACTION = "provider.retire"


@dataclass(frozen=True)
class Retirement:
    provider: Provider
    after: dict[str, Any]  # what the retirement did, as its audit entry records it
    created: bool


def retired_conflict(provider: Provider) -> Conflict:
    return Conflict(
        "this provider is retired already; its money goes to its successor",
        code="provider_retired",
        extra={
            "retired_at": provider.retired_at.isoformat() if provider.retired_at else None,
            "successor_id": provider.successor_id,
        },
    )


async def retire(
    session: AsyncSession,
    state: AppState,
    provider_id: str,
    successor_id: str,
    reason: str,
    *,
    key: str,
    principal: Principal,
) -> Retirement:
    """Retire ``provider_id`` for ``successor_id`` (see the module). Once per provider: the same
    ``key`` with the same body again is answered as the first call was (``created`` False);
    with another body it is 409 ``idempotency_key_reused``, and another key 409
    ``provider_retired``. Refusals change nothing: 404 ``provider_not_found``; 422
    ``successor_is_provider`` and ``successor_not_found``; 409 ``successor_retired``."""
    if successor_id == provider_id:
        raise UnprocessableEntity(
            "a provider cannot succeed itself: name another registered provider, whose key is safe",
            code="successor_is_provider",
        )
    rows: dict[str, Provider | None] = {}
    for pid in sorted((provider_id, successor_id)):
        rows[pid] = await repo.get_provider(session, pid, for_update=True)
    provider, successor = rows[provider_id], rows[successor_id]
    if provider is None:
        raise NotFound("no provider with this id", code="provider_not_found")
    if provider.retired_at is not None:
        if provider.retirement_key != key:
            raise retired_conflict(provider)
        if (provider.successor_id, provider.retirement_reason) != (successor_id, reason):
            raise IdempotencyKeyReused(
                "this Idempotency-Key retired this provider with another successor or reason",
                extra={"successor_id": provider.successor_id},
            )
        return Retirement(provider, await _recorded(session, provider), created=False)
    if successor is None:
        raise UnprocessableEntity(
            "the successor is not a registered provider: it registers first (POST /v1/providers)",
            code="successor_not_found",
        )
    if successor.retired_at is not None:
        raise Conflict(
            "the successor is retired itself: name its successor, or another provider",
            code="successor_retired",
            extra={"successor_id": successor.successor_id},
        )
    now = state.clock.utcnow()
    nodes, blacklisted = await _lock_in_order(session, provider_id, successor_id)
    said = f"provider retired by an admin: {reason}"
    revoked: dict[str, list[str]] = {}
    for node in nodes:
        if node.revoked_at is None:
            revoked[node.id] = await revoke_locked(
                session, state, node, principal, said=said, reason=said, now=now
            )
    copied = []
    for pool_id in blacklisted:
        pool = await pools_repo.get_pool(session, pool_id, for_update=True)
        assert pool is not None
        _, created = await pools_service.blacklist_locked(
            session,
            principal,
            pool,
            successor_id,
            f"successor of retired provider {provider_id}: {blacklisted[pool_id]}",
            now=now,
        )
        if created:
            copied.append(pool_id)
    moved = await succession.forward(
        session, provider_id, successor_id, succession.FORWARDED, actor=principal.token_id, memo=reason
    )
    balances = await ledger.provider_balances(session, provider_id)
    requested = list(
        (
            await session.execute(
                select(Payout.id)
                .where(Payout.provider_id == provider_id, Payout.status == "requested")
                .order_by(Payout.id)
            )
        ).scalars()
    )
    provider.retired_at = now
    provider.successor_id = successor_id
    provider.retirement_reason = reason
    provider.retirement_key = key
    provider.retired_by = principal.token_id
    await session.flush()
    after = {
        "retired_at": now,
        "successor_id": successor_id,
        "reason": reason,
        "revoked_nodes": revoked,
        "moved": moved,
        "maturing": {
            k.value: balances[k.value]
            for k in (ProviderAccount.rewards_pending, ProviderAccount.stake_unbonding)
        },
        "payouts_requested": requested,
        "blacklists_copied": copied,
    }
    entry = await record(
        session,
        principal,
        ACTION,
        target_type="provider",
        target_id=provider_id,
        before={"retired_at": None, "successor_id": None},
        after=after,
    )
    assert entry.after is not None
    return Retirement(provider, dict(entry.after), created=True)


async def _recorded(session: AsyncSession, provider: Provider) -> dict[str, Any]:
    """What the provider's retirement did, as its audit entry (written in its transaction)
    recorded it; read through the actor's index."""
    entry = (
        await session.execute(
            select(AuditEntry)
            .where(
                AuditEntry.actor == provider.retired_by,
                AuditEntry.action == ACTION,
                AuditEntry.target_type == "provider",
                AuditEntry.target_id == provider.id,
            )
            .order_by(AuditEntry.id.desc())
            .limit(1)
        )
    ).scalar_one()
    return dict(entry.after or {})


async def _nodes_for_update(session: AsyncSession, provider_id: str) -> list[Node]:
    """Every node of the provider, locked in id order and read afresh."""
    stmt = (
        select(Node)
        .where(Node.provider_id == provider_id)
        .order_by(Node.id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    return list((await session.execute(stmt)).scalars())


async def _blacklisting_pools(session: AsyncSession, provider_id: str) -> dict[str, str]:
    """The pools that blacklist the provider, with why, by pool id."""
    rows = await session.execute(
        select(PoolProviderBlacklist.pool_id, PoolProviderBlacklist.reason)
        .where(PoolProviderBlacklist.provider_id == provider_id)
        .order_by(PoolProviderBlacklist.pool_id)
    )
    return {str(p): str(r) for p, r in rows.all()}


async def _pools_of(session: AsyncSession, provider_id: str) -> set[str]:
    """The pools the provider has a membership in (any status: a verdict on a result of a node
    that left since is decided there, and may ban the provider) and those that blacklist it."""
    joined = (
        await session.execute(
            select(PoolMembership.pool_id).where(PoolMembership.provider_id == provider_id).distinct()
        )
    ).scalars()
    return set(joined) | set(await _blacklisting_pools(session, provider_id))


async def _lock_in_order(
    session: AsyncSession, provider_id: str, successor_id: str
) -> tuple[list[Node], dict[str, str]]:
    """After the providers' rows, in the global order: the provider's pools (``_pools_of``, by
    id), the memberships there of the provider and the successor (by provider, then id), every
    account of both at once, then the provider's nodes (by id), as a verifier's ban that ends
    the provider's memberships takes them (pools, memberships, accounts, then the members'
    nodes: ``pools.service._end_memberships``). Returns the nodes, and the pools that blacklist
    the provider, with why, read once everything is locked.

    Taken nodes first, a retirement deadlocked with a verifier's batch that held the pool
    (shared) and was about to ban the provider there: the retirement held the nodes the ban's
    ending of their memberships waited for, and waited for the pool the batch held.

    Under these locks the set cannot grow: an operator's blacklisting of the provider waits for
    its row (``pools.service.blacklist_provider``), a verdict that bans it holds one of its pools,
    a verdict that blacklists it as a retired provider's heir holds its accounts, and a node's
    join holds the node. One that committed between the first read and the locks (a join, or a
    blacklisting of the provider as an heir) is found by the read after them: the locks taken
    since a savepoint are given back (PostgreSQL releases them when it is rolled back) and taken
    again, the new pools with the others in id order."""
    pools: set[str] = set()
    while True:
        savepoint = await session.begin_nested()
        pools |= await _pools_of(session, provider_id)
        for pool_id in sorted(pools):
            await pools_repo.get_pool(session, pool_id, for_update=True)
        if pools:
            await session.execute(
                select(PoolMembership.id)
                .where(
                    PoolMembership.pool_id.in_(pools),
                    PoolMembership.provider_id.in_((provider_id, successor_id)),
                )
                .order_by(PoolMembership.provider_id, PoolMembership.id)
                .with_for_update()
            )
        await ledger.lock_accounts(
            session,
            [
                *(provider_account(provider_id, k) for k in ProviderAccount),
                *(provider_account(successor_id, k) for k in ProviderAccount),
            ],
        )
        nodes = await _nodes_for_update(session, provider_id)
        if await _pools_of(session, provider_id) <= pools:
            await savepoint.commit()
            return nodes, await _blacklisting_pools(session, provider_id)
        await savepoint.rollback()


def provider_detail(provider: Provider) -> dict[str, Any]:
    return {
        "id": provider.id,
        "display_name": provider.display_name,
        "registered_ip": provider.registered_ip,
        "created_at": provider.created_at,
        "retired_at": provider.retired_at,
        "successor_id": provider.successor_id,
        "retirement_reason": provider.retirement_reason,
        "retired_by": provider.retired_by,
    }
