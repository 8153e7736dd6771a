"""Matching a node's hardware against a pool's requirements (OR of AND-rules).

Requirements are ``{"any_of": [rule, ...]}``; a node qualifies when it meets every check of
at least one rule. An empty ``any_of`` means no hardware requirement. When no rule is met,
the report says, for each alternative, which checks failed, with what was required and what
the node has, so a refused contributor knows what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api_schemas.pools import HardwareRule, Requirements
from orchestrator.identity.models import Node


@dataclass(frozen=True)
class FailedCheck:
    rule: str
    required: Any
    actual: Any

    def describe(self) -> str:
        if self.rule == "gpu_models":
            wanted = ", ".join(map(repr, self.required))
            if self.actual is None:
                return f"the node has no GPU; the pool wants one of {wanted}"
            return f"GPU model {self.actual!r} is not one of {wanted}"
        return f"{self.rule} is {self.required}, the node has {self.actual}"

    def as_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "required": self.required, "actual": self.actual}


def failed_checks(rule: HardwareRule, node: Node) -> list[FailedCheck]:
    failed: list[FailedCheck] = []
    if rule.gpu_models is not None:
        accepted = {m.casefold() for m in rule.gpu_models}
        if node.gpu_model is None or node.gpu_model.casefold() not in accepted:
            failed.append(FailedCheck("gpu_models", list(rule.gpu_models), node.gpu_model))
    if node.gpu_count < rule.min_gpu_count:
        failed.append(FailedCheck("min_gpu_count", rule.min_gpu_count, node.gpu_count))
    if node.gpu_memory_mb < rule.min_gpu_memory_mb:
        failed.append(FailedCheck("min_gpu_memory_mb", rule.min_gpu_memory_mb, node.gpu_memory_mb))
    if node.ram_mb < rule.min_ram_mb:
        failed.append(FailedCheck("min_ram_mb", rule.min_ram_mb, node.ram_mb))
    return failed


@dataclass(frozen=True)
class Unmet:
    """Why no alternative was met: the failed checks of each, in order."""

    alternatives: list[list[FailedCheck]]

    def describe(self) -> str:
        parts = [
            f"alternative {i + 1}: " + "; ".join(check.describe() for check in failed)
            for i, failed in enumerate(self.alternatives)
        ]
        return "the node meets none of the pool's hardware alternatives (" + " | ".join(parts) + ")"

    def as_list(self) -> list[dict[str, Any]]:
        return [
            {"alternative": i + 1, "failed": [check.as_dict() for check in failed]}
            for i, failed in enumerate(self.alternatives)
        ]


def unmet_requirements(requirements: dict[str, Any], node: Node) -> Unmet | None:
    """None when the node qualifies; otherwise what failed in each alternative."""
    rules = Requirements.model_validate(requirements).any_of
    if not rules:
        return None
    report: list[list[FailedCheck]] = []
    for rule in rules:
        failed = failed_checks(rule, node)
        if not failed:
            return None
        report.append(failed)
    return Unmet(report)
