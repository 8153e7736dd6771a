"""Providers, nodes and heartbeats (contributor-facing, signed)."""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel, Field, JsonValue, model_validator

from api_schemas.common import FiniteJsonFloat, KeyId, StrictModel, Text


class ProviderRegister(StrictModel):
    display_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=100,
        pattern=r"^[\x20-\x7e]+$",
        description="Optional printable ASCII name shown to operators.",
    )


class ProviderOut(BaseModel):
    id: KeyId = Field(description="The provider's Ed25519 public key, unpadded base64url")
    display_name: str | None
    created_at: dt.datetime


class NodeSpecs(StrictModel):
    gpu_model: str | None = Field(
        default=None,
        min_length=1,
        max_length=100,
        pattern=r"^[A-Za-z0-9 ._()+/-]+$",
        description="GPU model as reported by the driver, e.g. 'NVIDIA H100 80GB HBM3'. Null for CPU-only.",
    )
    gpu_count: int = Field(ge=0, le=64, description="Number of GPUs")
    gpu_memory_mb: int = Field(ge=0, le=1_048_576, description="Memory per GPU in MiB")
    cpu_cores: int = Field(ge=1, le=1024)
    ram_mb: int = Field(ge=256, le=16_777_216, description="System RAM in MiB")

    @model_validator(mode="after")
    def _gpu_fields_agree(self) -> NodeSpecs:
        if self.gpu_count > 0 and (self.gpu_model is None or self.gpu_memory_mb == 0):
            raise ValueError("a node with GPUs must give gpu_model and gpu_memory_mb")
        if self.gpu_count == 0 and (self.gpu_model is not None or self.gpu_memory_mb != 0):
            raise ValueError("a node without GPUs must leave gpu_model null and gpu_memory_mb 0")
        return self


class NodeRegister(StrictModel):
    provider_id: KeyId
    attestation: str = Field(
        min_length=86,
        max_length=86,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Provider's Ed25519 signature over 'orchestrator/v1/attest-node:' + node id, base64url",
    )
    specs: NodeSpecs
    version: str = Field(
        min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._+-]+$", description="Worker software version"
    )


class NodeMembership(BaseModel):
    pool_id: str = Field(description="The pool")
    status: str = Field(description="pending | active | left | ejected | rejected")


class NodeOut(BaseModel):
    id: KeyId
    provider_id: KeyId
    specs: NodeSpecs
    version: str
    status: str = Field(description="waiting | healthy | unhealthy | dead | banned")
    status_changed_at: dt.datetime
    created_at: dt.datetime
    last_heartbeat_at: dt.datetime | None = None
    memberships: list[NodeMembership] = Field(
        default_factory=list, description="The node's pool memberships, by pool id"
    )
    revoked_at: dt.datetime | None = Field(
        default=None,
        description="When the node's provider revoked its key (POST "
        "/v1/providers/me/nodes/{node_id}/revoke): the node is banned for good, and the key can "
        "never register again. Null: not revoked.",
    )


class NodeRevokeIn(StrictModel):
    reason: Text | None = Field(
        default=None,
        min_length=1,
        max_length=500,
        description="Why (a machine stolen, say); kept in the node's status history and audited",
    )


class NodeRevocationOut(NodeOut):
    ejected_from: list[str] = Field(
        description="The pools the revocation ejected the node from, by id (its leases there "
        "released, its stake there unbonding); the same again when the node is revoked again; "
        "empty for a node an admin had banned already (the ban ejected it)"
    )


RESERVED_METRICS = frozenset({"at"})


# What _metric_names below takes, for the OpenAPI document (it keeps its own messages).
METRIC_NAMES: dict[str, JsonValue] = {
    "pattern": r"^[A-Za-z0-9_]*[A-Za-z0-9][A-Za-z0-9_]*$",
    "maxLength": 64,
    "not": {"const": "at"},
}


class HeartbeatIn(StrictModel):
    metrics: dict[str, FiniteJsonFloat] = Field(
        default_factory=dict,
        max_length=32,
        description="Free-form numeric gauges (gpu_util, tokens_per_s, ...); at most 32, each named "
        'with 1 to 64 ASCII letters, digits and _ (not only _), other than "at".',
        json_schema_extra={"propertyNames": METRIC_NAMES},
    )
    leases: list[Text] = Field(
        default_factory=list,
        max_length=1024,
        description="Ids of the leases this node is working on (at most 1024); the answer's "
        "drop_leases names those that are gone.",
    )

    @model_validator(mode="after")
    def _metric_names(self) -> HeartbeatIn:
        for name in self.metrics:
            if not (1 <= len(name) <= 64 and name.replace("_", "").isalnum() and name.isascii()):
                raise ValueError(f"metric name {name!r} must be 1-64 ASCII letters, digits or _")
            if name in RESERVED_METRICS:
                raise ValueError(f"metric name {name!r} is reserved (the time of the beat)")
        return self


class LeaseDeadline(BaseModel):
    assignment_id: str
    lease_expires_at: dt.datetime = Field(
        description="The lease's deadline after this beat: pushed back when less than half of the "
        "pool's lease duration (or less than the unhealthy threshold) was left, never past the "
        "pool's policy.max_lease_s from the claim"
    )


class HeartbeatOut(BaseModel):
    status: str
    next_heartbeat_in_s: float = Field(description="When to beat next")
    drop_leases: list[str] = Field(
        default_factory=list,
        description="Leases the node named that it no longer holds (ended, expired, another node's "
        "or unknown): stop working on them",
    )
    lease_deadlines: list[LeaseDeadline] = Field(
        default_factory=list,
        description="Each lease the node named that it still holds, once, in the order named, with "
        "its deadline after this beat (as GET /v1/nodes/me/leases gives it); every other named "
        "lease is in drop_leases",
    )
