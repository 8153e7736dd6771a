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


class RolloutChangeOut(BaseModel):
    """A notice that a rollout's standing changed: for a trainer that took it from the feed (its
    ``verdict_id`` is at or before the trainer's place in the feed). One past that place needs
    nothing: the feed serves it, or not, as it stands when it is read."""

    cursor: str = Field(description="Resume point just after this notice (pass as ?after=)")
    change_id: int
    change: Literal["reversed", "withdrawn", "restored"] = Field(
        description="What happened: the rollout's verdict was reversed on appeal; a fraud verdict "
        "against its node withdrew it (decided within its hold window); that fraud verdict was "
        "reversed, so it stands again unless something else keeps it out"
    )
    cause_verdict_id: int | None = Field(description="The fraud verdict, for `withdrawn` and `restored`")
    changed_at: dt.datetime
    verdict_id: int = Field(description="The rollout's accepted verdict, as in the feed's items")
    submission_id: int
    task_id: int
    node_id: str
    stands: bool = Field(
        description="Whether the rollout counts as accepted now, as this page was read: not "
        "reversed and withdrawn by no standing fraud verdict. Act on this, not on `change`: "
        "notices of racing changes may commit in either order, and every notice read after the "
        "last change of a rollout gives its true standing. False: drop what you took of it; "
        "true: take `rollout` if you had dropped it."
    )
    rollout: Rollout | None = Field(
        description="When it stands: the rollout as the feed serves it (null if its evidence was "
        "pruned since, or it does not stand)"
    )


class RolloutChangePage(BaseModel):
    items: list[RolloutChangeOut]
    next_cursor: str | None = Field(
        description="Pass as ?after= for the next page; at the end still given (the last "
        "position), so polling with it returns only newer notices. Null only when there are none "
        "and no cursor was passed."
    )
    has_more: bool = Field(description="More notices exist after this page right now")
