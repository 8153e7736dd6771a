"""The verification pipeline: checks, server rewards, verdicts and the money they move."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from typing import Any

import pytest
from sqlalchemy import select

from orchestrator.core.clock import FakeClock
from orchestrator.core.keys import generate_key, key_id_of
from orchestrator.ledger.jobs import release_once as stake_release_once
from orchestrator.ledger.models import LedgerTransfer
from orchestrator.tasks.models import Submission
from orchestrator.verification import scoring, service
from orchestrator.verification.jobs import release_once, verify_once
from orchestrator.verification.models import Verdict, VerificationJob
from tests.conftest import postgres_only, problem
from tests.scoring_helpers import Gate
from tests.tasks_helpers import pool_setup, task
from tests.verification_helpers import (
    FixedDraw,
    balances,
    books_balance,
    submit,
    track_record,
    verdicts,
    verify_all,
)
from tests.waits import HANG_S, sqlite_write_lock_held

ECON = {
    "min_stake_per_node": 1000,
    "reward_per_sample": 7,
    "reward_hold_s": 3600,
    "fraud_slash_amount": 200,
    "strikes_before_ejection": 3,
    "strikes_before_provider_ban": 5,
}


pytestmark = pytest.mark.usefixtures("no_audits")


async def one_lease(s: Any, worker: Any, **task_args: Any) -> dict[str, Any]:
    await s.enqueue([task(**task_args)], key=f"k{random.random()}")
    leases = (await worker.claim(s.pool_id)).json()["leases"]
    assert leases, "expected a lease"
    return dict(leases[0])


async def test_a_correct_result_earns_pending_then_claimable_reward(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        lease = await one_lease(s, w, n=2)
        await submit(w, lease, ["4", "4"], claimed_reward=1.0)
        assert await verify_all(app_state) == 1
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["outcome"], v["category"], v["reason"], v["verifier"]) == (
            "accepted",
            "valid",
            "verified",
            "reward",
        )
        assert v["server_reward"] == 1.0 and v["reward_amount"] == 14
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"], b["stake_locked"]) == (14, 0, 1000)
        clock.advance(1800)
        assert await release_once(app_state) == 0
        clock.advance(1831)
        assert await release_once(app_state) == 1
        b = await balances(client, w)
        assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 14)
        await books_balance(app_state)


async def test_an_honest_wrong_answer_is_invalid_without_slash(app: Any, app_state: Any, client: Any) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        await submit(w, await one_lease(s, w), ["5"], claimed_reward=0.0)
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["outcome"], v["category"], v["reason"]) == ("rejected", "invalid", "wrong_answer")
        assert v["reward_amount"] == 0 and v["slashed_amount"] == 0
        b = await balances(client, w)
        assert (b["rewards_pending"], b["stake_locked"]) == (0, 1000)


async def test_a_forged_reward_claim_is_fraud_and_slashed_with_evidence(
    app: Any, app_state: Any, client: Any
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        # First an honest, paid result, still in its hold window ...
        await submit(w, await one_lease(s, w), ["4"])
        await verify_all(app_state)
        assert (await balances(client, w))["rewards_pending"] == 7
        # ... then a wrong answer claimed as correct.
        await submit(w, await one_lease(s, w), ["5"], claimed_reward=1.0)
        await verify_all(app_state)
        v = (await verdicts(s.admin, s.headers, s.pool_id))[-1]
        assert (v["outcome"], v["category"], v["reason"]) == ("rejected", "fraud", "reward_forged")
        assert v["slashed_amount"] == 200 + 7
        assert any(f["code"] == "reward_forged" for f in v["details"]["findings"])
        b = await balances(client, w)
        assert (b["stake_locked"], b["rewards_pending"], b["rewards_claimable"]) == (800, 0, 0)
        async with app_state.sessionmaker() as session:
            slashes = list(
                (
                    await session.execute(
                        select(LedgerTransfer).where(
                            LedgerTransfer.reference_type == "verdict",
                            LedgerTransfer.reference_id == str(v["id"]),
                        )
                    )
                ).scalars()
            )
        assert sorted(t.reason for t in slashes) == ["slash_pending_rewards", "slash_stake"]
        await books_balance(app_state)


@pytest.mark.parametrize(
    ("overrides", "answers", "reason", "category"),
    [
        ({"seed": 12345}, ["4"], "seed_mismatch", "fraud"),
        ({"claimed_reward": 3.0}, ["4"], "claim_out_of_bounds", "fraud"),
        ({}, ["4", "4"], "sample_count", "invalid"),
        (
            {
                "samples": [
                    {
                        "completion": "4",
                        "finish_reason": "stop",
                        "prompt_tokens": 1,
                        "completion_tokens": 9999,
                    }
                ]
            },
            ["4"],
            "token_overflow",
            "invalid",
        ),
        (
            {
                "samples": [
                    {"completion": "4", "finish_reason": "abort", "prompt_tokens": 1, "completion_tokens": 3}
                ]
            },
            ["4"],
            "finish_reason",
            "invalid",
        ),
    ],
)
async def test_sanity_checks(
    app: Any,
    app_state: Any,
    client: Any,
    overrides: dict[str, Any],
    answers: list[str],
    reason: str,
    category: str,
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        await submit(w, await one_lease(s, w), answers, **overrides)
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["outcome"], v["category"], v["reason"]) == ("rejected", category, reason)
        assert v["reward_amount"] == 0
        assert (await balances(client, w))["stake_locked"] == (800 if category == "fraud" else 1000)


async def test_a_pool_that_requires_proofs_rejects_results_without_one(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1, require_proof=True) as s:
        w = s.workers[0]
        await submit(w, await one_lease(s, w), ["4"])
        await submit(w, await one_lease(s, w), ["4"], proof="AAEC")
        await verify_all(app_state)
        first, second = await verdicts(s.admin, s.headers, s.pool_id)
        assert (first["category"], first["reason"]) == ("invalid", "proof_missing")
        assert second["category"] == "valid"


async def test_math_answers_are_checked_for_equivalence(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1, reward_function="math") as s:
        w = s.workers[0]
        lease = await one_lease(s, w, prompt="What is 1/2?", verification={"answer": "\\frac{1}{2}"})
        await submit(w, lease, ["The answer is $\\boxed{0.5}$"], claimed_reward=1.0)
        lease = await one_lease(s, w, prompt="What is 1/3?", verification={"answer": "\\frac{1}{3}"})
        await submit(w, lease, ["The answer is $\\boxed{0.5}$"], claimed_reward=0.0)
        await verify_all(app_state)
        right, wrong = await verdicts(s.admin, s.headers, s.pool_id)
        assert right["category"] == "valid" and right["server_reward"] == 1.0
        assert (wrong["category"], wrong["reason"]) == ("invalid", "wrong_answer")


async def test_an_honest_worker_is_paid_not_slashed_for_a_right_answer_to_a_bare_latex_gold(
    app: Any, app_state: Any
) -> None:
    """A gold of ``2\\sqrt{2}`` was read as 2: the right answer scored 0, so the worker's honest
    claimed reward of 1 was judged forged (fraud), and a bare 2 was paid."""
    async with pool_setup(app, app_state, workers=1, reward_function="math") as s:
        w = s.workers[0]
        lease = await one_lease(s, w, prompt="sqrt(8)?", verification={"answer": "2\\sqrt{2}"})
        await submit(w, lease, ["The answer is $\\boxed{2\\sqrt{2}}$"], claimed_reward=1.0)
        lease = await one_lease(s, w, prompt="sqrt(8)?", verification={"answer": "2\\sqrt{2}"})
        await submit(w, lease, ["The answer is $\\boxed{2}$"], claimed_reward=0.0)
        await verify_all(app_state)
        right, wrong = await verdicts(s.admin, s.headers, s.pool_id)
        assert (right["category"], right["server_reward"]) == ("valid", 1.0), right["reason"]
        assert (wrong["category"], wrong["reason"]) == ("invalid", "wrong_answer")


async def test_a_claim_below_the_server_reward_is_not_fraud(app: Any, app_state: Any, client: Any) -> None:
    """A worker that grades its own answers with a stricter grader than the pool's claims less
    than the server finds: ``0.5`` for a gold of ``\\frac{1}{2}`` is right by ``math`` and wrong
    by an exact match. Such a claim gains nothing (the server pays by its own reward), yet it
    was judged forged: the right answer went unpaid, the node slashed and struck. Only a claim
    above the server's reward is a lie told for gain."""
    async with pool_setup(app, app_state, workers=1, reward_function="math", economics=ECON, stake=1000) as s:
        w = s.workers[0]
        lease = await one_lease(s, w, n=2, prompt="What is 1/2?", verification={"answer": "\\frac{1}{2}"})
        await submit(w, lease, ["\\boxed{0.5}", "\\boxed{\\frac{1}{2}}"], claimed_reward=0.5)
        lease = await one_lease(s, w, n=2, prompt="What is 1/3?", verification={"answer": "\\frac{1}{3}"})
        await submit(w, lease, ["\\boxed{0.5}", "\\boxed{\\frac{1}{3}}"], claimed_reward=1.0)
        await verify_all(app_state)
        under, over = await verdicts(s.admin, s.headers, s.pool_id)
        assert (under["category"], under["reason"], under["reward_amount"]) == ("valid", "verified", 14)
        assert under["slashed_amount"] == 0
        assert (over["category"], over["reason"]) == ("fraud", "reward_forged")  # claimed 1, is 0.5
        assert (await track_record(s, w))["strikes"] == 1


