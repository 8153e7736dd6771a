"""Pools, memberships, invites and blacklists: request and response models.

A pool's settings come in groups (``requirements``, ``caps``, ``economics``, ``policy``).
Creating a pool takes the groups with defaults; ``PATCH`` takes any subset of any group and
the merged result is validated again as a whole (cross-field rules included).
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Callable
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from api_schemas.common import KeyId, StrictModel, Text
from api_schemas.tasks import SAMPLES_MAX

AMOUNT_MAX = 10**15  # the ledger's largest single amount
# A result's reward (reward_per_sample x its correct samples, up to SAMPLES_MAX) is one transfer.
REWARD_PER_SAMPLE_MAX = AMOUNT_MAX // SAMPLES_MAX
REWARD_BUDGET_MAX = 2**63 - 1  # the ledger's largest balance
DAY_S = 86_400

# ------------------------------------------------------------------ enums


class PoolStatus(enum.StrEnum):
    pending = "pending"
    active = "active"
    paused = "paused"
    completed = "completed"


class Admission(enum.StrEnum):
    open = "open"
    approval = "approval"
    invite = "invite"


class MembershipStatus(enum.StrEnum):
    pending = "pending"
    active = "active"
    left = "left"
    ejected = "ejected"
    rejected = "rejected"


# ------------------------------------------------------------------ requirements

GpuModelName = Annotated[
    str,
    Field(
        min_length=1, max_length=100, pattern=r"^[A-Za-z0-9 ._()+/-]+$", examples=["NVIDIA H100 80GB HBM3"]
    ),
]


class HardwareRule(StrictModel):
    """One alternative: a node meets it when it meets every rule in it."""

    gpu_models: list[GpuModelName] | None = Field(
        default=None,
        min_length=1,
        max_length=32,
        description="GPU models accepted, as the driver reports them (compared case-insensitively); "
        "null accepts any model, including none.",
    )
    min_gpu_count: int = Field(default=0, ge=0, le=64, description="Minimum number of GPUs")
    min_gpu_memory_mb: int = Field(
        default=0, ge=0, le=1_048_576, description="Minimum memory per GPU, in MiB"
    )
    min_ram_mb: int = Field(default=0, ge=0, le=16_777_216, description="Minimum system RAM, in MiB")

    @model_validator(mode="after")
    def _distinct_models(self) -> HardwareRule:
        if self.gpu_models is not None and len({m.casefold() for m in self.gpu_models}) != len(
            self.gpu_models
        ):
            raise ValueError("gpu_models must not repeat a model")
        return self


class Requirements(StrictModel):
    any_of: list[HardwareRule] = Field(
        default_factory=list,
        max_length=16,
        description="Hardware alternatives; a node must meet at least one. Empty: no hardware requirement.",
    )


# ------------------------------------------------------------------ field types shared by create/patch

MaxNodes = Annotated[
    int | None,
    Field(ge=1, le=1_000_000, description="Most nodes (active + pending) in the pool; null for no cap"),
]
MaxPerProvider = Annotated[
    int | None,
    Field(ge=1, le=1_000_000, description="Most nodes (active + pending) of one provider; null for no cap"),
]
MaxPerIp = Annotated[
    int | None,
    Field(
        ge=1,
        le=1_000_000,
        description="Most nodes (active + pending) registered from one IP address; null for no cap",
    ),
]
MinStake = Annotated[
    int,
    Field(
        ge=0,
        le=AMOUNT_MAX,
        description="Stake (integer, smallest unit) locked from the provider's free stake for each "
        "node that joins; 0 for none",
    ),
]
RewardPerSample = Annotated[
    int,
    Field(
        ge=0,
        le=REWARD_PER_SAMPLE_MAX,
        description="Reward (integer, smallest unit) per accepted sample; at most 10^15 / 1024, so that "
        "the reward of a result of up to 1024 samples fits the ledger's largest transfer (10^15)",
    ),
]
RewardHold = Annotated[
    int,
    Field(
        ge=0,
        le=90 * DAY_S,
        description="Seconds an earned reward stays pending (and slashable) before it becomes claimable",
    ),
]
RewardBudget = Annotated[
    int | None,
    Field(
        ge=1,
        le=REWARD_BUDGET_MAX,
        description="Most the pool's verdicts may credit in rewards (integer, smallest unit, as "
        "reward_per_sample), counted as GET /v1/admin/pools/{id}/stats counts rewards_credited (net "
        "of verdicts reversed on appeal); once they have credited this much the pool is paused "
        "(status_reason budget_spent) at the reward_budget loop's next check, once a second. Work "
        "leased before the pause is still judged and paid, so the pool may spend past it by what "
        "was in flight. null (the default): no budget",
    ),
]
SoftPenalty = Annotated[
    int,
    Field(
        ge=0,
        le=AMOUNT_MAX,
        description="Amount forfeited from the node's rewards still on hold in this pool (oldest "
        "first, at most what is on hold) when one of its results is invalid (an honest failure such "
        "as a wrong answer), beyond withholding its reward; given back if the verdict is reversed on "
        "appeal; 0 for none",
    ),
]
FraudSlash = Annotated[
    int,
    Field(
        ge=0,
        le=AMOUNT_MAX,
        description="Stake slashed for proven fraud; at most min_stake_per_node (what a membership locks)",
    ),
]
StrikesEject = Annotated[
    int, Field(ge=1, le=1000, description="Strikes (invalid results) after which a node is ejected")
]
StrikesBan = Annotated[
    int,
    Field(
        ge=1,
        le=10_000,
        description="Strikes across a provider's nodes after which the provider is blacklisted from the "
        "pool; at least strikes_before_ejection",
    ),
]
Unbonding = Annotated[
    int,
    Field(
        ge=0,
        le=365 * DAY_S,
        description="Seconds stake stays unbonding after a leave or an ejection before it is free again",
    ),
]
LeaseDuration = Annotated[
    int, Field(ge=10, le=7 * DAY_S, description="Seconds a task lease lasts unless heartbeats extend it")
]
MaxLease = Annotated[
    int,
    Field(
        ge=10,
        le=30 * DAY_S,
        description="Seconds a lease may last from its claim, however its heartbeats extend it (at "
        "least lease_duration_s; a day by default): past it the lease runs out like any other (an "
        "attempt; the replica is reissued), so a node cannot hold a task for ever by beating",
    ),
]
MaxAttempts = Annotated[
    int,
    Field(
        ge=1,
        le=100,
        description="Expired leases of one replica (run out, or their node died) before the task "
        "is given up as failed; a lease given back in time is no attempt",
    ),
]
MaxFailures = Annotated[
    int,
    Field(
        ge=1,
        le=100,
        description="Providers whose nodes gave a lease of the task back saying it failed on them "
        "(a release with an error), at as many different addresses, before the task is given up "
        "as failed",
    ),
]
RetakeExpiredAfter = Annotated[
    int | None,
    Field(
        ge=0,
        le=30 * DAY_S,
        description="Seconds after a node's lease of a task expired (it ran out, or the node died) "
        "before that node may lease the same replica again, with the same seed, whenever it is "
        "available (no other node holds or has answered it); each expiry is still an attempt. "
        "null (the default): never, so one node cannot use up a task's max_attempts alone. For "
        "pools of one or a few nodes, where a worker down longer than lease_duration_s would "
        "otherwise strand the tasks it held",
    ),
]
Replication = Annotated[
    int,
    Field(
        ge=1,
        le=16,
        description="Replicas of each task, on different providers and IPs; at most caps.max_nodes",
    ),
]
AuditFloor = Annotated[
    float,
    Field(ge=0.0, le=1.0, description="Lowest fraction of results sent to expensive verification"),
]
MaxAsyncLevel = Annotated[
    int,
    Field(
        ge=0,
        le=64,
        description="Staleness bound: results for a policy more than this many versions old are refused",
    ),
]
MaxLeases = Annotated[int, Field(ge=1, le=1024, description="Most leases one node may hold at a time")]
CANARY_WINDOW_MAX = 100
CanaryMissLimit = Annotated[
    int,
    Field(
        ge=1,
        le=CANARY_WINDOW_MAX,
        description="A canary task sampled at a temperature and answered with no right sample is "
        "judged as any wrong answer (invalid: not paid, the soft penalty) unless it makes this many "
        "misses among the node's last canary_window canary results in the pool, when it is fraud "
        "(canary_failed); at most canary_window. A canary decoded greedily (temperature 0 or top_k "
        "1) is fraud at its first miss",
    ),
]
CanaryWindow = Annotated[
    int,
    Field(
        ge=1,
        le=CANARY_WINDOW_MAX,
        description="How many of the node's latest canary results in the pool (the server scored "
        "them, and their verdicts stand) canary_miss_limit counts misses among, the one being "
        "judged included",
    ),
]


# Validation context for settings read back from the database: a pool's reward function was
# known when it was set, and its plugin being uninstalled since must not fail every view of the
# pool (the public listing included); a change to the pool still names it.
STORED: dict[str, bool] = {"stored": True}


def _known_reward_function(name: str, info: ValidationInfo) -> str:
    from orchestrator.verification.rewards import available

    if info.context and info.context.get("stored"):
        return name
    if name not in available():
        raise ValueError(f"unknown reward function {name!r}; available: {', '.join(available())}")
    return name


RewardFunctionName = Annotated[
    str,
    Field(
        min_length=1, max_length=64, description="Server-side reward function: exact_match, math or a plugin"
    ),
    AfterValidator(_known_reward_function),
]
RequireProof = Annotated[bool, Field(description="Refuse (as invalid) results that carry no proof blob")]
AuditMethod = Annotated[
    Literal["replicate", "validator"],
    Field(description="Audits add a replica (quorum) or go to trusted validators (e.g. TOPLOC)"),
]
PoolName = Annotated[
    str, Field(min_length=1, max_length=100, pattern=r"^[\x20-\x7e]+$", description="Printable ASCII name")
]
PoolDescription = Annotated[
    Text | None, Field(max_length=2000, description="Free text shown to contributors")
]
AdmissionField = Annotated[
    Admission,
    Field(
        description="open: auto-accept when requirements and stake are met; approval: an operator "
        "approves each join; invite: a single-use invite code is needed"
    ),
]


class Caps(StrictModel):
    max_nodes: MaxNodes = None
    max_nodes_per_provider: MaxPerProvider = None
    max_nodes_per_ip: MaxPerIp = None


class Economics(StrictModel):
    min_stake_per_node: MinStake = 0
    reward_per_sample: RewardPerSample = 0
    reward_hold_s: RewardHold = DAY_S
    reward_budget: RewardBudget = None
    soft_invalid_penalty: SoftPenalty = 0
    fraud_slash_amount: FraudSlash = 0
    strikes_before_ejection: StrikesEject = 3
    strikes_before_provider_ban: StrikesBan = 10
    unbonding_period_s: Unbonding = 7 * DAY_S

    @model_validator(mode="after")
    def _consistent(self) -> Economics:
        if self.fraud_slash_amount > self.min_stake_per_node:
            raise ValueError("fraud_slash_amount must not exceed min_stake_per_node")
        if self.strikes_before_provider_ban < self.strikes_before_ejection:
            raise ValueError("strikes_before_provider_ban must be at least strikes_before_ejection")
        return self


class PublicPolicy(StrictModel):
    """The policy knobs a contributor needs to know (the audit rate stays with the operator:
    a worker that knows how rarely it is checked can price cheating)."""

    lease_duration_s: LeaseDuration = 600
    max_lease_s: MaxLease = DAY_S
    max_attempts: MaxAttempts = 3
    max_failures: MaxFailures = 3
    retake_expired_after_s: RetakeExpiredAfter = None
    replication_factor: Replication = 1
    max_async_level: MaxAsyncLevel = 2
    max_leases_per_node: MaxLeases = 1
    reward_function: RewardFunctionName = "exact_match"
    require_proof: RequireProof = False

    @model_validator(mode="after")
    def _lease_within_its_maximum(self) -> PublicPolicy:
        if self.max_lease_s < self.lease_duration_s:
            raise ValueError(
                f"max_lease_s ({self.max_lease_s}) must be at least lease_duration_s "
                f"({self.lease_duration_s}); raise max_lease_s with it"
            )
        return self


class Policy(PublicPolicy):
    """The operator's view of the policy: with how results are audited and how canary misses
    are judged (a worker that knew these could price cheating)."""

    audit_rate_floor: AuditFloor = 0.05
    audit_method: AuditMethod = "replicate"
    canary_miss_limit: CanaryMissLimit = 3
    canary_window: CanaryWindow = 10

    @model_validator(mode="after")
    def _canary_limit_within_its_window(self) -> Policy:
        if self.canary_miss_limit > self.canary_window:
            raise ValueError(
                f"canary_miss_limit ({self.canary_miss_limit}) must be at most canary_window "
                f"({self.canary_window}): it counts misses among that many canary results"
            )
        return self


class PoolSettings(StrictModel):
    """Everything an operator configures; validated as a whole on create and after every PATCH."""

    name: PoolName
    description: PoolDescription = None
    admission: AdmissionField = Admission.open
    requirements: Requirements = Field(default_factory=Requirements, description="Hardware requirements")
    caps: Caps = Field(default_factory=Caps, description="Sybil friction: node caps")
    economics: Economics = Field(
        default_factory=Economics, description="Stake, rewards, penalties and strikes"
    )
    policy: Policy = Field(default_factory=Policy, description="Task scheduling and verification knobs")

    @model_validator(mode="after")
    def _replicas_fit(self) -> PoolSettings:
        cap = self.caps.max_nodes
        if cap is not None and self.policy.replication_factor > cap:
            raise ValueError("policy.replication_factor must not exceed caps.max_nodes")
        return self


class PoolCreate(PoolSettings):
    """A new pool starts ``pending``; activate it to open it to nodes."""


def _described_like(source: type[BaseModel]) -> Callable[[dict[str, Any]], None]:
    """For PATCH models: document each optional field with the description of the field it
    changes (an ``X | None`` field would otherwise carry it only inside ``anyOf``), and offer
    null only where that field takes it: its ``| None`` means "omitted", and the merged
    settings refuse a null for any other field (422)."""

    def extra(schema: dict[str, Any]) -> None:
        for name, prop in schema.get("properties", {}).items():
            field = source.model_fields.get(name)
            if field is None:
                continue
            if field.description and not prop.get("description"):
                prop["description"] = field.description + ". Omit to keep the current value."
            if type(None) not in get_args(field.annotation) and "anyOf" in prop:
                branches = [b for b in prop.pop("anyOf") if b.get("type") != "null"]
                if len(branches) == 1:
                    prop.update({k: v for k, v in branches[0].items() if k not in prop})
                else:
                    prop["anyOf"] = branches

    return extra


class CapsPatch(StrictModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_described_like(Caps))

    max_nodes: MaxNodes = None
    max_nodes_per_provider: MaxPerProvider = None
    max_nodes_per_ip: MaxPerIp = None


class EconomicsPatch(StrictModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_described_like(Economics))

    min_stake_per_node: MinStake | None = None
    reward_per_sample: RewardPerSample | None = None
    reward_hold_s: RewardHold | None = None
    reward_budget: RewardBudget = None
    soft_invalid_penalty: SoftPenalty | None = None
    fraud_slash_amount: FraudSlash | None = None
    strikes_before_ejection: StrikesEject | None = None
    strikes_before_provider_ban: StrikesBan | None = None
    unbonding_period_s: Unbonding | None = None


class PolicyPatch(StrictModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_described_like(Policy))

    lease_duration_s: LeaseDuration | None = None
    max_lease_s: MaxLease | None = None
    max_attempts: MaxAttempts | None = None
    max_failures: MaxFailures | None = None
    retake_expired_after_s: RetakeExpiredAfter = None
    replication_factor: Replication | None = None
    audit_rate_floor: AuditFloor | None = None
    max_async_level: MaxAsyncLevel | None = None
    max_leases_per_node: MaxLeases | None = None
    reward_function: RewardFunctionName | None = None
    require_proof: RequireProof | None = None
    audit_method: AuditMethod | None = None
    canary_miss_limit: CanaryMissLimit | None = None
    canary_window: CanaryWindow | None = None


class PoolPatch(StrictModel):
    """Only the fields present change; ``requirements`` is replaced as a whole. Caps may be set
    to null (no cap), and so may ``economics.reward_budget`` (no budget) and
    ``policy.retake_expired_after_s`` (never); other fields may not. Stake already locked by
    members is unaffected, and results already received are judged and paid by the
    max_async_level, require_proof, reward_per_sample, the penalties, the hold and the canary
    rule in force when they came in. A new ``economics.reward_budget`` applies at the budget
    loop's next check: below what is spent, it pauses the pool; above it, it does not resume a
    pool it paused (the operator resumes it)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_described_like(PoolSettings))

    name: PoolName | None = None
    description: PoolDescription = None
    admission: AdmissionField | None = None
    requirements: Requirements | None = Field(default=None, description="Replaces the requirements")
    caps: CapsPatch | None = Field(default=None, description="Caps to change")
    economics: EconomicsPatch | None = Field(default=None, description="Economics to change")
    policy: PolicyPatch | None = Field(default=None, description="Policy knobs to change")

    def changes(self) -> dict[str, Any]:
        """The fields the caller sent (explicit nulls included), nested like ``PoolSettings``."""
        return self.model_dump(mode="json", exclude_unset=True)


