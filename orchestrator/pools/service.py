"""Rules for pools: lifecycle, settings, membership, invites, blacklists, operator scoping.

Lifecycle (anything else is 409 ``pool_transition_invalid``; asking for the state a pool is
already in changes nothing)::

    pending --activate--> active --pause--> paused --complete--> completed
                            ^                  |
                            +-----resume-------+

The system pauses an active pool whose verdicts have credited its ``reward_budget``
(``pause_spent_pools``, from the ``reward_budget`` loop; ``status_reason`` ``budget_spent``,
cleared by the next change of status), and a resume or activation while the budget is spent is
409 ``budget_spent``. A completed pool is read-only (409 ``pool_completed``); completing it ends every live
membership and cancels every open task (``end_reason`` ``pool_completed``); results already in
are still verified and paid. Memberships (one row per pool and node)::

    (none) / left / rejected --join--> active (open, invite) or pending (approval)
    pending --approve--> active          pending --reject--> rejected   (stake back at once)
    active  --leave / blacklist / complete--> left                       (stake unbonds)
    pending --leave / blacklist / complete--> left                       (stake back at once)
    any     --eject--> ejected           (unbonds if active, back at once if pending; no rejoin)
    ejected --unban / appeal--> left     (a ban's ejection / the verifier's, see ``ejected_by``)

An admin ban of a node ejects it from every pool it is a live member of (``eject_node``).
``ejected_by`` records who ejected a membership: ``ban`` (lifted by an unban: the membership
becomes ``left``), ``verifier`` (lifted the same way by an appeal that brings the node's strikes
below the pool's limit again, ``lift_fraud_ejection``) or ``operator`` (final). An operator's or
the verifier's ejection of a membership a ban ejected makes it theirs, and an operator's of one
the verifier ejected makes it the operator's.

Money: a join locks ``min_stake_per_node`` from the provider's free stake; the amount is kept
on the membership, so later changes to the pool's minimum never unlock more or less than was
locked. Every ledger call carries a key derived from the membership id and its episode, so a
retry never moves money twice.

Concurrency: every membership change first locks the pool row (``SELECT ... FOR NO KEY
UPDATE`` on PostgreSQL; SQLite has one writer), so the cap counts a join reads cannot change
before it commits, and locks are always taken in the order pool -> membership -> ledger
accounts -> the node's row (taken when its leases are given back, to exclude a concurrent
claim). A change that ends several memberships locks all their stake accounts up front
(``ledger.lock_accounts``) before the first transfer. A join and a ban lock the node's row
first (so a join never commits a membership that a concurrent ban did not see), after only the
provider's row (``FOR SHARE``: a retirement in flight is waited for); a ban or a
join racing a leave or an ejection of the same node can deadlock, which PostgreSQL resolves by
refusing one of them (503 ``transient_conflict``, nothing recorded).

Scoping: an operator administers the pools its token created, an admin every pool; a pool
the caller may not administer is reported exactly like a missing one (404 ``pool_not_found``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession

from api_schemas.pools import (
    STORED,
    Admission,
    Caps,
    Economics,
    MemberOut,
    MembershipOut,
    MembershipStatus,
    Policy,
    PoolOut,
    PoolPatch,
    PoolSettings,
    PoolStatus,
    PublicPolicy,
    PublicPoolOut,
    Requirements,
    TrackRecordOut,
)
from orchestrator.admin.tokens import Principal, Role
from orchestrator.audit.service import Actor, record
from orchestrator.core.errors import Conflict, Forbidden, NotFound, UnprocessableEntity
from orchestrator.core.sql import is_postgres
from orchestrator.identity import repository as identity_repo
from orchestrator.identity.models import Node, NodeStatus
from orchestrator.identity.service import banned_node_of
from orchestrator.ledger import service as ledger
from orchestrator.ledger.heirs import heirs
from orchestrator.pools import repository as repo
from orchestrator.pools.models import BUDGET_SPENT, Pool, PoolInvite, PoolMembership, PoolProviderBlacklist
from orchestrator.pools.requirements import unmet_requirements

LIVE = frozenset({MembershipStatus.active.value, MembershipStatus.pending.value})
CAPS = tuple(Caps.model_fields)
ECONOMICS = tuple(Economics.model_fields)
POLICY = tuple(Policy.model_fields)

# action -> (statuses it may start from, status it leads to)
TRANSITIONS: dict[str, tuple[frozenset[str], str]] = {
    "activate": (frozenset({PoolStatus.pending.value}), PoolStatus.active.value),
    "pause": (frozenset({PoolStatus.active.value}), PoolStatus.paused.value),
    "resume": (frozenset({PoolStatus.paused.value}), PoolStatus.active.value),
    "complete": (frozenset({PoolStatus.paused.value}), PoolStatus.completed.value),
}


def new_pool_id() -> str:
    return "pool_" + secrets.token_hex(8)


def hash_invite_code(code: str) -> str:
    return hashlib.sha256(code.encode("utf-8")).hexdigest()


# ------------------------------------------------------------------ views


def pool_settings(pool: Pool) -> PoolSettings:
    """The pool's stored settings. They were validated when written; bounds added since (a pool
    stored before ``reward_per_sample`` was capped may pay more) are not checked again here, so
    every view of the pool, its lifecycle actions and the PATCH that brings it within them keep
    working; ``update_pool`` validates the merged settings whole."""
    return PoolSettings(
        name=pool.name,
        description=pool.description,
        admission=Admission(pool.admission),
        requirements=Requirements.model_validate(pool.requirements),
        caps=Caps.model_validate({name: getattr(pool, name) for name in CAPS}),
        economics=Economics.model_construct(**{name: getattr(pool, name) for name in ECONOMICS}),
        policy=Policy.model_validate({name: getattr(pool, name) for name in POLICY}, context=STORED),
    )


def _apply_settings(pool: Pool, settings: PoolSettings) -> None:
    pool.name = settings.name
    pool.description = settings.description
    pool.admission = settings.admission.value
    pool.requirements = settings.requirements.model_dump(mode="json")
    for group, names in ((settings.caps, CAPS), (settings.economics, ECONOMICS), (settings.policy, POLICY)):
        for name in names:
            setattr(pool, name, getattr(group, name))


def _public_fields(pool: Pool, counts: dict[str, int]) -> dict[str, Any]:
    settings = pool_settings(pool)
    return {
        "id": pool.id,
        "name": settings.name,
        "description": settings.description,
        "status": PoolStatus(pool.status),
        "admission": settings.admission,
        "requirements": settings.requirements,
        "caps": settings.caps,
        "economics": settings.economics,
        "policy": settings.policy,
        "members": sum(counts.values()),
        "created_at": pool.created_at,
    }


async def public_pool_views(session: AsyncSession, pools: list[Pool]) -> list[PublicPoolOut]:
    counts = await repo.member_counts(session, [p.id for p in pools])
    views = []
    for p in pools:
        fields = _public_fields(p, counts[p.id])
        public = fields["policy"].model_dump(include=set(PublicPolicy.model_fields))
        fields["policy"] = PublicPolicy.model_validate(public, context=STORED)
        views.append(PublicPoolOut(**fields))
    return views


async def pool_views(session: AsyncSession, pools: list[Pool]) -> list[PoolOut]:
    counts = await repo.member_counts(session, [p.id for p in pools])
    credited = await repo.rewards_credited(session, [p.id for p in pools])
    return [
        PoolOut(
            **_public_fields(p, counts[p.id]),
            owner_token_id=p.owner_token_id,
            active_members=counts[p.id][MembershipStatus.active.value],
            pending_members=counts[p.id][MembershipStatus.pending.value],
            status_changed_at=p.status_changed_at,
            status_reason=p.status_reason,
            rewards_credited=credited[p.id],
            reward_budget_remaining=budget_remaining(p.reward_budget, credited[p.id]),
            updated_at=p.updated_at,
        )
        for p in pools
    ]


def budget_remaining(budget: int | None, credited: int) -> int | None:
    """What a reward budget has left (never below 0: work leased before the pause may take the
    spend past it); None without a budget."""
    return None if budget is None else max(0, budget - credited)


async def pool_view(session: AsyncSession, pool: Pool) -> PoolOut:
    return (await pool_views(session, [pool]))[0]


def membership_out(m: PoolMembership) -> MembershipOut:
    return MembershipOut(
        pool_id=m.pool_id,
        node_id=m.node_id,
        provider_id=m.provider_id,
        status=MembershipStatus(m.status),
        episode=m.episode,
        stake=m.stake,
        reason=m.reason,
        joined_at=m.joined_at,
        activated_at=m.activated_at,
        ended_at=m.ended_at,
        failure_streak=m.failure_streak or 0,
        failing_until=m.failing_until,
    )


async def members_out(session: AsyncSession, members: list[PoolMembership]) -> list[MemberOut]:
    """The memberships (all of one pool) with their nodes' track records."""
    if not members:
        return []
    records = await repo.track_records(session, members[0].pool_id, [m.node_id for m in members])
    out = []
    for m in members:
        t = records.get(m.node_id)
        record = TrackRecordOut(
            valid=t.valid if t else 0,
            invalid=t.invalid if t else 0,
            fraud=t.fraud if t else 0,
            strikes=t.strikes if t else 0,
            consecutive_valid=t.consecutive_valid if t else 0,
        )
        out.append(MemberOut(**membership_out(m).model_dump(), track_record=record))
    return out