async def test_an_answer_too_costly_to_score_is_inconclusive_and_holds_up_nothing(
    app: Any, app_state: Any
) -> None:
    """SymPy would compute 9^(9^9) for minutes: the scoring process is killed at the limit, the
    result is inconclusive (no reward, no penalty: the limit may be the verifier's own, under
    load), and the honest result behind it is decided too."""
    app_state.settings.verifier.reward_timeout_s = 2
    econ = {**ECON, "soft_invalid_penalty": 5}
    async with pool_setup(app, app_state, workers=1, reward_function="math", economics=econ, stake=1000) as s:
        w = s.workers[0]
        lease = await one_lease(s, w, prompt="What is 6 * 7?", verification={"answer": "42"})
        await submit(w, lease, ["The answer is $\\boxed{42}$"], claimed_reward=1.0)
        assert await verify_all(app_state) == 1
        assert (await balances(s.admin, w))["rewards_pending"] == 7
        lease = await one_lease(s, w, prompt="What is 6 * 7?", verification={"answer": "42"})
        await submit(w, lease, ["The answer is $\\boxed{9^{9^{9}}}$"], claimed_reward=0.0)
        lease = await one_lease(s, w, prompt="What is 1/2?", verification={"answer": "\\frac{1}{2}"})
        await submit(w, lease, ["The answer is $\\boxed{0.5}$"], claimed_reward=1.0)
        assert await verify_all(app_state) == 2  # minutes, were the scoring not stopped at its limit
        _, bomb, honest = await verdicts(s.admin, s.headers, s.pool_id)
        assert (bomb["category"], bomb["reason"]) == ("inconclusive", "reward_unscorable")
        assert "longer than 2 s" in bomb["details"]["findings"][0]["detail"]  # stopped at its limit
        assert bomb["slashed_amount"] == 0 and bomb["reward_amount"] == 0
        assert honest["category"] == "valid" and honest["server_reward"] == 1.0
        after = await balances(s.admin, w)
        assert after["rewards_pending"] == 14 and after["stake_locked"] == 1000  # nothing taken


async def test_scoring_holds_no_write_lock_on_sqlite(app: Any, app_state: Any, gate: Gate) -> None:
    """Every SQLite transaction holds the one write lock: a batch scores its results before it
    opens its transaction, so a result whose scoring goes on (up to the limit) holds up no
    write. The results here are held in scoring until the write is done: a write that waited
    for the scoring would never be."""
    app_state.settings.verifier.reward_timeout_s = 600
    async with pool_setup(app, app_state, workers=1, reward_function="gated") as s:
        w = s.workers[0]
        for _ in range(2):
            lease = await one_lease(s, w, verification={"answer": "42", **gate.spec})
            await submit(w, lease, ["42"], claimed_reward=1.0)
        verifier = asyncio.create_task(verify_all(app_state))
        await gate.scoring_started()
        r = await asyncio.wait_for(s.enqueue([task()], key="meanwhile"), HANG_S)
        assert r.status_code == 201, r.text
        assert not verifier.done()  # still scoring: the write did not wait for it
        gate.open()
        assert await verifier == 2


async def test_unknown_reward_functions_are_refused(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state) as s:
        r = await s.admin.patch(
            f"/v1/admin/pools/{s.pool_id}", json={"policy": {"reward_function": "vibes"}}, headers=s.headers
        )
        assert r.status_code == 422 and "vibes" in r.text


async def test_a_canary_with_one_wrong_sample_of_several_is_not_fraud_and_none_right_is(
    app: Any, app_state: Any
) -> None:
    """Honest sampling at a temperature misses some samples of a problem the policy solves: one
    wrong sample of four on a canary was fraud (stake slashed, a strike). It is judged as on any
    task; a canary with no sample right is a miss (fraud at once here, its pool allowing none)."""
    policy = {"canary_miss_limit": 1, "canary_window": 1}
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000, **policy) as s:
        w = s.workers[0]
        lease = await one_lease(s, w, canary=True, n=4)
        await submit(w, lease, ["4", "4", "5", "4"])
        lease = await one_lease(s, w, canary=True, n=4)
        await submit(w, lease, ["5", "6", "5", "3"])
        await verify_all(app_state)
        mostly, none = await verdicts(s.admin, s.headers, s.pool_id)
        assert (mostly["category"], mostly["reward_amount"]) == ("valid", 3 * ECON["reward_per_sample"])
        assert (none["category"], none["reason"]) == ("fraud", "canary_failed")


async def test_a_wrong_answer_on_a_greedy_canary_is_fraud(app: Any, app_state: Any) -> None:
    """(More in test_canaries.py: a canary sampled at a temperature may be missed.)"""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        lease = await one_lease(s, w, canary=True, sampling={"max_tokens": 64, "temperature": 0})
        assert "canary" not in str(lease)
        await submit(w, lease, ["5"])
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["category"], v["reason"]) == ("fraud", "canary_failed")


