"""Nodes' and leases' IPv6 addresses are recorded as their /64 network

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-30 14:30:00.000000

The per-IP rules (replica placement, audit replicas, a pool's ``max_nodes_per_ip``) compare
addresses as ``identity.service.network_of`` records them since this revision: IPv4 as it is,
an IPv4-mapped IPv6 address as IPv4, any other IPv6 address as its /64 network. Addresses
recorded before are rewritten the same way, so that a node registered earlier and one
registered later from the same /64 count as one address. The downgrade keeps the networks:
the addresses they came from are not kept anywhere.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _network_of(host: str) -> str:
    # As identity.service.network_of when this revision was written.
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host[:64]
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def upgrade() -> None:
    # The old -> new pairs go to a temporary table first, so each table is rewritten in one
    # statement (one scan), whatever the number of distinct addresses: assignments.ip_address
    # has no index, and a statement per address would scan it once per address.
    conn = op.get_bind()
    conn.execute(
        sa.text(
            "CREATE TEMPORARY TABLE ip_networks_0014 (old VARCHAR(64) PRIMARY KEY, new VARCHAR(64) NOT NULL)"
        )
    )
    found: set[str] = set()
    for table in ("nodes", "assignments"):
        found.update(
            conn.execute(
                sa.text(f"SELECT DISTINCT ip_address FROM {table} WHERE ip_address LIKE '%:%'")  # noqa: S608
            ).scalars()
        )
    pairs = [{"old": old, "new": new} for old in sorted(found) if (new := _network_of(old)) != old]
    if pairs:
        insert = sa.text("INSERT INTO ip_networks_0014 (old, new) VALUES (:old, :new)")
        for start in range(0, len(pairs), 1000):
            conn.execute(insert, pairs[start : start + 1000])
        for table in ("nodes", "assignments"):
            conn.execute(
                sa.text(
                    f"UPDATE {table} SET ip_address = "  # noqa: S608
                    f"(SELECT m.new FROM ip_networks_0014 m WHERE m.old = {table}.ip_address) "
                    "WHERE ip_address IN (SELECT old FROM ip_networks_0014)"
                )
            )
    conn.execute(sa.text("DROP TABLE ip_networks_0014"))


def downgrade() -> None:
    pass
