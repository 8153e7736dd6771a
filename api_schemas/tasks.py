"""Policy versions, tasks, claims, leases and results."""

from __future__ import annotations

import base64
import datetime as dt
import math
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from api_schemas.common import JsonFloat, JsonInt, JsonObject, NoNul, StrictModel, Text, UtcTime

SHA256 = r"^[0-9a-f]{64}$"
# A proof's decoded size: its base64 (4/3 of it) and the rest of the result must fit the result
# route's default body limit (ORCH_LIMITS__MAX_RESULT_BODY_BYTES, 10 MiB): at 8 MiB the base64
# alone was 11.2 MB, so a proof the schema took was refused 413.
MAX_PROOF_BYTES = 7 * 1024 * 1024
SAMPLES_MAX = 1024  # samples per replica (Sampling.n)
CLAIM_MAX_TASKS = 100  # leases one claim may ask for (ClaimIn.max_tasks)


def _check_uri(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank")
    if value != value.strip():
        raise ValueError("must not begin or end with whitespace")
    return value


# Where workers fetch a checkpoint or shard from: handed to every worker as given.
# The bounds come before the validators, so that they are checked (and worded) as a string's.
Uri = Annotated[str, Field(min_length=1, max_length=2048), NoNul, AfterValidator(_check_uri)]
ErrorText = Annotated[str, Field(min_length=1, max_length=1000), NoNul]
# A vocabulary index, within the signed 64-bit range of every integer of the protocol: the feed
# and the dataset read signed bodies with orjson, which reads a larger integer as a float (the
# trainer got another token id) or not at all. The bound is ``lt=2**63``, not ``le=2**63 - 1``:
# the OpenAPI document writes bounds as floats, and 2^63 - 1 as a float is 2^63.
INT64_END = 2**63
TokenId = Annotated[JsonInt, Field(ge=-(2**63), lt=INT64_END)]


class Shard(StrictModel):
    uri: Uri
    sha256: str = Field(pattern=SHA256)
    bytes: int = Field(gt=0, le=10**13)


class PolicyIn(StrictModel):
    step: int = Field(ge=0, le=10**12, description="Training step; must be greater than the current step")
    uri: Uri = Field(description="Where workers fetch the checkpoint")
    sha256: str = Field(pattern=SHA256, description="SHA-256 of the whole checkpoint, lowercase hex")
    size: int = Field(gt=0, le=10**13, description="Checkpoint size in bytes")
    shards: list[Shard] | None = Field(
        default=None,
        min_length=1,
        max_length=10_000,
        description="Optional shard manifest: distinct URIs whose bytes add up to size",
    )

    @field_validator("shards")
    @classmethod
    def _shards_make_the_checkpoint(
        cls, shards: list[Shard] | None, info: ValidationInfo
    ) -> list[Shard] | None:
        if shards is None:
            return None
        seen: set[str] = set()
        for i, shard in enumerate(shards):
            if shard.uri in seen:
                raise ValueError(f"shard {i} repeats the URI of an earlier shard")
            seen.add(shard.uri)
        size = info.data.get("size")  # absent when size itself did not validate
        total = sum(shard.bytes for shard in shards)
        if size is not None and total != size:
            raise ValueError(f"the shards' bytes add up to {total}, not to size {size}")
        return shards


class ShardOut(BaseModel):
    """A stored manifest's shard, as published (one published before the rules above still lists)."""

    uri: str
    sha256: str
    bytes: int


class PolicyOut(BaseModel):
    pool_id: str
    step: int
    uri: str
    sha256: str
    size: int
    shards: list[ShardOut] | None
    created_at: dt.datetime


class Sampling(StrictModel):
    temperature: float = Field(default=1.0, ge=0, le=5)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1, le=100_000, description="-1: no top-k")
    max_tokens: int = Field(ge=1, le=1_000_000)
    n: int = Field(default=1, ge=1, le=SAMPLES_MAX, description="Samples per replica")


class TaskIn(StrictModel):
    prompt: Text | None = Field(default=None, min_length=1, max_length=1_000_000)
    problem_ref: Text | None = Field(
        default=None,
        min_length=1,
        max_length=500,
        description="Reference into a problem set the workers can resolve",
    )
    sampling: Sampling
    verification: JsonObject | None = Field(
        default=None,
        description="How the server checks results (e.g. expected answer); never shown to workers",
    )
    metadata: JsonObject | None = Field(default=None, description="Opaque to the server, shown to workers")
    replication: int | None = Field(
        default=None, ge=1, le=16, description="Default: the pool's replication factor"
    )
    priority: int = Field(default=0, ge=-1000, le=1000, description="Higher is leased first")
    canary: bool = Field(
        default=False,
        description="A task with a known answer that workers cannot tell apart; a wrong answer is fraud",
    )
    deadline_at: UtcTime | None = Field(
        default=None,
        description="With a UTC offset. After it the task is no longer leased, its results are refused "
        "(409 deadline_passed) and the lease reaper fails it",
    )

    @model_validator(mode="after")
    def _prompt_or_ref(self) -> TaskIn:
        if (self.prompt is None) == (self.problem_ref is None):
            raise ValueError("give exactly one of prompt and problem_ref")
        if self.canary and not self.verification:
            raise ValueError("a canary task needs a verification spec with its known answer")
        return self