async def test_a_result_sent_as_token_ids_alone_is_invalid_not_graded_as_empty(
    app: Any, app_state: Any, client: Any
) -> None:
    """A sample may carry token ids without its text, but the server grades text and has no
    tokenizer: such a sample was graded as the empty text, so on a canary no answer was right,
    fraud, and the stake slashed. The result is accepted as sent and judged invalid
    (``completion_missing``: not paid, not slashed), and no reward function reads a text it
    was not given."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        lease = await one_lease(s, w, canary=True)
        sample = {"token_ids": [19], "finish_reason": "stop", "prompt_tokens": 10, "completion_tokens": 1}
        await submit(w, lease, ["4"], samples=[sample])
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["outcome"], v["category"], v["reason"]) == ("rejected", "invalid", "completion_missing")
        assert v["reward_amount"] == 0 and v["server_reward"] is None
        assert "no completion text (the server grades text" in v["details"]["findings"][0]["detail"]
        assert (await balances(client, w))["stake_locked"] == 1000


async def _quorum(
    s: Any, answers: list[str], verification: dict[str, Any] | None, sampling: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """One task answered by the first len(answers) workers; greedy decoding unless ``sampling``
    says otherwise (replicas decoding greedily must agree)."""
    tasks = [
        {
            "prompt": "Name the capital of France.",
            "sampling": sampling or {"max_tokens": 64, "temperature": 0},
            **({"verification": verification} if verification else {}),
        }
    ]
    await s.enqueue(tasks, key=f"q{random.random()}")
    for worker, answer in zip(s.workers[: len(answers)], answers, strict=True):
        lease = (await worker.claim(s.pool_id)).json()["leases"][0]
        await submit(worker, lease, [answer])
    return [lease]


async def test_quorum_of_three_that_agrees_accepts_all(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=3, replication_factor=3) as s:
        await _quorum(s, ["Paris", "Paris", "Paris"], None)
        await verify_all(app_state)
        vs = await verdicts(s.admin, s.headers, s.pool_id)
        assert [(v["category"], v["verifier"]) for v in vs] == [("valid", "quorum")] * 3


@pytest.mark.parametrize("greedy", [{"temperature": 0}, {"top_k": 1}], ids=["temperature-0", "top-k-1"])
async def test_quorum_minority_is_fraud_when_the_server_cannot_check(
    app: Any, app_state: Any, greedy: dict[str, Any]
) -> None:
    """Replicas decoding greedily must agree whatever their seeds: an answer outvoted is made up."""
    async with pool_setup(app, app_state, workers=3, replication_factor=3, economics=ECON, stake=1000) as s:
        await _quorum(s, ["Paris", "Lyon", "Paris"], None, {"max_tokens": 64, **greedy})
        await verify_all(app_state)
        vs = {v["node_id"]: v for v in await verdicts(s.admin, s.headers, s.pool_id)}
        liar = s.workers[1].node_id
        assert (vs[liar]["category"], vs[liar]["reason"]) == ("fraud", "quorum_minority")
        assert all(v["category"] == "valid" for n, v in vs.items() if n != liar)


@pytest.mark.parametrize(
    "sampling",
    [{"max_tokens": 64}, {"max_tokens": 64, "temperature": 0.7, "top_k": 40}, {"max_tokens": 64, "top_k": 2}],
    ids=["default-temperature", "restem-sampling", "top-k-2"],
)
async def test_a_sampled_replica_outvoted_is_unpaid_but_not_slashed(
    app: Any, app_state: Any, client: Any, sampling: dict[str, Any]
) -> None:
    """Replicas sample with seeds of their own: at a temperature an honest node may rightly answer
    otherwise than the two others. Outvoted, it is not paid (``invalid``, ``quorum_minority``),
    but nothing shows it cheated: it was slashed as fraud, struck, and in the end ejected."""
    async with pool_setup(app, app_state, workers=3, replication_factor=3, economics=ECON, stake=1000) as s:
        await _quorum(s, ["Paris", "Lyon", "Paris"], None, sampling)
        await verify_all(app_state)
        vs = {v["node_id"]: v for v in await verdicts(s.admin, s.headers, s.pool_id)}
        outvoted = s.workers[1]
        assert (vs[outvoted.node_id]["category"], vs[outvoted.node_id]["reason"]) == (
            "invalid",
            "quorum_minority",
        )
        assert all(v["category"] == "valid" for n, v in vs.items() if n != outvoted.node_id)
        assert vs[outvoted.node_id]["slashed_amount"] == 0
        assert (await balances(client, outvoted))["stake_locked"] == 1000
        assert (await track_record(s, outvoted))["strikes"] == 0


async def test_a_replicas_long_answer_is_not_copied_into_the_other_replicas_verdicts(
    app: Any, app_state: Any
) -> None:
    """Every waiting replica's verdict lists the task's votes: a hostile replica's answer of
    3.8 MB (its last line, the canonical answer) was copied whole into the other replicas'
    verdicts, so each honest worker's verdict poll (every 5 s) read 3.8 MB. A long answer's vote
    is its SHA-256; equal long answers still agree, and short ones are named as they are."""
    async with pool_setup(app, app_state, workers=3, replication_factor=3) as s:
        essay = "an ode to Paris " * 240_000  # 3.8 MB on one line
        digest = (
            "sha256:" + hashlib.sha256(json.dumps([" ".join(essay.split()).casefold()]).encode()).hexdigest()
        )
        await _quorum(s, ["Paris", essay, "Paris"], None)
        await verify_all(app_state)
        vs = {v["node_id"]: v for v in await verdicts(s.admin, s.headers, s.pool_id)}
        honest, hostile = vs[s.workers[0].node_id], vs[s.workers[1].node_id]
        assert (honest["category"], hostile["reason"]) == ("valid", "quorum_minority")
        assert honest["details"]["votes"] == {'["paris"]': 2, digest: 1}
        w = s.workers[0]
        r = await w.client.get("/v1/nodes/me/verdicts", auth=w.contributor.node_auth)
        assert r.status_code == 200 and len(r.content) < 5000, len(r.content)

        await _quorum(s, [essay, essay, "Lyon"], None)
        await verify_all(app_state)
        vs = {v["node_id"]: v for v in await verdicts(s.admin, s.headers, s.pool_id) if v["task_id"] == 2}
        assert [vs[w.node_id]["category"] for w in s.workers] == ["valid", "valid", "fraud"]


async def test_a_math_quorum_counts_equivalent_answers_as_one_vote(
    app: Any, app_state: Any, client: Any
) -> None:
    """Replicas of a math task the server cannot check (no expected answer) vote with their final
    answers: two honest nodes answering ``1/2`` and ``0.5`` agree, as the math checker would
    judge them against an expected answer. Compared as text, the three answers were three votes,
    no majority, and the task asked for another replica; the answer outvoted is made up (greedy
    decoding), and the verdicts name the votes that were counted as one."""
    async with pool_setup(
        app, app_state, workers=3, replication_factor=3, reward_function="math", economics=ECON, stake=1000
    ) as s:
        await _quorum(s, ["1/2", "0.5", "3"], None)
        await verify_all(app_state)
        vs = {v["node_id"]: v for v in await verdicts(s.admin, s.headers, s.pool_id)}
        honest, cheat = s.workers[:2], s.workers[2]
        assert [(vs[w.node_id]["category"], vs[w.node_id]["verifier"]) for w in honest] == [
            ("valid", "quorum")
        ] * 2
        assert (vs[cheat.node_id]["category"], vs[cheat.node_id]["reason"]) == ("fraud", "quorum_minority")
        assert vs[cheat.node_id]["details"]["votes"] == {'["1/2"]': 1, '["0.5"]': 1, '["3"]': 1}
        assert vs[cheat.node_id]["details"]["equivalent"] == [['["0.5"]', '["1/2"]']]
        assert [(await balances(client, w))["stake_locked"] for w in honest] == [1000, 1000]


async def test_a_math_quorum_keeps_answers_that_are_not_equivalent_apart(app: Any, app_state: Any) -> None:
    """Only equivalent answers are one vote: ``1/2``, ``0.50001`` and ``1/3`` are three, and the
    task asks for another replica; its ``\\frac{1}{2}`` makes a majority with ``1/2``."""
    async with pool_setup(
        app, app_state, workers=4, replication_factor=3, reward_function="math", economics=ECON, stake=1000
    ) as s:
        await _quorum(s, ["1/2", "0.50001", "1/3"], None)
        await verify_all(app_state)
        assert await verdicts(s.admin, s.headers, s.pool_id) == []
        lease = (await s.workers[3].claim(s.pool_id)).json()["leases"][0]
        await submit(s.workers[3], lease, ["\\frac{1}{2}"])
        await verify_all(app_state)
        vs = {v["node_id"]: v for v in await verdicts(s.admin, s.headers, s.pool_id)}
        assert [vs[w.node_id]["category"] for w in s.workers] == ["valid", "fraud", "fraud", "valid"]


async def test_a_math_quorum_never_outvotes_an_answer_equivalent_to_the_majority_s(
    app: Any, app_state: Any, client: Any
) -> None:
    """Equivalence is not transitive (``x=3`` and ``3`` are one answer, ``(a)=3`` and ``3`` too,
    ``(a)=3`` and ``x=3`` not). Were a class made of the votes equivalent to a representative
    chosen by its text, a node writing the answer as ``(a)=3`` (its text comes first) would lead
    the class with ``3`` and leave ``x=3`` out: an honest replica called a cheater (greedy
    decoding) for the answer the majority gave. Votes joined by equivalent votes are one class."""
    async with pool_setup(
        app, app_state, workers=3, replication_factor=3, reward_function="math", economics=ECON, stake=1000
    ) as s:
        await _quorum(s, ["\\boxed{(a)=3}", "\\boxed{3}", "\\boxed{x=3}"], None)
        await verify_all(app_state)
        vs = {v["node_id"]: v for v in await verdicts(s.admin, s.headers, s.pool_id)}
        assert [(vs[w.node_id]["category"], vs[w.node_id]["verifier"]) for w in s.workers] == [
            ("valid", "quorum")
        ] * 3
        assert vs[s.workers[2].node_id]["details"]["equivalent"] == [['["(a)=3"]', '["3"]', '["x=3"]']]
        assert [(await balances(client, w))["stake_locked"] for w in s.workers] == [1000] * 3


@pytest.mark.parametrize("one_by_one", [False, True], ids=["in-one-batch", "one-batch-each"])
async def test_a_math_quorum_s_answers_are_compared_before_its_transaction(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch, one_by_one: bool
) -> None:
    """The comparisons of a math quorum's answers (SymPy's, up to 80% of reward_timeout_s) ran
    in the batch's transaction, after its task and accounts were locked: on SQLite every claim,
    result and heartbeat waited for them. They are made before the transaction, once the batch
    is scored, for the votes the quorum will count: the siblings' read then, and the batch's
    (the results in one batch, or the last one alone), and on PostgreSQL, where the three
    providers' results are in three partitions checked by lanes side by side, those the other
    lanes scored and have not committed yet."""
    real = scoring.Scorer.vote_classes
    compared: list[bool] = []  # one per call: whether a transaction held its locks

    async def watched(self: Any, reward_function: str, votes: Any, **kwargs: Any) -> Any:
        if app_state.engine.dialect.name == "sqlite":
            compared.append(sqlite_write_lock_held(app_state))
        else:  # other lanes' transactions may hold their locks meanwhile: the scorer is told
            compared.append(kwargs.get("locked", True))
        return await real(self, reward_function, votes, **kwargs)

    monkeypatch.setattr(scoring.Scorer, "vote_classes", watched)
    async with pool_setup(
        app, app_state, workers=3, replication_factor=3, reward_function="math", economics=ECON, stake=1000
    ) as s:
        await s.enqueue([{"prompt": "Half?", "sampling": {"max_tokens": 64, "temperature": 0}}], key="half")
        for worker, answer in zip(s.workers, ["1/2", "0.5", "3"], strict=True):
            lease = (await worker.claim(s.pool_id)).json()["leases"][0]
            await submit(worker, lease, [answer])
            if one_by_one:
                await verify_all(app_state)
        await verify_all(app_state)
        vs = {v["node_id"]: v for v in await verdicts(s.admin, s.headers, s.pool_id)}
        assert [vs[w.node_id]["category"] for w in s.workers] == ["valid", "valid", "fraud"]
        assert vs[s.workers[2].node_id]["details"]["equivalent"] == [['["0.5"]', '["1/2"]']]
    assert compared == [False]  # was [True]: compared holding the locks


@postgres_only
async def test_a_math_quorum_decided_by_a_lane_that_did_not_compare_it_uses_the_lane_s_classes(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: the three replicas' results are in three partitions, checked by lanes side by
    side; the lane that scores last compares the quorum's votes before its transaction, with the
    others' scores. The quorum is decided by the lane whose transaction commits last, which need
    not be that one (a lane with a larger batch, or waiting for the task's lock): it found no
    classes for the votes in its own batch's and compared them holding its locks. The classes
    depend on nothing but the votes (``vote_key``), so the tick's lanes share them."""
    real = scoring.Scorer.vote_classes
    compared: list[bool] = []

    async def watched(self: Any, reward_function: str, votes: Any, **kwargs: Any) -> Any:
        compared.append(kwargs.get("locked", True))
        return await real(self, reward_function, votes, **kwargs)

    monkeypatch.setattr(scoring.Scorer, "vote_classes", watched)
    process_pending = service.process_pending
    first: list[int] = []

    async def first_commits_last(session: Any, **kwargs: Any) -> Any:
        if first[0] in kwargs["prescored"].attempted:  # the first result's lane: after the others
            await asyncio.sleep(1.5)
        return await process_pending(session, **kwargs)

    monkeypatch.setattr(service, "process_pending", first_commits_last)
    async with pool_setup(
        app, app_state, workers=3, replication_factor=3, reward_function="math", economics=ECON, stake=1000
    ) as s:
        await s.enqueue([{"prompt": "Half?", "sampling": {"max_tokens": 64, "temperature": 0}}], key="half")
        for worker, answer in zip(s.workers, ["1/2", "0.5", "3"], strict=True):
            lease = (await worker.claim(s.pool_id)).json()["leases"][0]
            await submit(worker, lease, [answer])
        async with app_state.sessionmaker() as session:
            first.append(min((await session.execute(select(VerificationJob.id))).scalars()))
        await verify_all(app_state)
        vs = {v["node_id"]: v for v in await verdicts(s.admin, s.headers, s.pool_id)}
        assert [vs[w.node_id]["category"] for w in s.workers] == ["valid", "valid", "fraud"]
    assert True not in compared, compared  # was [False, True]: compared again holding the locks


