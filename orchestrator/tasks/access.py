"""Which bearer tokens may act on which pool."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.admin.tokens import Principal, Role
from orchestrator.core.errors import NotFound
from orchestrator.pools import repository as pools_repo
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

    ``for_update``: the row is locked and read again, with the lock membership changes take
    (``pools.repository.get_pool``: FOR NO KEY UPDATE, so a claim's lease checking its foreign
    key on the pool does not wait for a policy being published; an enqueue, which holds the
    pool FOR SHARE, still waits). A route has usually loaded the pool already (its scope
    check): read again, a completion committed while the lock was awaited is seen."""
    if for_update:
        pool = await pools_repo.get_pool(session, pool_id, for_update=True)
    else:
        pool = await session.get(Pool, pool_id)
    if pool is None or not can_act_on(principal, pool):
        raise NotFound("no pool with this id", code="pool_not_found")
    return pool