class TaskBatchIn(StrictModel):
    batch_key: str = Field(
        min_length=1,
        max_length=100,
        pattern=r"^[A-Za-z0-9._:-]+$",
        description="Client key: re-sending the same batch has no further effect",
    )
    tasks: list[TaskIn] = Field(min_length=1, max_length=10_000)


class TaskBatchOut(BaseModel):
    batch_id: int
    batch_key: str
    pool_id: str
    task_count: int
    first_task_id: int
    created_at: dt.datetime


class ReplicaOut(BaseModel):
    replica_index: int
    status: str
    seed: int
    leases_issued: int
    expirations: int


class NodeAssignmentOut(BaseModel):
    """A lease as its node sees it (the answer to giving it back). It does not say which replica
    of its task the lease is: see ``Lease``."""

    id: str
    node_id: str
    status: str
    fencing_token: int
    policy_step: int
    lease_expires_at: dt.datetime
    created_at: dt.datetime
    ended_at: dt.datetime | None
    error: str | None = Field(
        default=None,
        description="What failed, when the node gave the lease back because the task failed on it",
    )


class AssignmentOut(NodeAssignmentOut):
    """A lease as an operator sees it, with the replica it is of."""

    replica_index: int


class ReleaseIn(StrictModel):
    """Optional body of a release. Without ``error`` (or without a body) the node gives the lease
    back for a reason of its own (it is stopping, say): the replica goes to another node and
    nothing counts against the task. With it, the task failed on this node."""

    error: ErrorText | None = Field(
        default=None,
        description="What went wrong running the task (a backend error). Such releases from nodes of "
        "the pool's max_failures different providers end the task failed (end_reason max_failures)",
    )


# Why a task ended failed or cancelled (TaskOut.end_reason).
EndReason = Literal[
    "cancelled", "max_attempts", "deadline_passed", "iteration_expired", "max_failures", "pool_completed"
]


class TaskOut(BaseModel):
    id: int
    pool_id: str
    batch_id: int
    status: str
    prompt: str | None
    problem_ref: str | None
    sampling: Sampling
    verification: dict[str, Any] | None
    metadata: dict[str, Any] | None
    replication: int
    priority: int
    deadline_at: dt.datetime | None
    canary: bool
    failure_reason: str | None = Field(description="why the task ended failed or cancelled, for people")
    end_reason: EndReason | None = Field(
        description="why the task ended failed or cancelled, for machines: an operator's cancel, a "
        "replica out of attempts (the pool's max_attempts), the task's deadline, the end of its "
        "ReST^EM iteration, the task failing on the nodes of the pool's max_failures providers, or "
        "the pool's completion (pool_completed: the task was still open)"
    )
    created_at: dt.datetime


class TaskDetailOut(TaskOut):
    replicas: list[ReplicaOut]
    assignments: list[AssignmentOut]


class EvidenceOut(BaseModel):
    """The exact signed request a result came in, as stored."""

    method: str
    target_uri: str
    signature_input: str
    signature: str
    signed_fields: list[tuple[str, str]] = Field(
        description="Each header line the signature covers, [name, value], as received"
    )
    body_sha256: str
    body_base64: str | None = Field(
        description="The signed body; only with ?include_body=true, and not once it was pruned"
    )
    pruned_at: dt.datetime | None = Field(
        default=None,
        description="When `orchestrator admin prune-evidence` archived the body and emptied it here "
        "(null: stored); the digest, signature and covered lines stay",
    )


class EvidenceCheckOut(BaseModel):
    """The stored request verified again, as at its receipt (the nonce aside)."""

    valid: bool
    keyid: str | None = Field(description="The signing key (the node id) when the signature verifies")
    code: str | None = Field(
        description="Why not: a signature error code, body_altered, signer_mismatch or evidence_pruned "
        "(the body was archived and emptied); null when valid"
    )
    detail: str | None


class SubmissionOut(BaseModel):
    id: int
    assignment_id: str
    replica_index: int
    node_id: str
    provider_id: str
    policy_step: int
    seed_echoed: int | None
    claimed_reward: float | None
    sample_count: int
    status: str
    received_at: dt.datetime
    evidence: EvidenceOut
    check: EvidenceCheckOut


class TaskSubmissionsOut(BaseModel):
    task_id: int
    submissions: list[SubmissionOut]


class ClaimIn(StrictModel):
    pool_id: Text = Field(min_length=1, max_length=40)
    max_tasks: int = Field(default=1, ge=1, le=CLAIM_MAX_TASKS)


# What ``task_id`` is in what a node reads (its leases, its results' answers, its verdicts).
NODE_TASK_REF = (
    "This node's reference for the task, not the task's id: an opaque integer in [0, 2^53), the "
    "same each time this node sees the task (a lease given back and leased again, the live lease "
    "list, the result's answer, the verdict), another for each other node, and in no order (it "
    "says nothing of the task's age). Operators' and trainers' APIs show the task's real id"
)


