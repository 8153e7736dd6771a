"""The demo's scoreboard, read from the database (not from what the workers believe)."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from sqlalchemy import func, select

from orchestrator.core.state import AppState
from orchestrator.demo.behaviours import Worker
from orchestrator.ledger.models import LedgerAccount
from orchestrator.pools.models import Pool, PoolMembership
from orchestrator.tasks.models import Assignment, Task
from orchestrator.verification.models import Verdict

# How each kind of cheater is caught: by a verdict the coordinator recorded, or by a refusal
# it answered with.
# Fraud is caught when its verdict slashed the cheater and the strikes ejected it.
EJECTED_WHEN_CAUGHT = {"forger", "copier"}
CAUGHT_BY = {
    "forger": ("verdict", {"reward_forged"}),
    "copier": ("verdict", {"seed_mismatch"}),
    "lazy": ("verdict", {"wrong_answer"}),
    "replayer": ("refusal", {"nonce_replayed"}),
    "stale": ("refusal", {"policy_stale"}),
    "spoofer": ("refusal", {"signature_invalid", "assignment_not_found"}),
    "squatter": ("expired", set()),
}
PAID_CHEATS = {"forger", "copier", "lazy"}


async def summarise(
    state: AppState, pool_id: str, workers: list[Worker], *, elapsed: float, final: bool = False
) -> dict[str, Any]:
    kind_of = {w.client.node_id: w.kind for w in workers}
    async with state.sessionmaker() as session:
        tasks = dict(
            (
                await session.execute(
                    select(Task.status, func.count()).where(Task.pool_id == pool_id).group_by(Task.status)
                )
            ).all()
        )
        verdicts = list((await session.execute(select(Verdict).where(Verdict.pool_id == pool_id))).scalars())
        ejected = {
            m.node_id: m.ended_at
            for m in (
                await session.execute(
                    select(PoolMembership).where(
                        PoolMembership.pool_id == pool_id, PoolMembership.status == "ejected"
                    )
                )
            ).scalars()
        }
        expired = dict(
            (
                await session.execute(
                    select(Assignment.node_id, func.count())
                    .where(Assignment.pool_id == pool_id, Assignment.status == "expired")
                    .group_by(Assignment.node_id)
                )
            ).all()
        )
        strike_limit = int(
            await session.scalar(select(Pool.strikes_before_ejection).where(Pool.id == pool_id)) or 0
        )
        ledger_sum = int(await session.scalar(select(func.coalesce(func.sum(LedgerAccount.balance), 0))) or 0)
        negative = int(
            await session.scalar(
                select(func.count())
                .select_from(LedgerAccount)
                .where(LedgerAccount.allow_negative.is_(False), LedgerAccount.balance < 0)
            )
            or 0
        )

    by_node: dict[str, list[Verdict]] = defaultdict(list)
    for v in verdicts:
        by_node[v.node_id].append(v)
    kinds: dict[str, dict[str, Any]] = {}
    for w in workers:
        k = kinds.setdefault(
            w.kind,
            {
                "nodes": 0,
                "submitted": 0,
                "accepted": 0,
                "rejected": Counter(),
                "refused": Counter(),
                "rewards": 0,
                "slashed": 0,
                "ejected": 0,
                "expired_leases": 0,
                "frauds_before_ejection": [],
                "fraud_verdicts": 0,
            },
        )
        mine = by_node.get(w.client.node_id, [])
        k["nodes"] += 1
        k["submitted"] += w.log.submitted
        k["accepted"] += sum(v.outcome == "accepted" for v in mine)
        k["rejected"].update(v.reason for v in mine if v.outcome == "rejected")
        k["refused"].update(w.log.refused)
        k["rewards"] += sum(v.reward_amount for v in mine)
        k["slashed"] += sum(v.slashed_amount for v in mine)
        k["expired_leases"] += int(expired.get(w.client.node_id, 0))
        if w.client.node_id in ejected:
            k["ejected"] += 1
            # The strike that ejected it; results it had already sent may add fraud verdicts after.
            frauds = sum(v.category == "fraud" for v in mine)
            k["frauds_before_ejection"].append(min(frauds, strike_limit))
            k["fraud_verdicts"] += frauds
    for name, k in kinds.items():
        k["caught"] = _caught(name, k)
        k["rejected"] = dict(k["rejected"])
        k["refused"] = dict(k["refused"])

    honest_nodes = {n for n, kind in kind_of.items() if kind == "honest"}
    summary = {
        "elapsed_s": round(elapsed, 1),
        "final": final,
        "pool_id": pool_id,
        "tasks": {"total": sum(tasks.values()), **{s: int(n) for s, n in tasks.items()}},
        "verdicts": len(verdicts),
        "accepted": sum(v.outcome == "accepted" for v in verdicts),
        "rejected_by_reason": dict(Counter(v.reason for v in verdicts if v.outcome == "rejected")),
        "rewards_paid": sum(v.reward_amount for v in verdicts),
        "stake_slashed": sum(v.slashed_amount for v in verdicts),
        "cheaters_ejected": sum(k["ejected"] for name, k in kinds.items() if name != "honest"),
        "honest_nodes_slashed": sum(
            1
            for n in honest_nodes
            if any(v.slashed_amount > 0 or v.category == "fraud" for v in by_node.get(n, []))
        ),
        "fraudulent_submissions_paid": sum(
            1 for v in verdicts if kind_of.get(v.node_id) in PAID_CHEATS and v.reward_amount > 0
        ),
        "accepted_verdict_ids": sorted(
            v.id for v in verdicts if v.outcome == "accepted" and v.reversed_at is None
        ),
        "ledger_sum": ledger_sum,
        "negative_balances": negative,
        "kinds": kinds,
    }
    return summary


def _caught(kind: str, k: dict[str, Any]) -> bool | None:
    if kind == "honest":
        return None
    how, codes = CAUGHT_BY[kind]
    if how == "verdict":
        judged = bool(codes & set(k["rejected"])) and k["accepted"] == 0 and k["rewards"] == 0
        return judged and (kind not in EJECTED_WHEN_CAUGHT or k["ejected"] > 0)
    if how == "refusal":
        return bool(codes & set(k["refused"]))
    return int(k["expired_leases"]) > 0