# ------------------------------------------------------------------ scoping


def may_administer(principal: Principal, pool: Pool) -> bool:
    return principal.role == Role.admin or (
        principal.role == Role.operator and pool.owner_token_id == principal.token_id
    )


async def pool_for(
    session: AsyncSession, principal: Principal, pool_id: str, *, for_update: bool = False
) -> Pool:
    """The pool, if ``principal`` may administer it; otherwise 404 exactly as if it did not exist."""
    pool = await repo.get_pool(session, pool_id, for_update=for_update)
    if pool is None or not may_administer(principal, pool):
        raise NotFound("no pool with this id", code="pool_not_found")
    return pool


async def list_pools(
    session: AsyncSession, principal: Principal, *, status: str | None, after: str | None, limit: int
) -> list[Pool]:
    """The pools ``principal`` administers (an admin: all), by id."""
    owner = None if principal.role == Role.admin else principal.token_id
    return await repo.list_pools(session, owner_token_id=owner, status=status, after=after, limit=limit)


async def list_public_pools(session: AsyncSession, *, after: str | None, limit: int) -> list[Pool]:
    """Active pools, by id (what contributors may join)."""
    return await repo.list_pools(
        session, owner_token_id=None, status=PoolStatus.active.value, after=after, limit=limit
    )


def _writable(pool: Pool) -> None:
    if pool.status == PoolStatus.completed.value:
        raise Conflict("the pool is completed and can no longer change", code="pool_completed")


# ------------------------------------------------------------------ pools


async def create_pool(
    session: AsyncSession, principal: Principal, body: PoolSettings, *, now: dt.datetime
) -> Pool:
    pool = Pool(
        id=new_pool_id(),
        status=PoolStatus.pending.value,
        owner_token_id=principal.token_id,
        created_at=now,
        updated_at=now,
        status_changed_at=now,
    )
    _apply_settings(pool, body)
    session.add(pool)
    await session.flush()
    await record(
        session,
        principal,
        "pool.create",
        target_type="pool",
        target_id=pool.id,
        pool_id=pool.id,
        after={"status": pool.status, **body.model_dump(mode="json")},
    )
    return pool