# ------------------------------------------------------------------ pool responses


class PublicPoolOut(BaseModel):
    """What contributors see: terms and requirements, nothing about the operator."""

    id: str = Field(description="Pool id: 'pool_' + 16 hex characters")
    name: str = Field(description="Display name")
    description: str | None = Field(description="Free text from the operator")
    status: PoolStatus = Field(description="pending | active | paused | completed")
    admission: Admission = Field(description="open | approval | invite")
    requirements: Requirements = Field(description="Hardware requirements")
    caps: Caps = Field(description="Node caps")
    economics: Economics = Field(description="Stake, rewards, penalties and strikes")
    policy: PublicPolicy = Field(description="Task scheduling knobs")
    members: int = Field(description="Nodes in the pool now (active + pending)")
    created_at: dt.datetime = Field(description="When the pool was created")


class PoolOut(PublicPoolOut):
    """The operator's view of a pool."""

    policy: Policy = Field(description="Task scheduling and verification knobs")
    owner_token_id: str = Field(description="The token that created the pool and may administer it")
    active_members: int = Field(description="Active members")
    pending_members: int = Field(description="Members waiting for approval")
    status_changed_at: dt.datetime = Field(description="When the status last changed")
    status_reason: Literal["budget_spent"] | None = Field(
        default=None,
        description="Why the pool is in its status when the system put it there: budget_spent, "
        "paused because its verdicts credited economics.reward_budget; null otherwise (an "
        "operator's pause). Cleared by the next change of status",
    )
    rewards_credited: int = Field(
        default=0,
        description="What the pool's verdicts not reversed credited to providers (ledger units), "
        "as in its stats: what economics.reward_budget counts",
    )
    reward_budget_remaining: int | None = Field(
        default=None,
        description="economics.reward_budget less rewards_credited, never below 0 (work leased "
        "before a pause may take the spend past the budget); null without a budget",
    )
    updated_at: dt.datetime = Field(description="When anything last changed")


