"""Verdicts, appeals, pool statistics and the validator API."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel, Field

from api_schemas.common import StrictModel, Text
from api_schemas.pools import MembershipStatus
from api_schemas.tasks import INT64_END


class VerdictOut(BaseModel):
    id: int
    submission_id: int
    task_id: int = Field(
        description="The task's id; in a node's or provider's own verdicts (/v1/nodes/me/verdicts, "
        "/v1/providers/me/verdicts), the node's reference for the task, as its lease named it: an "
        "opaque integer that says nothing of the task's age, another for each node"
    )
    pool_id: str
    node_id: str
    provider_id: str
    outcome: str = Field(description="accepted | rejected")
    category: str = Field(description="valid | invalid | fraud | inconclusive")
    reason: str = Field(
        description=(
            "Stable reason code, e.g. verified, wrong_answer, seed_mismatch, reward_forged, "
            "canary_failed, quorum_minority, no_quorum, quorum_timeout (a tie-break replica nobody "
            "took within verifier.quorum_wait_s), task_abandoned"
        )
    )
    verifier: str = Field(description="checks | reward | quorum | validator")
    details: dict[str, Any]
    server_reward: float | None
    reward_amount: int = Field(
        description="What the verdict credited when it was decided: an accepted result's reward "
        "(taken back if the verdict is reversed); 0 for a rejection"
    )
    reward_paid_on_appeal: int = Field(
        default=0,
        description="A fraud or invalid verdict reversed on appeal: the reward the appeal paid, what an "
        "acceptance would have (the rate recorded with the result x the samples its checks found right "
        "or could not score), held as that acceptance's reward would have been: to the end of the "
        "result's own hold window (reward_hold_s from this verdict's decided_at; due at once if that "
        "has passed), and forfeited by a fraud verdict against the node decided within it (see "
        "reward_forfeited_by), or in part by a soft-invalid penalty decided within it, for what it would "
        "have taken of that reward on hold, oldest first; 0 otherwise (an inconclusive verdict's appeal "
        "pays nothing)",
    )
    reward_forfeited_by: int | None = Field(
        default=None,
        description="A verdict whose appeal paid a reward: the fraud verdict against the same node, "
        "decided within the result's own hold window, that forfeited the payment at once, as it would "
        "have forfeited the reward had the result been accepted (all of it, or what soft-invalid "
        "penalties decided before it left; the money went to the system's "
        "slashed account; that verdict's appeal gives it back to the provider, and this field still "
        "names it). Null if no fraud verdict forfeited it when the appeal paid it",
    )
    slashed_amount: int
    decided_at: dt.datetime
    reversed_at: dt.datetime | None
    reversal_reason: str | None
    withdrawn_by: int | None = Field(
        default=None,
        description="An accepted verdict withdrawn by a fraud verdict (its id) against the same node, "
        "decided within this one's hold window: its reward is forfeited and its rollout is no longer "
        "in the trainer feed, its export or ReST^EM datasets and solve rates. A verdict rejected as "
        "`wrong_answer` is withdrawn the same way, from ReST^EM solve rates. Null again if that "
        "verdict is reversed on appeal",
    )


class PenaltyPart(BaseModel):
    """What a soft-invalid penalty took of the reward an appeal paid."""

    verdict_id: int = Field(description="The invalid verdict whose soft_invalid_penalty took it")
    amount: int = Field(description="How much it took (what it holds now, if status is forfeited)")
    status: Literal["forfeited", "restored", "returned"] = Field(
        description="forfeited: in force (the money is in the system's slashed account); restored: "
        "given back to the provider (that verdict was reversed on appeal, or a later appeal of an "
        "older rejection moved the part onto its own payment, the reward the penalty would have "
        "taken it from); returned: went back to the system"
    )


class ReversalOut(VerdictOut):
    """The verdict, as an appeal left it, and the sanctions of its node and provider now."""

    reward_penalised: list[PenaltyPart] = Field(
        default_factory=list,
        description="A verdict whose appeal paid a reward (reward_paid_on_appeal): the soft-invalid "
        "penalties of the node decided within the result's hold window that took part of that "
        "payment (when the appeal paid it, or later while it was on hold), oldest first, as they "
        "stand now; a fraud verdict's part is named by reward_forfeited_by. Empty otherwise",
    )
    membership_status: MembershipStatus | None = Field(
        description="The node's membership in the pool now (null if it has none): `left` again when "
        "the appeal of a fraud verdict lifted the verifier's ejection (the node's strikes are below "
        "the pool's `strikes_before_ejection`; it may join again, with new stake); an operator's or a "
        "ban's ejection stays `ejected`"
    )
    provider_blacklisted: bool = Field(
        description="Whether the provider is blacklisted from the pool now: the appeal of a fraud "
        "verdict removes the verifier's blacklisting once the provider's strikes in the pool are below "
        "`strikes_before_provider_ban`; an operator's stays"
    )


class ReverseIn(StrictModel):
    reason: Text = Field(min_length=1, max_length=500, description="Why the verdict is reversed (kept)")


class PlacementOut(BaseModel):
    """A task's replicas go to distinct providers and distinct addresses: with the members there
    are now, at most min(providers, addresses) replicas of one task can be leased."""

    healthy_members: int = Field(description="Active members whose node is healthy")
    providers: int = Field(description="Distinct providers among them")
    addresses: int = Field(description="Distinct addresses among them (an IPv6 address by its /64)")
    open_tasks_beyond_members: int = Field(
        description="Open tasks with more replicas than min(providers, addresses): their other "
        "replicas are not leased until more providers or addresses join"
    )


class PoolStatsOut(BaseModel):
    pool_id: str
    verdicts: int
    by_category: dict[str, int]
    acceptance_rate: float | None = Field(description="valid / all verdicts not reversed")
    fraud_rate: float | None = Field(description="fraud / all verdicts not reversed")
    rewards_credited: int = Field(
        description="What the pool's verdicts not reversed credited to providers (ledger units), "
        "held and released alike, including any that later verdicts forfeited; what the pool's "
        "economics.reward_budget counts"
    )
    reward_budget: int | None = Field(
        default=None, description="The pool's economics.reward_budget; null for no budget"
    )
    reward_budget_remaining: int | None = Field(
        default=None,
        description="reward_budget less rewards_credited, never below 0 (work leased before the "
        "budget's pause may take the spend past it); null for no budget",
    )
    slashed: int = Field(
        description="Stake slashed and pending rewards forfeited by the pool's verdicts not reversed "
        "(fraud, and the soft-invalid penalty), in ledger units; a forfeited reward whose own "
        "verdict was reversed since went back to the system and is not counted"
    )
    tasks_by_status: dict[str, int]
    placement: PlacementOut


class ValidationClaimIn(StrictModel):
    pool_id: Text | None = Field(
        default=None, max_length=40, description="Only this pool (default: all in scope)"
    )
    max_jobs: int = Field(
        default=1,
        ge=1,
        le=50,
        description="At most this many jobs; fewer when their results add up to more than "
        "ORCH_LIMITS__MAX_RESULT_BODY_BYTES (10 MiB by default; the first job whatever its size)",
    )
    lease_s: int = Field(
        default=300,
        ge=30,
        le=3600,
        description="How long the leases last; extend one with POST /v1/validation/jobs/{id}/extend",
    )


class ValidationExtendIn(StrictModel):
    fencing_token: int = Field(ge=1, lt=INT64_END, description="The lease's, as the claim gave it")
    lease_s: int = Field(
        default=300,
        ge=30,
        le=3600,
        description=(
            "The lease now runs out this long from now, but no later than 3600 s past the job's "
            "wait for validators (the server's ORCH_VERIFIER__VALIDATOR_WAIT_S, from when the job "
            "was made): the answer's lease_expires_at says when it runs out"
        ),
    )


class ValidationLeaseOut(BaseModel):
    job_id: int
    fencing_token: int
    lease_expires_at: dt.datetime


class ValidationJobOut(BaseModel):
    job_id: int
    fencing_token: int
    lease_expires_at: dt.datetime
    pool_id: str
    submission_id: int
    node_id: str
    task: dict[str, Any] = Field(description="prompt or problem_ref, sampling, and the verification spec")
    policy_step: int
    seed: int
    result: dict[str, Any] = Field(description="The signed result body exactly as the node sent it")


class ValidationClaimOut(BaseModel):
    jobs: list[ValidationJobOut]


class ToplocEvidence(StrictModel):
    exponent_mismatches: int | None = Field(default=None, ge=0, le=128, description="Of the top-128 values")
    mantissa_error_mean: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    mantissa_error_median: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    notes: str | None = Field(default=None, max_length=2000)


class ValidatorVerdictIn(StrictModel):
    fencing_token: int = Field(ge=1, lt=INT64_END, description="The lease's, as the claim gave it")
    outcome: Literal["valid", "invalid", "fraud"]
    reason: str = Field(
        min_length=1,
        max_length=64,
        pattern=r"^[a-z0-9_]+$",
        description="A code (a-z, 0-9 and _), e.g. toploc_ok or toploc_mismatch",
    )
    evidence: ToplocEvidence = Field(default_factory=ToplocEvidence)


class ValidatorVerdictOut(BaseModel):
    job_id: int
    verdict: VerdictOut