async def test_a_slow_answer_leaves_the_other_math_votes_compared(app: Any, app_state: Any) -> None:
    """An answer SymPy takes long over (``(x+y+z+w+1)^{16}``, quick to parse and some 20 s to
    compare) is compared as text, the others still by equivalence: ``1/2`` and ``0.5`` outvote
    it. Cut as one, every vote was compared as text: no majority, a tie-break replica, and when
    it answered ``1/2`` the honest ``0.5`` was outvoted, judged fraud (greedy) and slashed,
    because the node answering the slow answer made the comparison run out of time."""
    app_state.settings.verifier.reward_timeout_s = 4
    async with pool_setup(
        app, app_state, workers=3, replication_factor=3, reward_function="math", economics=ECON, stake=1000
    ) as s:
        await _quorum(s, ["1/2", "0.5", "\\boxed{(x+y+z+w+1)^{16}}"], None)
        await verify_all(app_state)
        vs = {v["node_id"]: v for v in await verdicts(s.admin, s.headers, s.pool_id)}
        assert [vs.get(w.node_id, {}).get("category") for w in s.workers] == ["valid", "valid", "fraud"]
        details = vs[s.workers[2].node_id]["details"]
        assert details["equivalent"] == [['["0.5"]', '["1/2"]']]
        assert "as text" in details["equivalence_unchecked"]


async def test_an_inconclusive_quorum_adds_a_replica(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=4, replication_factor=3) as s:
        await _quorum(s, ["Paris", "Lyon", "Nice"], None)
        await verify_all(app_state)
        assert await verdicts(s.admin, s.headers, s.pool_id) == []
        listing = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)).json()["items"]
        detail = (
            await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks/{listing[0]['id']}", headers=s.headers)
        ).json()
        assert detail["replication"] == 4 and detail["status"] == "open"
        lease = (await s.workers[3].claim(s.pool_id)).json()["leases"][0]
        assert lease["seed"] == next(r["seed"] for r in detail["replicas"] if r["replica_index"] == 3)
        await submit(s.workers[3], lease, ["Paris"])
        await verify_all(app_state)
        vs = {v["node_id"]: v for v in await verdicts(s.admin, s.headers, s.pool_id)}
        assert vs[s.workers[0].node_id]["category"] == "valid"
        assert vs[s.workers[3].node_id]["category"] == "valid"
        assert vs[s.workers[1].node_id]["category"] == "fraud"


async def test_audits_fall_with_trust_but_never_below_the_floor() -> None:
    assert service.audit_probability(0, 0.05) == 1.0
    assert service.audit_probability(1, 0.05) == 0.5
    assert service.audit_probability(9, 0.05) == pytest.approx(0.1)
    assert service.audit_probability(10_000, 0.05) == 0.05
    rng = random.Random(20251130)
    draws = 20_000
    audited = sum(rng.random() < service.audit_probability(500, 0.05) for _ in range(draws))
    assert 0.045 < audited / draws < 0.055