# ------------------------------------------------------------------ membership


class JoinIn(StrictModel):
    invite_code: str | None = Field(
        default=None,
        min_length=8,
        max_length=100,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Needed for pools with invite admission (single use); ignored by other pools",
    )


class MembershipOut(BaseModel):
    pool_id: str = Field(description="The pool")
    node_id: KeyId = Field(description="The member node")
    provider_id: KeyId = Field(description="The node's provider")
    status: MembershipStatus = Field(description="pending | active | left | ejected | rejected")
    episode: int = Field(description="1 on the first join, +1 on every join after a leave or rejection")
    stake: int = Field(
        description="Stake locked by this episode's join (after it ends: returned, or unbonding)"
    )
    reason: str | None = Field(description="Why it ended, for rejected, ejected or left by an operator")
    joined_at: dt.datetime = Field(description="When this episode's join was accepted or queued")
    activated_at: dt.datetime | None = Field(description="When this episode became active")
    ended_at: dt.datetime | None = Field(description="When this episode ended")
    failure_streak: int = Field(
        default=0, description="Leases the node gave back as failed here since its last result"
    )
    failing_until: dt.datetime | None = Field(
        default=None,
        description="Claims here are refused (node_failing) until then: three failures in a row "
        "keep the node out for 60 s, doubled with each further one, up to an hour",
    )


