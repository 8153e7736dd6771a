"""ReST^EM iterations (arXiv 2312.06585): sample, verify, keep at most K correct per problem."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from api_schemas.common import JsonObject, StrictModel, Text, UtcTime

IterationStatus = Literal["running", "complete", "expired"]


class RestemSampling(StrictModel):
    """Sampling for every problem; the defaults are the paper's (temperature 0.7, top-k 40).
    The number of samples is ``samples_per_problem``, not a field here."""

    temperature: float = Field(default=0.7, ge=0, le=5)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=40, ge=-1, le=100_000, description="-1: no top-k")
    max_tokens: int = Field(default=1024, ge=1, le=1_000_000)


class ProblemIn(StrictModel):
    problem_id: Text = Field(min_length=1, max_length=200, description="Your id; unique in the iteration")
    prompt: Text | None = Field(default=None, min_length=1, max_length=1_000_000)
    problem_ref: Text | None = Field(default=None, min_length=1, max_length=500)
    verification: JsonObject = Field(
        min_length=1,
        description='How the server checks a sample (e.g. {"answer": "4"}); never shown to workers',
    )
    metadata: JsonObject | None = Field(
        default=None, description="Shown to workers, kept with the tasks; `restem` is added by the server"
    )

    @model_validator(mode="after")
    def _prompt_or_ref(self) -> ProblemIn:
        if (self.prompt is None) == (self.problem_ref is None):
            raise ValueError("give exactly one of prompt and problem_ref")
        return self


class IterationIn(StrictModel):
    name: Text = Field(min_length=1, max_length=100, description="Unique in the pool")
    problems: list[ProblemIn] = Field(min_length=1, max_length=10_000)
    samples_per_problem: int = Field(
        default=32, ge=1, le=1024, description="N: samples per problem (the paper: 32 for MATH)"
    )
    sampling: RestemSampling = Field(default_factory=RestemSampling)
    policy_step: int = Field(
        ge=0,
        le=10**12,
        description="Must be the pool's current policy step; results from other steps are excluded",
    )
    keep_correct: int = Field(default=10, ge=1, le=1024, description="K: correct samples kept per problem")
    replication: int = Field(
        default=1,
        ge=1,
        le=16,
        description="Replicas per problem task; 1 by default, since the server checks every answer itself",
    )
    deadline_at: UtcTime | None = Field(
        default=None, description="The iteration expires here if not every problem is verified by then"
    )

    @model_validator(mode="after")
    def _unique_problem_ids(self) -> IterationIn:
        seen: set[str] = set()
        for p in self.problems:
            if p.problem_id in seen:
                raise ValueError(f"problem_id {p.problem_id!r} appears twice")
            seen.add(p.problem_id)
        return self


class IterationProgress(BaseModel):
    problems: int
    problems_done: int = Field(
        description="Problems whose task is finished (every result has a verdict); of an expired "
        "iteration, as it expired: every result with a verdict it counts (decided by the deadline)"
    )
    samples_requested: int = Field(description="problems x samples_per_problem")
    results_received: int = Field(description="Signed results submitted for the iteration's tasks")
    results_verified: int = Field(
        description="Of those, the ones with a verdict (of an expired iteration, one it counts)"
    )


class IterationOut(BaseModel):
    id: int
    pool_id: str
    name: str
    status: IterationStatus
    policy_step: int
    samples_per_problem: int
    keep_correct: int
    sampling: RestemSampling
    batch_id: int | None
    created_at: dt.datetime
    deadline_at: dt.datetime | None
    finished_at: dt.datetime | None = Field(
        description="complete: when the last verdict was decided; expired: the deadline"
    )
    progress: IterationProgress


class ProblemReport(BaseModel):
    problem_id: str
    task_id: int
    task_status: str = Field(
        description="The task's status now: of an expired iteration, a task whose result was "
        "judged after the expiry still becomes `completed`, though nothing of it counts"
    )
    verified_samples: int = Field(
        description="Samples the server checked with the iteration's policy: accepted results, and "
        "results rejected only because no sample was right"
    )
    correct_samples: int
    solve_rate: float | None = Field(description="correct / verified; null when nothing was verified")
    kept_samples: int = Field(
        description="min(correct - pruned_correct, keep_correct): what the dataset holds"
    )
    off_policy_samples: int = Field(description="Generated with another policy step: excluded")
    discarded_samples: int = Field(
        description="Results rejected for another reason, reversed, withdrawn by a fraud verdict "
        "against their node, or decided after the deadline"
    )
    unchecked_samples: int = Field(
        description="Accepted samples without a server reward: the problem's verification spec gives "
        "the pool's reward function nothing to check against (e.g. no `answer`). Not in the solve "
        "rate or the dataset"
    )
    pruned_correct_samples: int = Field(
        description="Correct samples whose result's evidence `orchestrator admin prune-evidence` "
        "archived: counted in the solve rate, not in the dataset (the archive holds them)"
    )
    pending_results: int = Field(description="Results still waiting for a verdict")


class ReportTotals(BaseModel):
    problems: int
    problems_done: int = Field(description="As the iteration's progress counts it")
    problems_solved: int = Field(description="Problems with at least one correct sample")
    verified_samples: int
    correct_samples: int
    solve_rate: float | None = Field(description="All correct samples / all verified samples")
    mean_problem_solve_rate: float | None = Field(
        description="The mean of the per-problem solve rates, over problems with verified samples"
    )
    dataset_size: int
    off_policy_samples: int
    discarded_samples: int
    unchecked_samples: int
    pruned_correct_samples: int
    pending_results: int


class IterationReport(BaseModel):
    iteration_id: int
    status: IterationStatus
    policy_step: int
    keep_correct: int
    totals: ReportTotals
    problems: list[ProblemReport]
