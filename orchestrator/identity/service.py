"""Rules for registering providers and nodes."""

from __future__ import annotations

import datetime as dt
import ipaddress

from sqlalchemy import bindparam, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_object_session

from api_schemas.common import Page
from api_schemas.identity import NodeMembership, NodeOut, NodeRegister, NodeSpecs, ProviderOut
from orchestrator.core.errors import Conflict, Forbidden, NotFound, UnprocessableEntity
from orchestrator.core.keys import verify_attestation
from orchestrator.core.pagination import CursorScope
from orchestrator.core.state import AppState
from orchestrator.identity import repository as repo
from orchestrator.identity.models import Node, NodeStatus, Provider
from orchestrator.pools import repository as pools_repo


def provider_out(provider: Provider) -> ProviderOut:
    return ProviderOut(id=provider.id, display_name=provider.display_name, created_at=provider.created_at)


async def node_out(state: AppState, node: Node) -> NodeOut:
    last = await state.hot_store.last_beat(node.id)
    session = async_object_session(node)  # the request's session the node was loaded in
    memberships = await pools_repo.memberships_of_node(session, node.id) if session is not None else []
    return _node_view(node, last, memberships)


def _node_view(node: Node, last: float | None, memberships: list[tuple[str, str]]) -> NodeOut:
    """The node as its views give it, with its last beat in the hot store (None: not there) and
    its memberships by pool id."""
    return NodeOut(
        id=node.id,
        provider_id=node.provider_id,
        specs=NodeSpecs(
            gpu_model=node.gpu_model,
            gpu_count=node.gpu_count,
            gpu_memory_mb=node.gpu_memory_mb,
            cpu_cores=node.cpu_cores,
            ram_mb=node.ram_mb,
        ),
        version=node.version,
        status=node.status,
        status_changed_at=node.status_changed_at,
        created_at=node.created_at,
        # The hot store's while the node is watched; what the sweeper kept once it is dead.
        last_heartbeat_at=(
            dt.datetime.fromtimestamp(last, dt.UTC) if last is not None else node.last_heartbeat_at
        ),
        memberships=[NodeMembership(pool_id=p, status=s) for p, s in memberships],
        revoked_at=node.revoked_at,
    )


async def nodes_page(
    session: AsyncSession,
    state: AppState,
    scope: CursorScope,
    *,
    status: str | None,
    provider_id: str | None,
    cursor: str | None,
    limit: int,
) -> Page[NodeOut]:
    """One page of nodes by id (``status``, ``provider_id``: only those), each as ``node_out``
    gives it: the admin's node list and a provider's list of its own nodes. Whatever its size,
    the page's last beats are one hot-store call and its memberships one SQL query."""
    nodes = await repo.list_nodes(
        session, status=status, provider_id=provider_id, after=scope.decode(cursor), limit=limit + 1
    )
    more = len(nodes) > limit
    nodes = nodes[:limit]
    ids = [n.id for n in nodes]
    beats = await state.hot_store.last_beats(ids)
    memberships = await pools_repo.memberships_of_nodes(session, ids)
    items = [_node_view(n, last, memberships.get(n.id, [])) for n, last in zip(nodes, beats, strict=True)]
    return Page[NodeOut](items=items, next_cursor=scope.encode(nodes[-1].id) if more else None)


def revoked_key() -> Forbidden:
    """A registration signed with a node key its provider revoked (``identity.revocation``)."""
    return Forbidden(
        "this node key was revoked by its provider, for good: generate a new node key "
        "(`orchestrator keys generate`) and register that",
        code="node_key_revoked",
    )


def retired_provider() -> Forbidden:
    """A request signed with the key of a provider an admin retired (``identity.retirement``),
    or a node's registration naming it: the key is lost or stolen, and never comes back."""
    return Forbidden(
        "this provider was retired by an admin (its key lost or stolen): its money went to its "
        "successor, and the key can do nothing any more; sign with the successor's key",
        code="provider_retired",
    )


def banned_node(*, provider_retired: bool) -> Forbidden:
    """A request signed with a banned node's key (an admin's ban, its provider's revocation,
    or its provider's retirement, which revokes every node of the
    provider). ``provider_retired`` says which of the last it is: the node's problem carries it,
    so a worker that has only the node key can tell its provider's retirement from a ban."""
    if provider_retired:
        detail = (
            "this node is banned: an admin retired its provider (the provider key lost or stolen), "
            "which revoked the provider's nodes for good; their money went to the successor provider"
        )
    else:
        detail = "this node is banned"
    return Forbidden(detail, code="node_banned", extra={"provider_retired": provider_retired})


_PROVIDER_RETIRED = (
    select(Provider.retired_at.is_not(None))
    .join(Node, Node.provider_id == Provider.id)
    .where(Node.id == bindparam("node_id"))
)


async def banned_node_of(db: AsyncSession | AsyncConnection, node_id: str) -> Forbidden:
    """``banned_node`` for the banned node ``node_id``, its provider's retirement read (one
    primary-key join, made only for a banned node's request)."""
    retired = (await db.execute(_PROVIDER_RETIRED, {"node_id": node_id})).scalar_one_or_none()
    return banned_node(provider_retired=bool(retired))