class TrackRecordOut(BaseModel):
    """A node's verdicts in the pool that stand (a verdict reversed on appeal no longer counts)."""

    valid: int = Field(description="Valid verdicts")
    invalid: int = Field(description="Invalid and inconclusive verdicts")
    fraud: int = Field(description="Fraud verdicts")
    strikes: int = Field(description="Fraud strikes (strikes_before_ejection ejects the node)")
    consecutive_valid: int = Field(
        description="Verified valid verdicts since the last rejected one; the audit rate is "
        "max(audit_rate_floor, 1 / (1 + consecutive_valid))"
    )


class MemberOut(MembershipOut):
    track_record: TrackRecordOut = Field(
        description="The node's verdicts in the pool, over all its episodes (zeros before its first)"
    )


class RefusalReason(BaseModel):
    """One unmet rule of a refused join (listed in the problem's ``reasons``)."""

    code: str = Field(
        description="pool_not_active | node_ejected | provider_blacklisted | requirements_unmet | "
        "invite_required | invite_invalid | pool_full | provider_cap | ip_cap | stake_insufficient"
    )
    detail: str = Field(description="Human-readable explanation")
    alternatives: list[dict[str, Any]] | None = Field(
        default=None,
        description="For requirements_unmet: each hardware alternative with the checks it failed "
        "({rule, required, actual})",
    )
    required: int | None = Field(default=None, description="For stake_insufficient: the stake needed")