def _flatten(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict) and key in {"caps", "economics", "policy"}:
            flat.update(_flatten(value, f"{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _merge(current: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    merged = dict(current)
    for key, value in changes.items():
        if key in {"caps", "economics", "policy"} and isinstance(value, dict):
            merged[key] = {**current[key], **value}
        else:
            merged[key] = value
    return merged


async def update_pool(
    session: AsyncSession, principal: Principal, pool_id: str, patch: PoolPatch, *, now: dt.datetime
) -> Pool:
    """Apply the fields sent, validate the merged settings as a whole, audit what changed."""
    pool = await pool_for(session, principal, pool_id, for_update=True)
    _writable(pool)
    current = pool_settings(pool).model_dump(mode="json")
    try:
        merged = PoolSettings.model_validate(_merge(current, patch.changes()))
    except ValidationError as exc:
        errors = [
            {"loc": ["body", *err["loc"]], "msg": err["msg"], "type": err["type"]} for err in exc.errors()
        ]
        first = errors[0]
        raise UnprocessableEntity(
            f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}", extra={"errors": errors}
        ) from None
    before, after = _flatten(current), _flatten(merged.model_dump(mode="json"))
    changed = sorted(k for k in after if after[k] != before.get(k))
    if "caps.max_nodes" in changed and merged.caps.max_nodes is not None:
        await _open_tasks_fit(session, pool.id, merged.caps.max_nodes)
    if changed:
        _apply_settings(pool, merged)
        pool.updated_at = now
        await session.flush()
        await record(
            session,
            principal,
            "pool.update",
            target_type="pool",
            target_id=pool.id,
            pool_id=pool.id,
            before={k: before.get(k) for k in changed},
            after={k: after[k] for k in changed},
        )
    return pool


async def _open_tasks_fit(session: AsyncSession, pool_id: str, max_nodes: int) -> None:
    """A task's replicas go to different nodes, so a cap below the replicas of a task still open
    would leave it open for ever: refused, as an enqueue of such a task is (the enqueue holds the
    pool shared, this change holds it for update, so neither commits a task the other missed)."""
    from orchestrator.tasks.service import open_tasks_above

    count, highest = await open_tasks_above(session, pool_id, max_nodes)
    if count:
        raise Conflict(
            f"caps.max_nodes {max_nodes} is below the replicas of {count} open task(s) (up to "
            f"{highest}); replicas go to different nodes, so they could never be done: cancel them "
            "or let them finish first",
            code="replication_exceeds_max_nodes",
            extra={"max_nodes": max_nodes, "max_replication": highest, "open_tasks": count},
        )


async def change_status(
    session: AsyncSession, principal: Principal, pool_id: str, action: str, *, now: dt.datetime
) -> Pool:
    """Run a lifecycle action; idempotent when the pool is already where the action leads."""
    sources, target = TRANSITIONS[action]
    pool = await pool_for(session, principal, pool_id, for_update=True)
    if pool.status == target:
        return pool
    if pool.status not in sources:
        allowed = sorted(a for a, (srcs, _) in TRANSITIONS.items() if pool.status in srcs)
        raise Conflict(
            f"cannot {action} the pool: it is {pool.status}"
            + (f" (possible now: {', '.join(allowed)})" if allowed else " (final)"),
            code="pool_transition_invalid",
            extra={"pool_status": pool.status, "allowed_actions": allowed},
        )
    if target == PoolStatus.active.value:
        await _budget_left(session, pool, action)
    before = pool.status
    ended: list[str] = []
    cancelled = 0
    if target == PoolStatus.completed.value:
        ended = await _end_memberships(
            session,
            pool,
            await repo.live_members(session, pool.id),
            to_status=MembershipStatus.left.value,
            reason="pool completed",
            actor=principal.token_id,
            now=now,
        )
        cancelled = await end_pool_tasks(session, pool.id, now=now)
    pool.status = target
    pool.status_reason = None
    pool.status_changed_at = now
    pool.updated_at = now
    await session.flush()
    after: dict[str, Any] = {"status": target}
    if ended:
        after["ended_memberships"] = ended
    if cancelled:
        after["cancelled_tasks"] = cancelled
    await record(
        session,
        principal,
        f"pool.{action}",
        target_type="pool",
        target_id=pool.id,
        pool_id=pool.id,
        before={"status": before},
        after=after,
    )
    return pool


async def _budget_left(session: AsyncSession, pool: Pool, action: str) -> None:
    """A pool whose verdicts have credited its reward budget is not made active again (the
    budget check would pause it at once): 409 ``budget_spent`` until the budget is raised above
    what is spent, or removed."""
    if pool.reward_budget is None:
        return
    credited = (await repo.rewards_credited(session, [pool.id]))[pool.id]
    if credited >= pool.reward_budget:
        raise Conflict(
            f"cannot {action} the pool: its verdicts have credited {credited} in rewards, its "
            f"economics.reward_budget is {pool.reward_budget}; raise the budget above {credited} "
            "(or set it to null) first",
            code="budget_spent",
            extra={"rewards_credited": credited, "reward_budget": pool.reward_budget},
        )


async def pause_spent_pools(session: AsyncSession, *, now: dt.datetime) -> list[str]:
    """Pause every active pool whose verdicts have credited its ``reward_budget`` (status
    reason ``budget_spent``, audited ``pool.pause`` by the system actor). Claims then get the
    usual ``pool_paused``; leases already out run on and their results are judged and paid, as
    after an operator's pause. Each pool is locked and read again before it is paused (an
    operator's change may have come first). Returns the pools paused, by id."""
    paused = []
    for pool_id in await repo.active_pools_over_budget(session):
        pool = await repo.get_pool(session, pool_id, for_update=True)
        if pool is None or pool.status != PoolStatus.active.value or pool.reward_budget is None:
            continue
        credited = (await repo.rewards_credited(session, [pool.id]))[pool.id]
        if credited < pool.reward_budget:
            continue
        pool.status = PoolStatus.paused.value
        pool.status_reason = BUDGET_SPENT
        pool.status_changed_at = now
        pool.updated_at = now
        await session.flush()
        await record(
            session,
            SYSTEM,
            "pool.pause",
            target_type="pool",
            target_id=pool.id,
            pool_id=pool.id,
            before={"status": PoolStatus.active.value},
            after={
                "status": pool.status,
                "reason": BUDGET_SPENT,
                "rewards_credited": credited,
                "reward_budget": pool.reward_budget,
            },
        )
        paused.append(pool.id)
    return paused


# ------------------------------------------------------------------ leases (filled in by the tasks issue)


async def release_member_leases(
    session: AsyncSession, pool_id: str, node_id: str, *, now: dt.datetime
) -> int:
    """Hook: release the leases ``node_id`` holds in ``pool_id`` because its membership ended
    (leave, ejection, blacklisting, pool completion), so their tasks are reissued at once
    instead of waiting for the leases to expire. Called in the membership change's transaction,
    after the membership row is updated (and locked) and before it commits.

    Returns how many leases were released.
    """
    from orchestrator.tasks.service import release_member_leases as release

    return await release(session, pool_id, node_id, now=now)


async def lock_member_leases(session: AsyncSession, pool_id: str, node_ids: list[str]) -> None:
    """Hook: lock the members' nodes, then their live leases in the pool, before their
    memberships end (``tasks.service``)."""
    from orchestrator.tasks.service import lock_member_live_leases

    await lock_member_live_leases(session, pool_id, node_ids)


async def end_pool_tasks(session: AsyncSession, pool_id: str, *, now: dt.datetime) -> int:
    """Hook: the pool is being completed, so its open tasks, which no node can lease any more,
    are cancelled (``end_reason`` ``pool_completed``) and results waiting for their siblings are
    settled. Called after the memberships have ended (their leases given back). Returns how many."""
    from orchestrator.tasks.service import end_pool_tasks as end

    return await end(session, pool_id, now=now)


# ------------------------------------------------------------------ memberships: stake


def _key(m: PoolMembership, what: str) -> str:
    return f"membership:{m.id}:{m.episode}:{what}"


def lock_key(m: PoolMembership) -> str:
    """The ledger key of the transfer that locked the stake of ``m``'s current episode (none if
    the pool asked for no stake when it joined)."""
    return _key(m, "lock")


def unbonding_keys(m: PoolMembership) -> list[str]:
    """The ledger keys of the transfers that started the unbonding of ``m``'s stake when its
    episodes ended, latest first (none for an episode that never became active). Every one of
    them may still be unbonding: a node that left may join again and leave again meanwhile."""
    return [f"membership:{m.id}:{episode}:unbond" for episode in range(m.episode, 0, -1)]


async def _end_membership(
    session: AsyncSession,
    pool: Pool,
    m: PoolMembership,
    *,
    to_status: str,
    reason: str | None,
    actor: str,
    now: dt.datetime,
) -> None:
    """End (or re-label) a membership. Stake it still holds goes back: at once if it never
    became active, through the pool's unbonding period if it did."""
    was = m.status
    m.status = to_status
    m.reason = reason
    m.updated_at = now
    if was in LIVE:
        m.ended_at = now
    await session.flush()
    if was not in LIVE:
        return
    reference = ("membership", str(m.id))
    if m.stake > 0 and was == MembershipStatus.active.value:
        await ledger.start_unbonding(
            session,
            m.provider_id,
            m.stake,
            release_at=now + dt.timedelta(seconds=pool.unbonding_period_s),
            key=_key(m, "unbond"),
            actor=actor,
            reference=reference,
        )
    elif m.stake > 0:
        await ledger.unlock_stake(
            session, m.provider_id, m.stake, key=_key(m, "unlock"), actor=actor, reference=reference
        )
    await release_member_leases(session, pool.id, m.node_id, now=now)


async def _lock_stake(session: AsyncSession, members: list[PoolMembership]) -> None:
    """Before ending several memberships: their providers' stake accounts, locked up front in
    the ledger's global order."""
    providers = sorted({m.provider_id for m in members})
    await ledger.lock_accounts(session, [ref for p in providers for ref in ledger.stake_accounts(p)])


async def _end_memberships(
    session: AsyncSession,
    pool: Pool,
    members: list[PoolMembership],
    *,
    to_status: str,
    reason: str | None,
    actor: str,
    now: dt.datetime,
) -> list[str]:
    """End several (locked) memberships of ``pool`` in one transaction. Returns the nodes.

    The global order: memberships, their accounts, the members' nodes (as a claim, a reviving
    beat and a leave take a node before its leases), then all their live leases in the pool in
    id order (as a cancel of one of their tasks takes them), before giving them back node by
    node: taken node by node, they deadlocked with such a cancel."""
    await _lock_stake(session, members)
    await lock_member_leases(session, pool.id, sorted({m.node_id for m in members}))
    for m in members:
        await _end_membership(session, pool, m, to_status=to_status, reason=reason, actor=actor, now=now)
    return [m.node_id for m in members]


# ------------------------------------------------------------------ memberships: joining


@dataclass(frozen=True)
class Refusal:
    code: str
    detail: str
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "detail": self.detail, **self.extra}


