"""Which bearer tokens may act on which pool."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.admin.tokens import Principal, Role
from orchestrator.core.errors import NotFound
from orchestrator.pools.models import Pool


def can_act_on(principal: Principal, pool: Pool) -> bool:
    """admin: every pool; operator: the pools it created; trainer, validator: their scoped pools."""
    if principal.role == Role.admin:
        return True
    if principal.role == Role.operator:
        return pool.owner_token_id == principal.token_id
    return principal.scoped_to(pool.id)


async def pool_for(
    session: AsyncSession, principal: Principal, pool_id: str, *, for_update: bool = False
) -> Pool:
    """The pool, or 404 ``pool_not_found`` when it is missing or not this token's (no existence leak).

    ``for_update``: the row is locked and read again. A route has usually loaded the pool already
    (its scope check), and a locking ``get`` of an object in the session would otherwise keep
    the attributes first read: a completion committed while the lock was awaited went unseen.
    The lock is FOR NO KEY UPDATE, as for membership changes: a claim's lease checks its foreign
    key on the pool and must not wait for a policy being published (an enqueue, which holds the
    pool FOR SHARE, still waits)."""
    lock = {"key_share": True} if for_update else False
    pool = await session.get(Pool, pool_id, with_for_update=lock, populate_existing=for_update)
    if pool is None or not can_act_on(principal, pool):
        raise NotFound("no pool with this id", code="pool_not_found")
    return pool