async def test_an_audited_result_gets_a_second_replica(app: Any, app_state: Any) -> None:
    """Where the server cannot check the answer, an audit asks a second node for it."""
    app_state.rng = FixedDraw(0.0)
    async with pool_setup(app, app_state, workers=2) as s:
        await s.enqueue(
            [{"prompt": "Name the capital of France.", "sampling": {"max_tokens": 64}}], key="audit"
        )
        lease = (await s.workers[0].claim(s.pool_id)).json()["leases"][0]
        await submit(s.workers[0], lease, ["4"])
        await verify_all(app_state)
        assert await verdicts(s.admin, s.headers, s.pool_id) == []
        second = (await s.workers[1].claim(s.pool_id)).json()["leases"][0]
        assert await s.task_of(second) == await s.task_of(lease)
        await submit(s.workers[1], second, ["4"])
        await verify_all(app_state)
        vs = await verdicts(s.admin, s.headers, s.pool_id)
        assert [v["category"] for v in vs] == ["valid", "valid"]


async def test_a_node_cannot_tell_an_audit_replica_from_any_other_lease(app: Any, app_state: Any) -> None:
    """An audit asks a second node for the same task; that node must not be able to tell, or a
    cheater answers honestly only there (its answer is compared) and cheats on the rest, while
    the verified audit answers lower its own audit rate. Every task of a pool of replication 1
    has one replica, index 0, so a lease with replica_index 1 was an audit replica, in the
    claim's answer, in the node's lease list and in the answer to giving it back (after which
    the node may take it back, with the same seed)."""
    app_state.rng = FixedDraw(0.0)  # audit everything
    async with pool_setup(app, app_state, workers=2) as s:
        submitter, auditor = s.workers
        open_ended = {"prompt": "Name the capital of France.", "sampling": {"max_tokens": 64}}
        await s.enqueue([open_ended], key="q0")
        await submit(submitter, (await submitter.claim(s.pool_id)).json()["leases"][0], ["Paris"])
        await verify_all(app_state)  # audited: a second replica of q0
        await s.enqueue([{**open_ended, "prompt": "Name the capital of Italy."}], key="q1")
        audit, ordinary = (await auditor.claim(s.pool_id, max_tasks=2)).json()["leases"]
        assert audit["task"]["prompt"] == "Name the capital of France."

        def visible(lease: dict[str, Any]) -> dict[str, Any]:  # what is not the task's own
            return {k: v for k, v in lease.items() if k not in ("assignment_id", "seed", "task")}

        assert visible(audit) == visible(ordinary)
        listed = (await auditor.client.get("/v1/nodes/me/leases", auth=auditor.contributor.node_auth)).json()
        assert [visible(x) for x in listed["leases"]] == [visible(ordinary)] * 2
        given_back = [(await auditor.release(x)).json() for x in (audit, ordinary)]
        assert [sorted(x) for x in given_back] == [sorted(given_back[1])] * 2
        assert {k: v for k, v in given_back[0].items() if k not in ("id", "created_at", "ended_at")} == {
            k: v for k, v in given_back[1].items() if k not in ("id", "created_at", "ended_at")
        }


async def test_a_result_accepted_unchecked_does_not_lower_the_nodes_audit_rate(
    app: Any, app_state: Any
) -> None:
    """Only results that were verified (the server's own answer check, a quorum, a validator)
    build the trust that lowers a node's audit rate (BOINC's adaptive replication counts
    validated results). A result the server cannot check and did not audit is paid unchecked;
    counted as valid too, a cheater's every unaudited answer made its next audit less likely."""
    app_state.rng = FixedDraw(0.0)  # the first result is audited
    async with pool_setup(app, app_state, workers=2) as s:
        cheater, other = s.workers
        open_ended = {"prompt": "Name the capital of France.", "sampling": {"max_tokens": 64}}
        await s.enqueue([open_ended], key="q0")
        lease = (await cheater.claim(s.pool_id)).json()["leases"][0]
        await submit(cheater, lease, ["Paris"])
        await verify_all(app_state)
        second = (await other.claim(s.pool_id)).json()["leases"][0]
        await submit(other, second, ["Paris"])
        await verify_all(app_state)  # agreed: one verified result, audit rate 1/2
        assert [v["verifier"] for v in await verdicts(s.admin, s.headers, s.pool_id)] == ["quorum"] * 2
        app_state.rng = FixedDraw(0.6)  # above 1/2: not audited, accepted unchecked
        await s.enqueue([open_ended], key="q1")
        lease = (await cheater.claim(s.pool_id)).json()["leases"][0]
        await submit(cheater, lease, ["made up"])
        await verify_all(app_state)
        unchecked = (await verdicts(s.admin, s.headers, s.pool_id))[-1]
        assert (unchecked["node_id"], unchecked["verifier"], unchecked["category"]) == (
            cheater.node_id,
            "reward",
            "valid",
        )
        app_state.rng = FixedDraw(0.4)  # below 1/2 (one verified result), above 1/3 (two)
        await s.enqueue([open_ended], key="q2")
        lease = (await cheater.claim(s.pool_id)).json()["leases"][0]
        await submit(cheater, lease, ["made up again"])
        await verify_all(app_state)
        assert len(await verdicts(s.admin, s.headers, s.pool_id)) == 3  # audited: it waits
        audit = (await other.claim(s.pool_id)).json()["leases"][0]
        assert await s.task_of(audit) == await s.task_of(lease)


@pytest.mark.parametrize("other", ["same_provider", "same_address", "unhealthy"])
async def test_an_audit_nobody_could_repeat_is_skipped_not_left_waiting(
    app: Any, app_state: Any, other: str
) -> None:
    """An audit replica needs a healthy member of another provider at another address. Where
    the pool has none, it would wait forever, and the result with it (and the node's trust, so
    every later result too): the result is decided on its checks, and the verdict says so."""
    app_state.rng = FixedDraw(0.0)  # every result is drawn for an audit
    async with pool_setup(app, app_state, workers=1) as s:
        first = s.workers[0]
        if other == "same_provider":
            sibling = await s.add_worker(provider_key=first.contributor.provider_key)
        elif other == "same_address":
            first_ip = (await s.admin.get(f"/v1/admin/nodes/{first.node_id}", headers=s.admin_headers)).json()
            sibling = await s.add_worker(ip=first_ip["ip_address"])
        else:
            sibling = await s.add_worker(beat=False)  # joined, but not healthy
        await s.enqueue(
            [{"prompt": "Name the capital of France.", "sampling": {"max_tokens": 64}}], key="audit"
        )
        lease = (await first.claim(s.pool_id)).json()["leases"][0]
        await submit(first, lease, ["Paris"])
        await verify_all(app_state)
        [verdict] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (verdict["outcome"], verdict["category"]) == ("accepted", "valid")
        assert "audit_skipped" in verdict["details"]
        # No replica was added for anyone to claim.
        r = (await sibling.claim(s.pool_id)).json()
        assert r["leases"] == [] and r["reason"] in ("no_tasks", "node_unhealthy")


async def test_checkable_answers_are_judged_one_by_one_without_audit_replicas(
    app: Any, app_state: Any
) -> None:
    """Replicas sample with different seeds: where the server checks answers itself, a replica
    is neither needed to judge them nor a reason to reject a disagreement."""
    app_state.rng = FixedDraw(0.0)  # an audit would be drawn every time
    async with pool_setup(app, app_state, workers=2, replication_factor=2) as s:
        await s.enqueue([task(n=2)], key="checkable")
        leases = [(await w.claim(s.pool_id)).json()["leases"][0] for w in s.workers]
        await submit(s.workers[0], leases[0], ["4", "4"])
        await submit(s.workers[1], leases[1], ["4", "5"])
        await verify_all(app_state)
        vs = {v["node_id"]: v for v in await verdicts(s.admin, s.headers, s.pool_id)}
        first, second = (vs[w.node_id] for w in s.workers)
        assert (first["category"], second["category"]) == ("valid", "valid")
        assert (first["server_reward"], second["server_reward"]) == (1.0, 0.5)