class JoinRefused(Forbidden):
    """A join that breaks one or more rules; ``reasons`` names every one of them."""

    title = "Join refused"

    def __init__(self, reasons: list[Refusal]) -> None:
        super().__init__(
            "the node cannot join this pool: " + "; ".join(r.detail for r in reasons),
            code=reasons[0].code,
            extra={"reasons": [r.as_dict() for r in reasons]},
        )


async def _check_invite(
    session: AsyncSession, pool: Pool, code: str, now: dt.datetime
) -> tuple[PoolInvite | None, str | None]:
    invite = await repo.get_invite_by_hash(session, hash_invite_code(code))
    if invite is None:
        return None, "the invite code is not known"
    if invite.pool_id != pool.id:
        return None, "the invite code is for another pool"
    if invite.used_at is not None:
        return None, "the invite code was already used"
    if invite.expires_at <= now:
        return None, "the invite code has expired"
    return invite, None


async def _refusals(
    session: AsyncSession,
    pool: Pool,
    node: Node,
    existing: PoolMembership | None,
    invite_code: str | None,
    now: dt.datetime,
) -> tuple[list[Refusal], PoolInvite | None]:
    """Every rule the join breaks, in a fixed order (the first one names the problem)."""
    reasons: list[Refusal] = []
    if pool.status != PoolStatus.active.value:
        reasons.append(Refusal("pool_not_active", f"the pool is {pool.status}, not active"))
    if existing is not None and existing.status == MembershipStatus.ejected.value:
        reasons.append(Refusal("node_ejected", "this node was ejected from the pool and cannot rejoin"))
    if await repo.get_blacklisting(session, pool.id, node.provider_id) is not None:
        reasons.append(Refusal("provider_blacklisted", "the node's provider is blacklisted from this pool"))
    unmet = unmet_requirements(pool.requirements, node)
    if unmet is not None:
        reasons.append(Refusal("requirements_unmet", unmet.describe(), {"alternatives": unmet.as_list()}))
    invite: PoolInvite | None = None
    if pool.admission == Admission.invite.value:
        if invite_code is None:
            reasons.append(Refusal("invite_required", "the pool admits nodes by invite code only"))
        else:
            invite, problem = await _check_invite(session, pool, invite_code, now)
            if problem is not None:
                reasons.append(Refusal("invite_invalid", problem))
    if pool.max_nodes is not None:
        count = await repo.count_live(session, pool.id)
        if count >= pool.max_nodes:
            reasons.append(Refusal("pool_full", f"the pool is full ({count} of {pool.max_nodes} nodes)"))
    if pool.max_nodes_per_provider is not None:
        count = await repo.count_live(session, pool.id, provider_id=node.provider_id)
        if count >= pool.max_nodes_per_provider:
            reasons.append(
                Refusal(
                    "provider_cap",
                    f"the node's provider already has {count} nodes in the pool "
                    f"(at most {pool.max_nodes_per_provider})",
                )
            )
    if pool.max_nodes_per_ip is not None and node.ip_address is not None:
        count = await repo.count_live(session, pool.id, ip_address=node.ip_address)
        if count >= pool.max_nodes_per_ip:
            reasons.append(
                Refusal(
                    "ip_cap",
                    f"{count} nodes from the node's IP address are already in the pool "
                    f"(at most {pool.max_nodes_per_ip})",
                )
            )
    if pool.min_stake_per_node > 0:
        free = (await ledger.provider_balances(session, node.provider_id))["stake_free"]
        if free < pool.min_stake_per_node:
            reasons.append(_stake_refusal(pool, free))
    return reasons, invite


