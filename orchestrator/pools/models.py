"""Tables for pools, memberships, invites and provider blacklists."""

from __future__ import annotations