class LeasedTask(BaseModel):
    """What a worker needs to run one replica; the verification spec is never included. Nor is
    the task's id: task ids are sequential, and an audit replica of a task answered long ago would
    carry an id far below the fresh tasks' around it."""

    task_id: int = Field(description=NODE_TASK_REF)
    prompt: str | None
    problem_ref: str | None
    sampling: Sampling
    metadata: dict[str, Any] | None


class PolicyRef(BaseModel):
    step: int
    uri: str
    sha256: str


class Lease(BaseModel):
    """One replica leased to a node. Which replica of its task it is stays on the server: an audit
    adds a replica to a task of one, and a node that could tell its lease is one (replica_index
    1) would answer honestly only where its answer is compared with another node's."""

    assignment_id: str
    fencing_token: int = Field(description="Echo it with the result; a reissued lease has a new one")
    seed: int = Field(description="The sampling seed assigned by the coordinator")
    policy: PolicyRef
    lease_expires_at: dt.datetime
    task: LeasedTask


# A node holds at most max_leases_per_node (1,024 at most) in each pool it is a member of.
LIVE_LEASES_MAX = 10_000


class LeasesOut(BaseModel):
    """A node's live leases (active, within their deadline), oldest first, as its claims gave
    them, at most ``LIVE_LEASES_MAX``."""

    leases: list[Lease]


NoWorkReason = Literal[
    "no_tasks",
    "node_unhealthy",
    "not_a_member",
    "pool_paused",
    "pool_not_active",
    "lease_cap_reached",
    "no_policy",
    "node_failing",
]


class ClaimOut(BaseModel):
    leases: list[Lease]
    reason: NoWorkReason | None = Field(default=None, description="Why the list is empty")
    detail: str | None = None
    retry_after_s: int | None = Field(default=None, description="Also sent as Retry-After")


class Sample(StrictModel):
    completion: str | None = Field(
        default=None,
        max_length=4_000_000,
        description="The sample's text, which the server grades: a result with a sample without it "
        "(token_ids alone) is judged invalid (completion_missing), not paid",
    )
    token_ids: list[TokenId] | None = Field(
        default=None, max_length=1_000_000, description="Optional, beside the text (for the trainer)"
    )
    finish_reason: str = Field(
        min_length=1, max_length=32, description="stop | length (others are rejected later)"
    )
    prompt_tokens: int = Field(ge=0, le=10_000_000)
    completion_tokens: int = Field(ge=0, le=10_000_000)
    logprob_summary: (
        dict[Annotated[str, StringConstraints(min_length=1, max_length=64)], JsonFloat] | None
    ) = Field(
        default=None,
        max_length=64,
        description="Up to 64 named statistics (names of 1 to 64 characters), e.g. mean and min",
    )

    @field_validator("logprob_summary")
    @classmethod
    def _finite(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and not all(math.isfinite(v) for v in value.values()):
            raise ValueError("logprob summary values must be finite")
        return value


class ResultIn(StrictModel):
    fencing_token: int = Field(ge=1, lt=INT64_END, description="The lease's, as the claim gave it")
    policy_step: int = Field(
        ge=0, lt=INT64_END, description="The policy step the samples were generated with"
    )
    seed: int = Field(
        ge=-(2**63), lt=INT64_END, description="The seed from the lease, echoed (a signed 64-bit integer)"
    )
    samples: list[Sample] = Field(min_length=1, max_length=1024)
    claimed_reward: float | None = Field(default=None, allow_inf_nan=False)
    proof: str | None = Field(
        default=None,
        max_length=MAX_PROOF_BYTES * 4 // 3 + 4,
        description="Optional proof blob (e.g. TOPLOC), standard base64",
    )

    @field_validator("proof")
    @classmethod
    def _base64(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                raw = base64.b64decode(value, validate=True)
            except ValueError as exc:
                raise ValueError("proof must be standard base64") from exc
            if len(raw) > MAX_PROOF_BYTES:
                raise ValueError(f"proof is larger than {MAX_PROOF_BYTES} bytes")
        return value


class ResultOut(BaseModel):
    submission_id: int
    assignment_id: str
    task_id: int = Field(description=NODE_TASK_REF)
    status: str = Field(description="pending: recorded, awaiting verification")
    received_at: dt.datetime


class LeaseStatsOut(BaseModel):
    node_id: str
    claimed: int = Field(description="Leases the node was given in this pool, whatever became of them")
    submitted: int = Field(description="Answered with a result")
    expired: int = Field(
        description="Ran out unanswered (also when given back late, or when the node was found "
        "dead); each is an attempt towards the pool's max_attempts"
    )
    released: int = Field(description="Given back in time: by the node, or when its membership ended")
    failed: int = Field(
        description="Given back by the node saying the task failed on it (also counted as released, "
        "or as expired when given back past the lease's deadline)",
    )
    last_expired_at: dt.datetime | None = Field(description="When the latest of them expired")