def _stake_refusal(pool: Pool, free: int | None) -> Refusal:
    has = f", the provider has {free} free" if free is not None else ""
    return Refusal(
        "stake_insufficient",
        f"a node needs {pool.min_stake_per_node} free stake to join{has}",
        {"required": pool.min_stake_per_node},
    )


async def join(
    session: AsyncSession, pool_id: str, node: Node, invite_code: str | None, *, now: dt.datetime
) -> tuple[PoolMembership, bool]:
    """Join (or ask to join) a pool. Returns the membership and whether this call created it;
    joining while already active or pending returns the membership unchanged."""
    if is_postgres(session):
        # A ban locks the node's row, then ends its memberships in the pools it reads: a join
        # must not commit a membership the ban did not see. Lock the row first, as the ban
        # does, and read the status again (the signer check read it before any lock). Before
        # it, the provider's row (``FOR SHARE``, as a node's registration): a retirement of the
        # provider in flight takes its pools before its nodes, so a join holding the node while
        # it waited for the pool deadlocked with it; it now waits for the retirement holding
        # nothing, and then finds the node banned.
        await identity_repo.get_provider(session, node.provider_id, for_share=True)
        await session.refresh(node, ["status"], with_for_update={"key_share": True})
        if node.status == NodeStatus.banned:
            raise await banned_node_of(session, node.id)
    pool = await repo.get_pool(session, pool_id, for_update=True)
    if pool is None:
        raise NotFound("no pool with this id", code="pool_not_found")
    m = await repo.get_membership(session, pool.id, node.id, for_update=True)
    if m is not None and m.status in LIVE:
        return m, False
    reasons, invite = await _refusals(session, pool, node, m, invite_code, now)
    if reasons:
        raise JoinRefused(reasons)

    status = (
        MembershipStatus.pending if pool.admission == Admission.approval.value else MembershipStatus.active
    )
    activated_at = now if status == MembershipStatus.active else None
    if m is None:
        m = PoolMembership(
            pool_id=pool.id,
            node_id=node.id,
            provider_id=node.provider_id,
            episode=1,
            created_at=now,
        )
        session.add(m)
    else:
        m.episode += 1
    m.status = status.value
    m.stake = pool.min_stake_per_node
    m.reason = None
    m.invite_id = invite.id if invite is not None else None
    m.joined_at = now
    m.activated_at = activated_at
    m.ended_at = None
    m.updated_at = now
    await session.flush()

    if invite is not None and not await repo.use_invite(session, invite.id, node.id, now):
        raise JoinRefused([Refusal("invite_invalid", "the invite code was already used")])
    if m.stake > 0:
        try:
            await ledger.lock_stake(
                session,
                node.provider_id,
                m.stake,
                key=lock_key(m),
                actor=f"node:{node.id}",
                reference=("membership", str(m.id)),
            )
        except ledger.InsufficientFunds:
            # Free stake was spent by a concurrent join elsewhere since we looked.
            raise JoinRefused([_stake_refusal(pool, None)]) from None
    return m, True