# ------------------------------------------------------------------ operator actions


class ReasonIn(StrictModel):
    reason: Text = Field(min_length=1, max_length=500, description="Why; kept on the membership and audited")


class RejectIn(StrictModel):
    reason: Text | None = Field(
        default=None, min_length=1, max_length=500, description="Why; kept on the membership and audited"
    )


class InviteIn(StrictModel):
    expires_in_s: int = Field(
        default=7 * DAY_S, ge=60, le=90 * DAY_S, description="Seconds until the invite code expires"
    )


class InviteOut(BaseModel):
    id: str = Field(description="Invite id ('inv_' + 16 hex), for the audit log")
    pool_id: str = Field(description="The pool the code admits to")
    code: str = Field(description="The single-use code; shown only now, only its SHA-256 is stored")
    expires_at: dt.datetime = Field(description="When the code stops working")


class BlacklistIn(StrictModel):
    provider_id: KeyId = Field(description="The provider to shut out of the pool")
    reason: Text = Field(min_length=1, max_length=500, description="Why; audited")


class BlacklistOut(BaseModel):
    pool_id: str = Field(description="The pool")
    provider_id: KeyId = Field(description="The blacklisted provider")
    reason: str = Field(description="Why it was blacklisted")
    created_at: dt.datetime = Field(description="When it was blacklisted")
    removed_nodes: list[KeyId] = Field(
        description="Nodes of the provider that this call removed from the pool (empty on a repeat)"
    )