async def test_fraud_strikes_eject_the_node_and_then_ban_the_provider(
    app: Any, app_state: Any, client: Any
) -> None:
    econ = {**ECON, "strikes_before_ejection": 2, "strikes_before_provider_ban": 2, "fraud_slash_amount": 100}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]
        for _ in range(2):
            await submit(w, await one_lease(s, w), ["4"], seed=1)
            await verify_all(app_state)
        me = (await w.client.get("/v1/nodes/me", auth=w.contributor.node_auth)).json()
        assert [m["status"] for m in me["memberships"] if m["pool_id"] == s.pool_id] == ["ejected"]
        r = await w.client.post(f"/v1/pools/{s.pool_id}/join", json={}, auth=w.contributor.node_auth)
        assert r.status_code == 403
        # The provider reached its limit too: a sibling node of the same provider cannot join.
        from tests.conftest import new_contributor
        from tests.tasks_helpers import client_for

        sibling = new_contributor(w.contributor.provider_key)
        async with client_for(app) as c:
            await sibling.register(c)
            r = await c.post(f"/v1/pools/{s.pool_id}/join", json={}, auth=sibling.node_auth)
        assert r.status_code == 403
        assert "provider_blacklisted" in [reason["code"] for reason in r.json()["reasons"]]
        b = await balances(client, w)
        assert b["stake_locked"] == 0 and b["stake_unbonding"] == 800
    await books_balance(app_state)


async def test_the_provider_ban_counts_the_strike_just_given_in_a_pool_without_stake(
    app: Any, app_state: Any
) -> None:
    """The strike that brings a provider's nodes to ``strikes_before_provider_ban`` bans it,
    also where a fraud verdict moves no money (no stake, nothing on hold), which is where the
    strike was once left out of the count."""
    econ = {
        **ECON,
        "min_stake_per_node": 0,
        "fraud_slash_amount": 0,
        "strikes_before_ejection": 2,
        "strikes_before_provider_ban": 2,
    }
    async with pool_setup(app, app_state, workers=1, economics=econ) as s:
        [first] = s.workers
        second = await s.add_worker(provider_key=first.contributor.provider_key)
        for w in (first, second):
            await submit(w, await one_lease(s, w), ["5"], claimed_reward=1.0)
        await verify_all(app_state)
        vs = await verdicts(s.admin, s.headers, s.pool_id)
        assert sorted((v["category"], v["slashed_amount"]) for v in vs) == [("fraud", 0)] * 2
        for w in (first, second):
            me = (await w.client.get("/v1/nodes/me", auth=w.contributor.node_auth)).json()
            assert [m["status"] for m in me["memberships"] if m["pool_id"] == s.pool_id] == ["left"]
            r = await w.client.post(f"/v1/pools/{s.pool_id}/join", json={}, auth=w.contributor.node_auth)
            assert r.status_code == 403, r.text
            assert [reason["code"] for reason in r.json()["reasons"]] == ["provider_blacklisted"]


async def test_leaving_before_the_verdict_does_not_escape_the_stake_slash(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    """The unbonding period is when stake can still be slashed: a node that submits a forged
    result and leaves before the verifier decides it loses its slash from the stake unbonding,
    and gets only the rest back when the period ends."""
    econ = {**ECON, "unbonding_period_s": 86_400}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]
        await submit(w, await one_lease(s, w), ["5"], claimed_reward=1.0)
        r = await w.client.post(f"/v1/pools/{s.pool_id}/leave", json={}, auth=w.contributor.node_auth)
        assert r.status_code == 200, r.text
        assert (await balances(client, w))["stake_unbonding"] == 1000
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["category"], v["reason"], v["slashed_amount"]) == ("fraud", "reward_forged", 200)
        b = await balances(client, w)
        assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (0, 800, 0)
        clock.advance(86_401)
        assert (await stake_release_once(app_state)).released == 1
        b = await balances(client, w)
        assert (b["stake_unbonding"], b["stake_free"]) == (0, 800)
        await books_balance(app_state)


async def test_leaving_before_the_verdict_does_not_escape_the_ejection(
    app: Any, app_state: Any, client: Any
) -> None:
    """A fraud strike that reaches the pool's limit ejects the node for good, whether or not it
    is still a member when the verdict comes: a node that left right after sending a forged
    result was only slashed, and could join again at once and go on."""
    econ = {**ECON, "strikes_before_ejection": 1, "unbonding_period_s": 86_400}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=2000) as s:
        w = s.workers[0]
        await submit(w, await one_lease(s, w), ["4"], seed=1)  # not the assigned seed: fraud
        pool_url = f"/v1/pools/{s.pool_id}"
        r = await w.client.post(f"{pool_url}/leave", json={}, auth=w.contributor.node_auth)
        assert r.status_code == 200, r.text
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["category"], v["reason"], v["slashed_amount"]) == ("fraud", "seed_mismatch", 200)
        me = (await w.client.get("/v1/nodes/me", auth=w.contributor.node_auth)).json()
        assert [m["status"] for m in me["memberships"] if m["pool_id"] == s.pool_id] == ["ejected"]
        r = await w.client.post(f"{pool_url}/join", json={}, auth=w.contributor.node_auth)
        problem(r, 403, "node_ejected")
        b = await balances(client, w)
        assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (0, 800, 1000)
        await books_balance(app_state)


async def test_a_pending_rejoin_withdrawn_before_the_verdict_does_not_escape_the_stake_slash(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    """The slash of an ended membership looked for the unbonding of its latest episode only: a
    node that left, asked to join again (pending, in an approval pool) and withdrew that join
    before the verdict ended an episode with nothing unbonding, and kept its whole stake."""
    econ = {**ECON, "unbonding_period_s": 86_400}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=2000) as s:
        w = s.workers[0]
        await submit(w, await one_lease(s, w), ["5"], claimed_reward=1.0)
        pool_url = f"/v1/pools/{s.pool_id}"
        assert (
            await w.client.post(f"{pool_url}/leave", json={}, auth=w.contributor.node_auth)
        ).status_code == 200
        r = await s.admin.patch(
            f"/v1/admin/pools/{s.pool_id}", json={"admission": "approval"}, headers=s.headers
        )
        assert r.status_code == 200, r.text
        r = await w.client.post(f"{pool_url}/join", json={}, auth=w.contributor.node_auth)
        assert r.status_code == 201 and r.json()["status"] == "pending", r.text
        assert (
            await w.client.post(f"{pool_url}/leave", json={}, auth=w.contributor.node_auth)
        ).status_code == 200
        b = await balances(client, w)
        assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (0, 1000, 1000)
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["category"], v["slashed_amount"]) == ("fraud", 200)
        b = await balances(client, w)
        assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (0, 800, 1000)
        clock.advance(86_401)
        assert (await stake_release_once(app_state)).released == 1
        assert (await balances(client, w))["stake_free"] == 1800
        await books_balance(app_state)


async def test_a_slash_takes_what_the_latest_episode_lacks_from_the_earlier_ones_still_unbonding(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    """The slash of an ended membership took from one episode's unbonding only, its latest with
    stake left: a node that left, joined again and left again, and whose second fraud verdict
    found that episode's unbonding partly slashed already, was slashed less than the pool's
    fraud_slash_amount while its first episode's stake was still unbonding."""
    econ = {**ECON, "fraud_slash_amount": 600, "unbonding_period_s": 86_400}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=2000) as s:
        w = s.workers[0]
        pool_url = f"/v1/pools/{s.pool_id}"
        for episode in (1, 2):  # a forged result in each episode, judged once both have ended
            if episode == 2:
                r = await w.client.post(f"{pool_url}/join", json={}, auth=w.contributor.node_auth)
                assert r.status_code == 201 and r.json()["episode"] == 2, r.text
            await submit(w, await one_lease(s, w), ["5"], claimed_reward=1.0)
            r = await w.client.post(f"{pool_url}/leave", json={}, auth=w.contributor.node_auth)
            assert r.status_code == 200, r.text
            clock.advance(60)
        b = await balances(client, w)
        assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (0, 2000, 0)

        await verify_all(app_state)
        first, second = sorted(await verdicts(s.admin, s.headers, s.pool_id), key=lambda v: v["id"])
        assert [(v["category"], v["slashed_amount"]) for v in (first, second)] == [("fraud", 600)] * 2
        b = await balances(client, w)
        assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (0, 800, 0)
        await books_balance(app_state)

        # The appeal of the second gives back what it took, free at once; the rest unbonds.
        r = await s.admin.post(
            f"/v1/admin/verdicts/{second['id']}/reverse", json={"reason": "bug"}, headers=s.admin_headers
        )
        assert r.status_code == 200, r.text
        b = await balances(client, w)
        assert (b["stake_unbonding"], b["stake_free"]) == (800, 600)
        clock.advance(86_401)
        await stake_release_once(app_state)
        b = await balances(client, w)
        assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (0, 0, 1400)
        await books_balance(app_state)