async def leave(session: AsyncSession, pool_id: str, node: Node, *, now: dt.datetime) -> PoolMembership:
    """Leave a pool (or withdraw a pending join); idempotent."""
    pool = await repo.get_pool(session, pool_id, for_update=True)
    if pool is None:
        raise NotFound("no pool with this id", code="pool_not_found")
    m = await repo.get_membership(session, pool.id, node.id, for_update=True)
    if m is None:
        raise Forbidden("this node is not a member of the pool", code="not_a_member")
    if m.status in LIVE:
        await _end_membership(
            session,
            pool,
            m,
            to_status=MembershipStatus.left.value,
            reason=None,
            actor=f"node:{node.id}",
            now=now,
        )
    return m


# ------------------------------------------------------------------ memberships: operators


async def list_members(
    session: AsyncSession,
    principal: Principal,
    pool_id: str,
    *,
    status: str | None,
    after: int | None,
    limit: int,
) -> list[PoolMembership]:
    pool = await pool_for(session, principal, pool_id)
    return await repo.list_members(session, pool.id, status=status, after=after, limit=limit)


async def _member_for(
    session: AsyncSession, principal: Principal, pool_id: str, node_id: str
) -> tuple[Pool, PoolMembership]:
    pool = await pool_for(session, principal, pool_id, for_update=True)
    _writable(pool)
    m = await repo.get_membership(session, pool.id, node_id, for_update=True)
    if m is None:
        raise NotFound("this node has no membership in the pool", code="member_not_found")
    return pool, m


async def _audit_member(
    session: AsyncSession,
    principal: Actor,
    action: str,
    m: PoolMembership,
    before: str,
    reason: str | None,
) -> None:
    after: dict[str, Any] = {"status": m.status, "episode": m.episode}
    if reason is not None:
        after["reason"] = reason
    await record(
        session,
        principal,
        action,
        target_type="node",
        target_id=m.node_id,
        pool_id=m.pool_id,
        before={"status": before},
        after=after,
    )


async def approve(
    session: AsyncSession, principal: Principal, pool_id: str, node_id: str, *, now: dt.datetime
) -> PoolMembership:
    """pending -> active (its stake is already locked); approving an active member changes nothing."""
    _, m = await _member_for(session, principal, pool_id, node_id)
    if m.status == MembershipStatus.active.value:
        return m
    if m.status != MembershipStatus.pending.value:
        raise Conflict(f"the membership is {m.status}, not pending", code="membership_not_pending")
    m.status = MembershipStatus.active.value
    m.activated_at = now
    m.updated_at = now
    await session.flush()
    await _audit_member(session, principal, "membership.approve", m, MembershipStatus.pending.value, None)
    return m


async def reject(
    session: AsyncSession,
    principal: Principal,
    pool_id: str,
    node_id: str,
    reason: str | None,
    *,
    now: dt.datetime,
) -> PoolMembership:
    """pending -> rejected, stake back at once; rejecting a rejected join changes nothing."""
    pool, m = await _member_for(session, principal, pool_id, node_id)
    if m.status == MembershipStatus.rejected.value:
        return m
    if m.status != MembershipStatus.pending.value:
        raise Conflict(f"the membership is {m.status}, not pending", code="membership_not_pending")
    await _end_membership(
        session,
        pool,
        m,
        to_status=MembershipStatus.rejected.value,
        reason=reason,
        actor=principal.token_id,
        now=now,
    )
    await _audit_member(session, principal, "membership.reject", m, MembershipStatus.pending.value, reason)
    return m


async def eject(
    session: AsyncSession, principal: Principal, pool_id: str, node_id: str, reason: str, *, now: dt.datetime
) -> PoolMembership:
    """Any membership -> ejected (the node can never rejoin this pool). An active member's
    stake unbonds and its leases are released; a pending one's stake comes back at once."""
    pool, m = await _member_for(session, principal, pool_id, node_id)
    await _eject(session, principal, pool, m, reason, by=EJECTED_BY_OPERATOR, now=now)
    return m


EJECTED_BY_BAN = "ban"
EJECTED_BY_OPERATOR = "operator"
EJECTED_BY_VERIFIER = "verifier"


async def _eject(
    session: AsyncSession,
    principal: Actor,
    pool: Pool,
    m: PoolMembership,
    reason: str,
    *,
    by: str,
    now: dt.datetime,
) -> None:
    """Eject a locked membership, recording who did (``by``), audited as ``membership.eject``.
    An ejected membership is left as it is, except that an operator's or the verifier's
    ejection of one a ban ejected makes it theirs (so an unban does not lift it), and an
    operator's of one the verifier ejected makes it the operator's (so an appeal of the
    verifier's strikes does not lift it)."""
    if m.status == MembershipStatus.ejected.value:
        takes_over = (m.ejected_by == EJECTED_BY_BAN and by != EJECTED_BY_BAN) or (
            m.ejected_by == EJECTED_BY_VERIFIER and by == EJECTED_BY_OPERATOR
        )
        if not takes_over:
            return
        m.ejected_by = by
        m.reason = reason
        m.updated_at = now
        await session.flush()
        await _audit_member(session, principal, "membership.eject", m, MembershipStatus.ejected.value, reason)
        return
    before = m.status
    m.ejected_by = by
    await _end_membership(
        session,
        pool,
        m,
        to_status=MembershipStatus.ejected.value,
        reason=reason,
        actor=principal.actor_id,
        now=now,
    )
    await _audit_member(session, principal, "membership.eject", m, before, reason)


# The reason a ban's ejections carry, for people (``ejected_by`` says who ejected, for machines).
BAN_EJECTION_PREFIX = "node banned: "


async def lift_ban_ejections(
    session: AsyncSession, principal: Principal, node_id: str, *, now: dt.datetime
) -> list[str]:
    """After an unban: the memberships the ban ejected become ``left``, so the node may join
    those pools again (a new episode, with new stake). Ejections by an operator or by the
    verifier stay (an appeal may lift the verifier's: ``lift_fraud_ejection``). Audited as
    ``membership.reinstate``. Returns the pools, by id."""
    lifted = await repo.ejections_for_update(session, node_id, ejected_by=EJECTED_BY_BAN)
    for m in lifted:
        await _reinstate(session, principal, m, "ban lifted", now=now)
    await session.flush()
    return sorted(m.pool_id for m in lifted)


