"""The trainer feed: accepted rollouts, in acceptance order, with the server's rewards."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel, Field

from api_schemas.tasks import Sampling

VerifiedBy = Literal["server", "quorum", "validator"]


class FeedTask(BaseModel):
    """The task a rollout answers. The hidden verification spec is not included: the trainer
    gets the server's reward instead (operators read the spec through the tasks API)."""

    task_id: int
    prompt: str | None
    problem_ref: str | None
    sampling: Sampling
    metadata: dict[str, Any] | None
    canary: bool = Field(description="A known-answer task used to catch cheats; trainers may skip these")


class RolloutSample(BaseModel):
    index: int = Field(description="Position of the sample in the signed result")
    completion: str | None
    token_ids: list[int] | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprob_summary: dict[str, float] | None
    reward: float | None = Field(
        description="The server's reward for this sample (the verdict's mean when the verdict has "
        "no per-sample rewards); null when the task has nothing to check against"
    )


class Rollout(BaseModel):
    """One accepted result (a group of samples for one task replica)."""

    cursor: str = Field(description="Resume point just after this rollout (pass as ?after=)")
    verdict_id: int
    submission_id: int
    node_id: str
    policy_step: int = Field(description="The policy step the samples were generated with")
    seed: int | None = Field(description="The seed the coordinator assigned (echoed by the worker)")
    reward: float | None = Field(description="The server's reward for the result: mean over samples")
    verified_by: VerifiedBy | None = Field(
        description="Who checked the result before it was accepted: the server against the task's "
        "hidden answer, a quorum of other providers' replicas, or a validator; null when nobody did "
        "(a task with nothing to check against whose audit was not drawn or was skipped), which "
        "trainers may weigh or skip"
    )
    accepted_at: dt.datetime
    task: FeedTask
    samples: list[RolloutSample]


class RolloutPage(BaseModel):
    items: list[Rollout]
    next_cursor: str | None = Field(
        description="Pass as ?after= for the next page; at the end of the feed it is still given "
        "(the last position), so polling with it returns only newer rollouts. Null only when the "
        "feed is empty and no cursor was passed."
    )
    has_more: bool = Field(description="More accepted rollouts exist after this page right now")