async def register_provider(
    session: AsyncSession, provider_id: str, display_name: str | None, ip: str
) -> tuple[Provider, bool]:
    """Idempotent: the same key again returns the existing record (created=False). A key
    registered as a node cannot become a provider: the key that gets paid stays off the workers'
    machines (a key registered as both before this rule keeps working)."""
    known = await repo.get_provider(session, provider_id)
    if known is not None and known.retired_at is not None:
        raise retired_provider()
    new = known is None
    if new:
        # Checked and inserted under the key's lock: a node registering it at the same moment
        # waits for this transaction, then finds the provider (and the other way round).
        await repo.lock_key(session, provider_id)
    if new and await repo.get_node(session, provider_id) is not None:
        raise UnprocessableEntity(
            "this key is registered as a node: a provider signs with a key of its own, kept off the "
            "workers' machines (the key that gets paid): generate one with `orchestrator keys generate`",
            code="provider_key_is_node_key",
        )
    created = await repo.insert_provider(session, provider_id, display_name, ip)
    provider = await repo.get_provider(session, provider_id)
    assert provider is not None
    return provider, created


def network_of(host: str) -> str:
    """The address a node is known by for the per-IP rules (replica placement, audit replicas,
    a pool's ``max_nodes_per_ip``): an IPv4 address as it is, an IPv4-mapped IPv6 address as
    its IPv4 address, and any other IPv6 address as its /64 network, since one host or
    subscriber is routinely given a whole /64 and could otherwise pose as many addresses."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host[:64]  # not an address (no client known): compared as it is
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


async def register_node(
    session: AsyncSession, node_id: str, body: NodeRegister, ip: str
) -> tuple[Node, bool]:
    """Register a node under its provider; re-registering updates specs and version. The key
    may be no provider's (a node registered with one before this rule keeps working). A key its
    provider revoked is refused before anything else is looked at (``revoked_key``); a provider
    an admin retired takes no node (``retired_provider``)."""
    known = await repo.get_node(session, node_id)
    if known is not None and known.revoked_at is not None:
        raise revoked_key()
    new = known is None
    if new:
        await repo.lock_key(session, node_id)  # as in register_provider
    if node_id == body.provider_id or (new and await repo.get_provider(session, node_id) is not None):
        # The provider key is who gets paid: it belongs off the workers' machines.
        raise UnprocessableEntity(
            "a node signs with a key of its own, not a provider's (the key that gets paid must "
            "not be on a worker's machine): generate one with `orchestrator keys generate`",
            code="node_key_is_provider_key",
        )
    # Shared: a retirement of the provider in flight (which takes its row first, then its
    # nodes) is waited for, and then refuses this node, which it would not have revoked.
    provider = await repo.get_provider(session, body.provider_id, for_share=True)
    if provider is None:
        raise NotFound(
            "the provider is not registered; register it first (POST /v1/providers)",
            code="provider_not_found",
        )
    if provider.retired_at is not None:
        raise retired_provider()
    if not verify_attestation(body.provider_id, node_id, body.attestation):
        raise Forbidden(
            "the attestation is not the provider's signature over this node id", code="attestation_invalid"
        )
    values = {
        "id": node_id,
        "provider_id": body.provider_id,
        "attestation": body.attestation,
        "gpu_model": body.specs.gpu_model,
        "gpu_count": body.specs.gpu_count,
        "gpu_memory_mb": body.specs.gpu_memory_mb,
        "cpu_cores": body.specs.cpu_cores,
        "ram_mb": body.specs.ram_mb,
        "version": body.version,
        "ip_address": network_of(ip),
        "status": NodeStatus.waiting.value,
    }
    created = await repo.insert_node(session, values)
    node = await repo.get_node(session, node_id, for_update=not created)
    assert node is not None
    if node.provider_id != body.provider_id:
        raise Conflict(
            "this node key is already bound to another provider", code="node_bound_to_other_provider"
        )
    if node.revoked_at is not None:  # revoked since the first read, which this one waited for
        raise revoked_key()
    if node.status == NodeStatus.banned:  # its provider is not retired: checked above
        raise banned_node(provider_retired=False)
    if not created:
        if values["ip_address"] != node.ip_address:
            await _within_ip_caps(session, node, str(values["ip_address"]))
        for field in (
            "attestation",
            "gpu_model",
            "gpu_count",
            "gpu_memory_mb",
            "cpu_cores",
            "ram_mb",
            "version",
            "ip_address",
        ):
            setattr(node, field, values[field])
        await session.flush()
    return node, created


async def _within_ip_caps(session: AsyncSession, node: Node, network: str) -> None:
    """A node that registers again from another address must stay within ``max_nodes_per_ip``
    in every pool it is a member of, as a join from that address would: otherwise joining from
    one address and then moving to another let a few addresses hold any number of nodes."""
    over: list[dict[str, object]] = []
    for pool in await pools_repo.live_pools_capping_ip(session, node.id):
        cap = pool.max_nodes_per_ip
        assert cap is not None
        count = await pools_repo.count_live(session, pool.id, ip_address=network)
        if count >= cap:
            over.append({"pool_id": pool.id, "nodes_from_address": count, "max_nodes_per_ip": cap})
    if over:
        names = ", ".join(
            f"{o['pool_id']} ({o['nodes_from_address']} of {o['max_nodes_per_ip']})" for o in over
        )
        raise Conflict(
            f"this address already has as many nodes as allowed in the pools this node is a member "
            f"of: {names}; leave those pools first, or register from the address the node had",
            code="ip_cap",
            extra={"pools": over},
        )