async def eject_node(
    session: AsyncSession, principal: Actor, node_id: str, reason: str, *, now: dt.datetime
) -> list[str]:
    """Eject ``node_id`` from every pool it is a live (active or pending) member of, as an
    operator ejection does each (leases released, stake unbonding or back at once, audited by
    ``principal``: an admin's ban, or the node's provider revoking it).
    Lock order as everywhere: the pools (by id), their memberships, the stake accounts, then
    the ejections. Returns the pools, by id."""
    pools = [
        pool
        for pool_id in await repo.live_pool_ids_of_node(session, node_id)
        if (pool := await repo.get_pool(session, pool_id, for_update=True)) is not None
    ]
    members = await repo.memberships_for_update(session, node_id, [p.id for p in pools])
    live = [(pool, m) for pool in pools if (m := members.get(pool.id)) is not None and m.status in LIVE]
    await _lock_stake(session, [m for _, m in live])
    for pool, m in live:
        await _eject(session, principal, pool, m, reason, by=EJECTED_BY_BAN, now=now)
    return [pool.id for pool, _ in live]


# ------------------------------------------------------------------ invites and blacklists


async def create_invite(
    session: AsyncSession, principal: Principal, pool_id: str, expires_in_s: int, *, now: dt.datetime
) -> tuple[PoolInvite, str]:
    """A single-use code, returned once; only its SHA-256 is stored. The pool is locked, as for
    every other change to it: a completion in progress (which the invite's foreign-key check
    would not wait for) is waited for, and the invite then refused."""
    pool = await pool_for(session, principal, pool_id, for_update=True)
    _writable(pool)
    code = secrets.token_urlsafe(24)
    invite = PoolInvite(
        id="inv_" + secrets.token_hex(8),
        pool_id=pool.id,
        code_hash=hash_invite_code(code),
        created_by=principal.token_id,
        created_at=now,
        expires_at=now + dt.timedelta(seconds=expires_in_s),
    )
    session.add(invite)
    await session.flush()
    await record(
        session,
        principal,
        "invite.create",
        target_type="invite",
        target_id=invite.id,
        pool_id=pool.id,
        after={"expires_at": invite.expires_at},
    )
    return invite, code


async def blacklist_provider(
    session: AsyncSession,
    principal: Principal,
    pool_id: str,
    provider_id: str,
    reason: str,
    *,
    now: dt.datetime,
) -> tuple[PoolProviderBlacklist, list[str], bool]:
    """Shut a provider out of a pool: its live members leave (stake unbonds or comes back) and
    none of its nodes may join. Returns the entry, the nodes removed and whether it is new.

    A retired provider's heir is blacklisted with it (``blacklist_locked``). The provider's row,
    and its successors' down to its heir, are held ``FOR SHARE`` before the pool (a retirement
    takes the providers' rows before its pools): a retirement of one of them in flight is waited
    for, and then seen; one that begins meanwhile waits for this blacklisting, and then reads it
    (``identity.retirement``) and copies it to its successor."""
    known = await _lock_provider_and_heirs(session, provider_id)
    pool = await pool_for(session, principal, pool_id, for_update=True)
    _writable(pool)
    if not known:
        raise NotFound("no provider with this id", code="provider_not_found")
    removed, created = await blacklist_locked(session, principal, pool, provider_id, reason, now=now)
    entry = await repo.get_blacklisting(session, pool.id, provider_id)
    assert entry is not None
    return entry, removed, created


async def _lock_provider_and_heirs(session: AsyncSession, provider_id: str) -> bool:
    """Hold the provider's row ``FOR SHARE``, and if it is retired its successor's, and so on
    down to its heir (whose retirement then waits); False if there is no such provider."""
    provider = await identity_repo.get_provider(session, provider_id, for_share=True)
    if provider is None:
        return False
    seen = {provider_id}
    while provider is not None and provider.successor_id is not None and provider.successor_id not in seen:
        seen.add(provider.successor_id)
        provider = await identity_repo.get_provider(session, provider.successor_id, for_share=True)
    return True


async def blacklist_locked(
    session: AsyncSession,
    principal: Principal,
    pool: Pool,
    provider_id: str,
    reason: str,
    *,
    now: dt.datetime,
) -> tuple[list[str], bool]:
    """Record the blacklisting (once) and end the provider's live memberships in a pool the
    caller locked, whatever its status (the operator's route, the verifier's ban, a retirement
    copying its blacklistings to the successor, ``identity.retirement``); returns the nodes
    removed and whether the entry is new. An operator's (or admin's)
    blacklisting of a provider the verifier blacklisted already takes the entry over
    (``_take_over``), so that an appeal of the verifier's strikes does not lift it.

    A new blacklisting of a retired provider blacklists its heir in the pool too (its successor,
    or the successor's heir: ``ledger.heirs``, read now), as the retirement copied the ones
    before it: a retirement is no way out of a blacklist, whoever decides it and whenever. The
    copy's actor is ``SUCCESSION`` (no appeal lifts it; an operator removes it)."""
    for _ in range(2):
        created = await repo.insert_blacklisting(
            session,
            pool_id=pool.id,
            provider_id=provider_id,
            reason=reason,
            created_by=principal.token_id,
            now=now,
        )
        if created or principal.token_id == SYSTEM.token_id:
            break
        if await _take_over(session, principal, pool, provider_id, reason):
            return [], False
        # None to take over: an appeal removed the verifier's meanwhile; insert it again.
    if not created:
        return [], False
    removed = await _end_memberships(
        session,
        pool,
        await repo.live_members(session, pool.id, provider_id=provider_id),
        to_status=MembershipStatus.left.value,
        reason=f"provider blacklisted: {reason}",
        actor=principal.token_id,
        now=now,
    )
    await _audit_blacklisting(
        session,
        principal,
        "pool.blacklist_provider",
        pool.id,
        provider_id,
        before={"blacklisted": False},
        after={"blacklisted": True, "reason": reason, "removed_nodes": removed},
    )
    heir = (await heirs(session, [provider_id])).get(provider_id)
    if heir is not None:
        await blacklist_locked(
            session,
            SUCCESSION,
            pool,
            heir,
            f"successor of retired provider {provider_id}: {reason}",
            now=now,
        )
    return removed, True