async def test_a_slash_of_a_live_membership_takes_what_its_locked_stake_lacks_from_earlier_episodes_unbonding(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    """A node left (its first episode's 1000 unbonding) and joined again (1000 locked); two
    fraud verdicts of 700 each: the first takes 700 of the locked stake, the second the 300
    left there and 400 of the first episode's stake still unbonding (slashable until due, as
    for a membership that ended). Before, the second took 300 only, while 1000 of the node's
    stake was still unbonding. Its appeal gives back both parts: 300 locked again (its episode
    is live), 400 free at once; the episodes' unbondings release the 600 and 300 they hold."""
    econ = {**ECON, "fraud_slash_amount": 700, "unbonding_period_s": 86_400}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=2000) as s:
        w = s.workers[0]
        pool_url = f"/v1/pools/{s.pool_id}"
        r = await w.client.post(f"{pool_url}/leave", json={}, auth=w.contributor.node_auth)
        assert r.status_code == 200, r.text
        clock.advance(60)
        r = await w.client.post(f"{pool_url}/join", json={}, auth=w.contributor.node_auth)
        assert r.status_code == 201 and r.json()["episode"] == 2, r.text
        for lease in [await one_lease(s, w) for _ in range(2)]:
            await submit(w, lease, ["5"], claimed_reward=1.0)
        await verify_all(app_state)
        first, second = sorted(await verdicts(s.admin, s.headers, s.pool_id), key=lambda v: v["id"])
        assert [(v["category"], v["slashed_amount"]) for v in (first, second)] == [("fraud", 700)] * 2
        b = await balances(client, w)
        assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (0, 600, 0)
        await books_balance(app_state)

        r = await s.admin.post(
            f"/v1/admin/verdicts/{second['id']}/reverse", json={"reason": "bug"}, headers=s.admin_headers
        )
        assert r.status_code == 200 and r.json()["membership_status"] == "active", r.text
        b = await balances(client, w)
        assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (300, 600, 400)
        await books_balance(app_state)
        again = await s.admin.post(
            f"/v1/admin/verdicts/{second['id']}/reverse", json={"reason": "twice"}, headers=s.admin_headers
        )
        assert again.status_code == 200, again.text
        assert await balances(client, w) == b
        r = await w.client.post(f"{pool_url}/leave", json={}, auth=w.contributor.node_auth)
        assert r.status_code == 200, r.text
        b = await balances(client, w)
        assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (0, 900, 400)
        clock.advance(86_401)
        assert (await stake_release_once(app_state)).released == 2
        b = await balances(client, w)
        assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (0, 0, 1300)
        await books_balance(app_state)


async def test_an_appeal_gives_back_stake_slashed_while_it_was_unbonding(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    econ = {**ECON, "fraud_slash_amount": 1000, "unbonding_period_s": 86_400}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        w = s.workers[0]
        await submit(w, await one_lease(s, w), ["4"], seed=99)
        r = await w.client.post(f"/v1/pools/{s.pool_id}/leave", json={}, auth=w.contributor.node_auth)
        assert r.status_code == 200, r.text
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["category"], v["slashed_amount"]) == ("fraud", 1000)
        assert (await balances(client, w))["stake_unbonding"] == 0
        clock.advance(86_401)
        assert (await stake_release_once(app_state)).released == 0  # nothing left to release
        r = await s.admin.post(
            f"/v1/admin/verdicts/{v['id']}/reverse", json={"reason": "seed bug"}, headers=s.admin_headers
        )
        assert r.status_code == 200, r.text
        b = await balances(client, w)
        assert (b["stake_locked"], b["stake_unbonding"], b["stake_free"]) == (0, 0, 1000)
        await books_balance(app_state)


