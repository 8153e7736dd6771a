"""End to end: the demo swarm against the real coordinator, on this run's database and hot store."""

from __future__ import annotations

import pytest

from orchestrator.demo.behaviours import KINDS
from orchestrator.demo.swarm import DemoConfig, run_demo
from tests.conftest import REDIS_URL


# The demo stops once every task is done and every cheater caught (about 20 s on a quiet
# machine); its duration is only the bound, long enough for a machine running other suites.
@pytest.mark.timeout(240)
async def test_the_demo_catches_every_cheater_and_pays_only_honest_work(database_url: str) -> None:
    config = DemoConfig(
        duration_s=150,
        honest=4,
        dishonest=len(KINDS),
        seed=11,
        tasks=60,
        database_url=database_url,
        redis_url=REDIS_URL,
    )
    summary = await run_demo(config)
    kinds = summary["kinds"]
    assert set(kinds) == {"honest", *KINDS}
    for kind in KINDS:
        assert kinds[kind]["caught"] is True, (kind, kinds[kind])
    assert summary["honest_nodes_slashed"] == 0
    assert summary["fraudulent_submissions_paid"] == 0
    assert summary["ledger_sum"] == 0 and summary["negative_balances"] == 0
    assert kinds["honest"]["accepted"] > 0 and kinds["honest"]["rewards"] > 0
    assert kinds["forger"]["ejected"] == 1 and kinds["forger"]["slashed"] > 0
    assert kinds["copier"]["slashed"] > 0
    assert kinds["lazy"]["rewards"] == 0 and kinds["lazy"]["slashed"] == 0  # soft: not paid, not slashed
    # The spoofer's two tricks are both refused: signing as another node, and answering a lease
    # another node holds (the squatter's, which stay live unanswered).
    assert {"signature_invalid", "assignment_not_found"} <= set(kinds["spoofer"]["refused"]), kinds["spoofer"]
    assert summary["tasks"].get("completed", 0) == summary["tasks"]["total"]
    feed = summary["trainer_feed"]
    assert feed["rollouts"] == summary["accepted"] > 0
    assert feed["only_accepted"] and feed["all_accepted_present"] and feed["in_order"]