async def _audit_blacklisting(
    session: AsyncSession,
    principal: Principal,
    action: str,
    pool_id: str,
    provider_id: str,
    *,
    before: dict[str, Any],
    after: dict[str, Any],
) -> None:
    """The audit entry of a change to a provider's blacklisting in a pool."""
    await record(
        session,
        principal,
        action,
        target_type="provider",
        target_id=provider_id,
        pool_id=pool_id,
        before=before,
        after=after,
    )


async def _take_over(
    session: AsyncSession, principal: Principal, pool: Pool, provider_id: str, reason: str
) -> bool:
    """The existing blacklisting of the provider, locked; the verifier's becomes ``principal``'s,
    with its reason (audited ``pool.blacklist_provider``), as an operator's ejection of a
    membership a ban ejected makes it theirs. False if there is none any more (an appeal removed
    the verifier's since the insert found it)."""
    entry = await repo.get_blacklisting(session, pool.id, provider_id, for_update=True)
    if entry is None:
        return False
    if entry.created_by == SYSTEM.token_id:
        before = {"blacklisted": True, "reason": entry.reason, "created_by": entry.created_by}
        entry.created_by = principal.token_id
        entry.reason = reason
        await session.flush()
        await _audit_blacklisting(
            session,
            principal,
            "pool.blacklist_provider",
            pool.id,
            provider_id,
            before=before,
            after={"blacklisted": True, "reason": reason, "created_by": principal.token_id},
        )
    return True


# ------------------------------------------------------------------ sanctions by the verifier

SYSTEM = Principal(token_id="system", name="verifier", role=Role.admin)  # noqa: S106 - an actor, not a secret


async def eject_for_fraud(
    session: AsyncSession, pool: Pool, m: PoolMembership, *, reason: str, now: dt.datetime
) -> None:
    """The verifier's ejection after the pool's strike limit (audited as actor ``system``); of
    a live membership, of one that ended before the verdict (left or rejected: nothing moves,
    it only may not join again), or of one a ban ejected, which it makes the verifier's (lifted
    only by an appeal that brings the strikes below the limit: ``lift_fraud_ejection``)."""
    await _eject(session, SYSTEM, pool, m, reason, by=EJECTED_BY_VERIFIER, now=now)


async def blacklist_for_fraud(
    session: AsyncSession, pool: Pool, provider_id: str, *, reason: str, now: dt.datetime
) -> bool:
    """The verifier's provider ban after the pool's provider strike limit; True if new."""
    _, created = await blacklist_locked(session, SYSTEM, pool, provider_id, reason, now=now)
    return created


#: The actor of a retired provider's blacklisting copied to its heir after the retirement
#: (``blacklist_locked``): not the verifier's (no appeal lifts it, as a retirement's own copies),
#: an operator removes it.
SUCCESSION = Principal(token_id="succession", name="retirement", role=Role.admin)  # noqa: S106 - an actor, not a secret


async def lift_fraud_ejection(
    session: AsyncSession, principal: Principal, m: PoolMembership, *, reason: str, now: dt.datetime
) -> bool:
    """After an appeal brought the node's strikes below the pool's limit: a locked membership
    the verifier ejected becomes ``left``, as an unban's does (``lift_ban_ejections``), so the
    node may join again (a new episode, with new stake). Ejections by an operator or a ban stay
    as they are, and so does the ejection of a node its provider revoked (banned for good: it
    never joins again). Audited as ``membership.reinstate`` by ``principal`` (the appeal's).
    Returns whether it was lifted."""
    if m.status != MembershipStatus.ejected.value or m.ejected_by != EJECTED_BY_VERIFIER:
        return False
    node = await session.get(Node, m.node_id)
    if node is not None and node.revoked_at is not None:
        return False
    await _reinstate(session, principal, m, reason, now=now)
    await session.flush()
    return True


async def _reinstate(
    session: AsyncSession, principal: Principal, m: PoolMembership, reason: str, *, now: dt.datetime
) -> None:
    """An ejected membership becomes ``left`` (the node may join again), audited as
    ``membership.reinstate``."""
    m.status = MembershipStatus.left.value
    m.ejected_by = None
    m.reason = reason
    m.updated_at = now
    await _audit_member(session, principal, "membership.reinstate", m, MembershipStatus.ejected.value, reason)


async def lift_fraud_blacklisting(
    session: AsyncSession, principal: Principal, pool_id: str, provider_id: str, *, reason: str
) -> bool:
    """After an appeal brought the provider's strikes in the pool below its limit: the
    verifier's blacklisting of the provider (``created_by`` the system actor) is removed, so its
    nodes may join again; an operator's stays. Its nodes that the blacklisting removed are
    ``left`` (``blacklist_locked`` ends memberships, it does not eject them): nothing to reinstate.
    Audited as ``pool.unblacklist_provider`` by ``principal``. Returns whether it was removed."""
    entry = await repo.get_blacklisting(session, pool_id, provider_id, for_update=True)
    if entry is None or entry.created_by != SYSTEM.token_id:
        return False
    before = {"blacklisted": True, "reason": entry.reason, "created_by": entry.created_by}
    await session.delete(entry)
    await session.flush()
    await _audit_blacklisting(
        session,
        principal,
        "pool.unblacklist_provider",
        pool_id,
        provider_id,
        before=before,
        after={"blacklisted": False, "reason": reason},
    )
    return True