async def test_an_appeal_reverses_a_fraud_verdict_with_compensating_transfers(
    app: Any, app_state: Any, client: Any
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        await submit(w, await one_lease(s, w), ["4"], seed=99)
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (await balances(client, w))["stake_locked"] == 800
        r = await s.admin.post(
            f"/v1/admin/verdicts/{v['id']}/reverse",
            json={"reason": "seed bug on our side"},
            headers=s.admin_headers,
        )
        assert r.status_code == 200 and r.json()["reversed_at"] is not None
        again = await s.admin.post(
            f"/v1/admin/verdicts/{v['id']}/reverse", json={"reason": "twice"}, headers=s.admin_headers
        )
        assert again.json()["reversal_reason"] == "seed bug on our side"
        assert (await balances(client, w))["stake_locked"] == 1000
        async with app_state.sessionmaker() as session:
            rows = list((await session.execute(select(LedgerTransfer).order_by(LedgerTransfer.id))).scalars())
        slash = next(t for t in rows if t.reason == "slash_stake")
        reversal = next(t for t in rows if t.reverses_transfer_id == slash.id)
        assert reversal.amount == slash.amount
        assert (
            await s.admin.post(
                f"/v1/admin/verdicts/{v['id']}/reverse", json={"reason": "x"}, headers=s.headers
            )
        ).status_code == 403
        await books_balance(app_state)


async def test_the_same_verdict_delivered_32_times_at_once_credits_once(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        await submit(w, await one_lease(s, w), ["4"])
        async with app_state.sessionmaker() as session:
            job_id = (await session.execute(select(VerificationJob.id))).scalar_one()
            submission_id = (await session.execute(select(Submission.id))).scalar_one()

        async def deliver() -> int:
            async with app_state.sessionmaker() as session, session.begin():
                job = await session.get(VerificationJob, job_id)
                submission = await session.get(Submission, submission_id)
                decision = service.Decision("accepted", "valid", "verified", "test", {}, paid_samples=1)
                return (await service.decide(session, job, submission, decision, now=clock.utcnow())).id

        ids = await asyncio.gather(*(deliver() for _ in range(32)))
        assert len(set(ids)) == 1
        assert (await balances(client, w))["rewards_pending"] == 7
        async with app_state.sessionmaker() as session:
            assert len(list((await session.execute(select(Verdict))).scalars())) == 1
        await books_balance(app_state)


async def test_verification_is_resumable_and_runs_each_job_once(app: Any, app_state: Any) -> None:
    """Jobs are rows: results received before a crash are verified by the next process."""
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        for _ in range(3):
            await submit(w, await one_lease(s, w), ["4"])
        from orchestrator.verification.jobs import verify_once

        reports = await asyncio.gather(verify_once(app_state), verify_once(app_state))
        assert sum(r.ran for r in reports) == 1 and sum(r.processed for r in reports) == 3
        assert len(await verdicts(s.admin, s.headers, s.pool_id)) == 3


async def test_pool_stats_and_histories(app: Any, app_state: Any, client: Any) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        w = s.workers[0]
        await submit(w, await one_lease(s, w), ["4"])
        await submit(w, await one_lease(s, w), ["5"], claimed_reward=0.0)
        await submit(w, await one_lease(s, w), ["4"], seed=3)
        await verify_all(app_state)
        stats = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/stats", headers=s.headers)).json()
        assert stats["verdicts"] == 3
        assert stats["by_category"] == {"valid": 1, "invalid": 1, "fraud": 1}
        assert stats["acceptance_rate"] == pytest.approx(1 / 3) and stats["fraud_rate"] == pytest.approx(
            1 / 3
        )
        # The money: 7 credited for the valid answer; the fraud slashed 200 of stake and forfeited
        # those 7, still held.
        assert (stats["rewards_credited"], stats["slashed"]) == (7, 207)
        mine = (await client.get("/v1/providers/me/verdicts", auth=w.contributor.provider_auth)).json()[
            "items"
        ]
        assert [v["reason"] for v in mine] == ["seed_mismatch", "wrong_answer", "verified"]
        node = (await s.admin.get(f"/v1/admin/nodes/{w.node_id}/verdicts", headers=s.admin_headers)).json()
        assert len(node["items"]) == 3
        provider = await s.admin.get(
            f"/v1/admin/providers/{w.contributor.provider_id}/verdicts", headers=s.admin_headers
        )
        assert len(provider.json()["items"]) == 3
        # An id that names no node or provider is the same 404 as one that cannot be an id (an
        # unknown one was an empty page, a malformed one a 404).
        unknown = key_id_of(generate_key())
        for path, code in (("nodes", "node_not_found"), ("providers", "provider_not_found")):
            for missing in (unknown, "not-an-id"):
                r = await s.admin.get(f"/v1/admin/{path}/{missing}/verdicts", headers=s.admin_headers)
                problem(r, 404, code)


async def test_pool_stats_say_which_open_tasks_have_more_replicas_than_the_members_can_take(
    app: Any, app_state: Any
) -> None:
    """A task's replicas go to distinct providers and addresses: in a pool with fewer of them
    than a task's replicas, its other replicas were never leased and nothing said why."""
    async with pool_setup(app, app_state, replication_factor=3) as s:
        first = await s.add_worker(ip="203.0.113.1")
        await s.add_worker(first.contributor.provider_key, ip="203.0.113.2")  # same provider
        await s.add_worker(ip="203.0.113.1")  # another provider, same address as the first
        await s.add_worker(ip="203.0.113.3", beat=False)  # not healthy yet
        await s.enqueue([task()], key="three")
        await s.enqueue([task(replication=1), task(replication=2)], key="fewer")

        async def placement() -> dict[str, int]:
            r = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/stats", headers=s.headers)
            assert r.status_code == 200, r.text
            return dict(r.json()["placement"])

        assert await placement() == {
            "healthy_members": 3,
            "providers": 2,
            "addresses": 2,
            "open_tasks_beyond_members": 1,
        }
        assert (await s.workers[-1].beat()).status_code == 200  # a third provider and address
        assert (await placement())["open_tasks_beyond_members"] == 0


async def test_a_node_reads_its_own_verdicts_with_its_node_key(app: Any, app_state: Any, client: Any) -> None:
    """``GET /v1/nodes/me/verdicts``: a worker learns how its results were judged without its
    provider's key, and without spending the provider key's request budget, which every
    machine of the provider shares. It sees its own verdicts only, not its sibling machines'."""
    async with pool_setup(app, app_state, workers=1) as s:
        a = s.workers[0]
        b = await s.add_worker(provider_key=a.contributor.provider_key)
        await submit(a, await one_lease(s, a), ["4"])
        await submit(b, await one_lease(s, b), ["5"], claimed_reward=0.0)
        await submit(a, await one_lease(s, a), ["5"], claimed_reward=0.0)
        await verify_all(app_state)
        url = "/v1/nodes/me/verdicts"
        mine = (await client.get(url, auth=a.contributor.node_auth)).json()["items"]
        assert [(v["node_id"], v["reason"]) for v in mine] == [
            (a.node_id, "wrong_answer"),
            (a.node_id, "verified"),
        ]
        page = (await client.get(url, params={"limit": 1}, auth=a.contributor.node_auth)).json()
        rest = await client.get(url, params={"cursor": page["next_cursor"]}, auth=a.contributor.node_auth)
        assert [v["id"] for v in page["items"] + rest.json()["items"]] == [v["id"] for v in mine]
        theirs = (await client.get(url, auth=b.contributor.node_auth)).json()["items"]
        assert [(v["node_id"], v["reason"]) for v in theirs] == [(b.node_id, "wrong_answer")]
        problem(await client.get(url, auth=a.contributor.provider_auth), 401, "unknown_key")
        problem(await client.get(url), 401, "signature_missing")


async def test_results_waiting_for_a_quorum_that_can_never_meet_are_inconclusive(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    from orchestrator.tasks.jobs import reap_once

    async with pool_setup(
        app, app_state, workers=2, replication_factor=2, max_attempts=1, lease_duration_s=60
    ) as s:
        await s.enqueue([{"prompt": "Name a colour.", "sampling": {"max_tokens": 8}}])
        first = (await s.workers[0].claim(s.pool_id)).json()["leases"][0]
        assert (await s.workers[1].claim(s.pool_id)).json()["leases"]  # then never answers
        await submit(s.workers[0], first, ["4"])
        await verify_all(app_state)
        assert await verdicts(s.admin, s.headers, s.pool_id) == []
        clock.advance(61)
        await reap_once(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["outcome"], v["category"], v["reason"]) == ("rejected", "inconclusive", "task_abandoned")
        assert v["reward_amount"] == 0 and v["slashed_amount"] == 0


async def test_a_result_checked_after_its_task_was_cancelled_is_still_decided(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A result of a replicated task that came in before the operator cancelled the task, but
    was checked after, cannot meet its siblings (their replicas are cancelled): it is decided as
    one waiting at the cancel is, not left without a verdict for ever."""
    async with pool_setup(app, app_state, workers=2, replication_factor=2) as s:
        r = await s.enqueue([{"prompt": "Name a colour.", "sampling": {"max_tokens": 8}}])
        task_id = r.json()["first_task_id"]
        first = (await s.workers[0].claim(s.pool_id)).json()["leases"][0]
        assert (await s.workers[1].claim(s.pool_id)).json()["leases"]  # then never answers
        await submit(s.workers[0], first, ["red"])
        cancel = await s.admin.post(f"/v1/admin/pools/{s.pool_id}/tasks/{task_id}/cancel", headers=s.headers)
        assert cancel.json()["status"] == "cancelled"
        await verify_all(app_state)
        clock.advance(app_state.settings.verifier.quorum_wait_s + 60)
        await verify_once(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["outcome"], v["category"], v["reason"]) == ("rejected", "inconclusive", "task_abandoned")
        assert v["reward_amount"] == 0 and v["slashed_amount"] == 0


async def test_a_result_of_a_cancelled_task_is_not_audited_by_a_replica(app: Any, app_state: Any) -> None:
    """A cancelled task is never leased again, so an audit replica of it could never be answered
    and the audited result would wait for ever: the audit is skipped and the result decided on
    its checks, with the reason in the verdict. A cancel now leaves a task whose results are all
    in to their verdicts; a task cancelled so before that (by an earlier version) is set here."""
    from sqlalchemy import update as sql_update

    from orchestrator.tasks.models import Task

    app_state.rng = FixedDraw(0.0)  # every result is drawn for an audit
    async with pool_setup(app, app_state, workers=2) as s:
        r = await s.enqueue([{"prompt": "Name the capital of France.", "sampling": {"max_tokens": 64}}])
        task_id = r.json()["first_task_id"]
        lease = (await s.workers[0].claim(s.pool_id)).json()["leases"][0]
        await submit(s.workers[0], lease, ["Paris"])
        async with app_state.sessionmaker() as session, session.begin():
            cancelled = {"status": "cancelled", "end_reason": "cancelled", "available_replicas": 0}
            await session.execute(sql_update(Task).where(Task.id == task_id).values(**cancelled))
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["outcome"], v["category"]) == ("accepted", "valid")
        assert "audit_skipped" in v["details"]
        assert (await s.workers[1].claim(s.pool_id)).json()["reason"] == "no_tasks"


async def test_the_member_list_shows_each_nodes_track_record(app: Any, app_state: Any) -> None:
    """The counters behind audit rates and ejection, per node: zeros before its first verdict."""
    async with pool_setup(app, app_state, workers=2, economics=ECON, stake=1000) as s:
        w, idle = s.workers
        zeros = {"valid": 0, "invalid": 0, "fraud": 0, "strikes": 0, "consecutive_valid": 0}
        assert await track_record(s, w) == zeros
        await submit(w, await one_lease(s, w), ["4"])
        await submit(w, await one_lease(s, w), ["4"])
        await submit(w, await one_lease(s, w), ["5"])
        await submit(w, await one_lease(s, w), ["4"])
        await submit(w, await one_lease(s, w), ["5"], claimed_reward=1.0)
        await submit(w, await one_lease(s, w), ["4"])
        await verify_all(app_state)
        assert await track_record(s, w) == {
            "valid": 4,
            "invalid": 1,
            "fraud": 1,
            "strikes": 1,
            "consecutive_valid": 1,
        }
        assert await track_record(s, idle) == zeros
