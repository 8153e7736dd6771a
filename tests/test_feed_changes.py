"""The feed's change notices: rollouts reversed, withdrawn or restored after a trainer took them."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import math
import random
from typing import Any

import httpx
import pytest

from orchestrator.core.pagination import encode_cursor
from orchestrator.ledger import service as ledger
from orchestrator.ledger.service import ProviderAccount, provider_account
from orchestrator.trainer import Drop, FeedFollower, FollowState, OrchestratorAPIError, Take
from orchestrator.verification.models import RolloutChange
from tests.conftest import postgres_only, problem
from tests.tasks_helpers import PoolSetup, pool_setup
from tests.test_appeals import fraud, honest, result_decided_ago
from tests.test_feed import feed, leases, trainer_headers, whole_feed
from tests.test_reward_holds import hold_statuses
from tests.test_verification import ECON, one_lease
from tests.verification_helpers import submit, verdicts, verify_all
from tests.waits import HANG_S, until_waiting

pytestmark = pytest.mark.usefixtures("no_audits")


async def changes(s: PoolSetup, headers: dict[str, str] | None = None, **params: Any) -> dict[str, Any]:
    r = await s.admin.get(
        f"/v1/pools/{s.pool_id}/rollouts/changes", params=params, headers=headers or s.headers
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


async def reverse(s: PoolSetup, verdict_id: int) -> None:
    r = await s.admin.post(
        f"/v1/admin/verdicts/{verdict_id}/reverse", json={"reason": "appeal upheld"}, headers=s.admin_headers
    )
    assert r.status_code == 200, r.text


def seen(page: dict[str, Any]) -> list[tuple[str, int, bool]]:
    return [(i["change"], i["verdict_id"], i["stands"]) for i in page["items"]]


async def test_a_trainer_past_its_rollouts_learns_of_each_reversal_withdrawal_and_restoration(
    app: Any, app_state: Any
) -> None:
    """A trainer reading the feed forward never saw a rollout it had taken leave it. The change
    notices tell it, in commit order, and say whether each rollout stands as they are read."""
    async with pool_setup(app, app_state, workers=2, economics=ECON, stake=1000, max_leases_per_node=10) as s:
        cheat, honest = s.workers
        trainer = await trainer_headers(app_state, [s.pool_id])
        assert await changes(s, trainer) == {"items": [], "next_cursor": None, "has_more": False}
        for lease in await leases(s, cheat, 2):
            await submit(cheat, lease, ["4"])
        [h] = await leases(s, honest, 1)
        await submit(honest, h, ["4"])
        await verify_all(app_state)
        taken, _ = await whole_feed(s, limit=10)
        by_id = {i["verdict_id"]: i for i in taken}
        [honest_id] = [i["verdict_id"] for i in taken if i["node_id"] == honest.node_id]
        a1, a2 = sorted(i["verdict_id"] for i in taken if i["node_id"] == cheat.node_id)

        await reverse(s, honest_id)
        page = await changes(s, trainer)
        assert seen(page) == [("reversed", honest_id, False)]
        [notice] = page["items"]
        assert notice["rollout"] is None and notice["cause_verdict_id"] is None
        assert notice["task_id"] == by_id[honest_id]["task"]["task_id"]
        cursor = page["next_cursor"]

        [forged] = await leases(s, cheat, 1)
        await submit(cheat, forged, ["5"], claimed_reward=1.0)  # a reward claim the server refutes
        await verify_all(app_state)
        fraud = (await verdicts(s.admin, s.headers, s.pool_id))[-1]
        assert fraud["category"] == "fraud"
        page = await changes(s, trainer, after=cursor)
        assert seen(page) == [("withdrawn", a1, False), ("withdrawn", a2, False)]
        assert {i["cause_verdict_id"] for i in page["items"]} == {fraud["id"]}
        cursor = page["next_cursor"]
        assert (await changes(s, trainer, after=cursor))["items"] == []  # polling at the end

        await reverse(s, fraud["id"])
        page = await changes(s, trainer, after=cursor)
        assert seen(page) == [("restored", a1, True), ("restored", a2, True)]
        # What the trainer takes back is the rollout as the feed serves it.
        assert [i["rollout"] for i in page["items"]] == [by_id[a1], by_id[a2]]

        # Read from the start, each notice says how its rollout stands now.
        everything = await changes(s, trainer, limit=2)
        assert everything["has_more"] is True
        rest = await changes(s, trainer, after=everything["next_cursor"])
        assert seen(everything) + seen(rest) == [
            ("reversed", honest_id, False),
            ("withdrawn", a1, True),
            ("withdrawn", a2, True),
            ("restored", a1, True),
            ("restored", a2, True),
        ]


async def test_change_cursors_belong_to_their_pool_and_trainers_to_theirs(app: Any, app_state: Any) -> None:
    async with (
        pool_setup(app, app_state, workers=1, max_leases_per_node=10) as a,
        pool_setup(app, app_state, workers=1, max_leases_per_node=10) as b,
    ):
        for s in (a, b):
            [lease] = await leases(s, s.workers[0], 1)
            await submit(s.workers[0], lease, ["4"])
        await verify_all(app_state)
        for s in (a, b):
            [item] = (await feed(s))["items"]
            await reverse(s, item["verdict_id"])
        [in_a] = (await changes(a))["items"]
        [in_b] = (await changes(b))["items"]
        assert in_a["change_id"] < in_b["change_id"]
        not_issued = [
            in_a["cursor"],  # another pool's
            encode_cursor(f"changes:{in_b['change_id'] + 1000}"),  # past the newest notice
            encode_cursor(f"rollouts:{in_b['verdict_id']}"),  # the rollouts feed's, for this rollout
            "not base64!",
        ]
        for cursor in not_issued:
            r = await b.admin.get(
                f"/v1/pools/{b.pool_id}/rollouts/changes", params={"after": cursor}, headers=b.headers
            )
            problem(r, 400, "cursor_invalid")
        assert (await changes(b, after=in_b["cursor"]))["items"] == []
        elsewhere = await trainer_headers(app_state, [a.pool_id])
        r = await b.admin.get(f"/v1/pools/{b.pool_id}/rollouts/changes", headers=elsewhere)
        problem(r, 404, "pool_not_found")


async def notice_in_transaction(
    app_state: Any, pool_id: str, verdict_id: int, written: asyncio.Event, release: asyncio.Event
) -> None:
    """A notice written in a transaction held open until ``release`` is set. (A real appeal holds
    the system accounts, so a second appeal would wait for it rather than commit first.)"""
    async with app_state.sessionmaker() as session, session.begin():
        session.add(RolloutChange(pool_id=pool_id, verdict_id=verdict_id, change="reversed"))
        await session.flush()
        written.set()
        await release.wait()


@postgres_only
async def test_a_notice_committed_out_of_id_order_is_not_skipped(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s:
        for lease in await leases(s, s.workers[0], 2):
            await submit(s.workers[0], lease, ["4"])
        await verify_all(app_state)
        first, second = [i["verdict_id"] for i in (await feed(s))["items"]]

        # The first notice gets the lower id but commits last; the appeal's commits first.
        written, release = asyncio.Event(), asyncio.Event()
        slow = asyncio.create_task(notice_in_transaction(app_state, s.pool_id, first, written, release))
        await asyncio.wait_for(written.wait(), 10)
        await reverse(s, second)

        read = asyncio.create_task(changes(s))
        try:
            await until_waiting(app_state, 1, read, on="table")
            assert not read.done(), "the change feed must wait for the notice still being written"
        finally:
            release.set()
            await slow
        page = await asyncio.wait_for(read, 10)
        # The first was not reversed after all: its notice says it stands.
        assert seen(page) == [("reversed", first, True), ("reversed", second, False)]


@postgres_only
async def test_an_appeal_does_not_deadlock_with_a_verifier_withdrawing_the_same_rollout(
    app: Any, app_state: Any
) -> None:
    """A verifier deciding a fraud verdict holds the provider's accounts, then writes a withdrawal
    notice naming each rollout of the node's window. An appeal of one of those rollouts, begun
    meanwhile, has its verdict locked and waits for those accounts. The notice does not wait for
    the appeal (it did, and PostgreSQL aborted one of the two as a deadlock): both commit."""
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s:
        worker = s.workers[0]
        [lease] = await leases(s, worker, 1)
        await submit(worker, lease, ["4"])
        await verify_all(app_state)
        [rollout] = (await feed(s))["items"]
        verdict_id = rollout["verdict_id"]
        pending = provider_account(worker.contributor.provider_id, ProviderAccount.rewards_pending)
        async with app_state.sessionmaker() as session, session.begin():
            await ledger.lock_accounts(session, [pending])  # as the verifier's batch does first
            appeal = asyncio.create_task(reverse(s, verdict_id))
            await until_waiting(app_state, 1, appeal, on="row")
            assert not appeal.done(), "the appeal must wait for the provider's accounts"
            session.add(RolloutChange(pool_id=s.pool_id, verdict_id=verdict_id, change="withdrawn"))
            await asyncio.wait_for(session.flush(), HANG_S)
        await asyncio.wait_for(appeal, HANG_S)  # 200, not 503 transient_conflict
        page = await changes(s)
        assert seen(page) == [("withdrawn", verdict_id, False), ("reversed", verdict_id, False)]


class Follower:
    """A trainer that applies the SDK's events: keeps what it was told to take, drops the rest."""

    def __init__(self, s: PoolSetup, headers: dict[str, str], state: FollowState | None = None) -> None:
        token = headers["Authorization"].removeprefix("Bearer ")
        self.sdk = FeedFollower(s.admin, s.pool_id, token, state=state, page_size=5)
        self.kept: dict[int, dict[str, Any]] = {}
        self.dropped = self.taken_back = 0
        self.reads = 0
        self.read = asyncio.Condition()

    def apply(self, events: list[Take | Drop]) -> None:
        for event in events:
            if isinstance(event, Drop):
                self.dropped += self.kept.pop(event.verdict_id, None) is not None
            else:
                self.taken_back += (
                    event.verdict_id <= max(self.kept, default=0) and event.verdict_id not in self.kept
                )
                self.kept[event.verdict_id] = event.rollout

    async def poll(self) -> None:
        """Until both the feed and the notices are read to their end."""
        while True:
            self.apply(await self.sdk.poll())
            if self.sdk.caught_up:
                async with self.read:
                    self.reads += 1
                    self.read.notify_all()
                return

    async def read_through(self) -> None:
        """Until another poll, running concurrently, has read to the end from a start after now."""
        async with self.read:
            start = self.reads
            await self.read.wait_for(lambda: self.reads >= start + 2)


async def test_a_trainer_following_the_feed_and_its_notices_while_verdicts_change_ends_with_the_feed(
    app: Any, app_state: Any
) -> None:
    """Accepts, fraud verdicts (each withdrawing its node's window) and appeals (of accepted and
    of fraud verdicts) commit while a trainer polls; whatever order it saw them in, what it
    keeps at the end is exactly what the feed serves."""
    econ = {**ECON, "strikes_before_ejection": 100, "strikes_before_provider_ban": 100}
    rng = random.Random(5)
    async with pool_setup(app, app_state, workers=3, economics=econ, stake=5000, max_leases_per_node=50) as s:
        trainer = await trainer_headers(app_state, [s.pool_id])
        follower = Follower(s, trainer)
        stop = asyncio.Event()

        async def follow() -> None:
            while not stop.is_set():
                await follower.poll()
                await asyncio.sleep(0)

        async def appeal(verdict_ids: list[int]) -> None:
            for verdict_id in verdict_ids:
                await reverse(s, verdict_id)

        following = asyncio.create_task(follow())
        try:
            for round_ in range(4):
                for w in s.workers:
                    for lease in await leases(s, w, 2):
                        await submit(w, lease, ["4"])
                cheat = s.workers[round_ % 2]
                await submit(cheat, await one_lease(s, cheat), ["4"], seed=1)  # fraud: not its seed
                # The follower has read the last round's verdicts before this round's change them, so
                # it has something to drop and to take back however the threads are scheduled.
                await follower.read_through()
                listed = await verdicts(s.admin, s.headers, s.pool_id)
                standing = [v for v in listed if v["reversed_at"] is None]
                accepted = [v["id"] for v in standing if v["outcome"] == "accepted"]
                frauds = [v["id"] for v in standing if v["category"] == "fraud"]
                picked = rng.sample(accepted, min(1, len(accepted))) + rng.sample(frauds, min(1, len(frauds)))
                await asyncio.gather(verify_all(app_state), appeal(picked))
                await asyncio.sleep(0)
        finally:
            stop.set()
            await following
        await verify_all(app_state)
        await follower.poll()
        served, _ = await whole_feed(s, limit=100)
        assert sorted(follower.kept) == [i["verdict_id"] for i in served]
        assert follower.kept == {i["verdict_id"]: i for i in served}
        # Not by luck: the follower dropped rollouts it had taken, and took some back.
        assert follower.dropped > 0 and follower.taken_back > 0, (follower.dropped, follower.taken_back)


async def test_a_follower_restarted_from_its_saved_state_reads_only_what_is_new(
    app: Any, app_state: Any
) -> None:
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s:
        for lease in await leases(s, s.workers[0], 3):
            await submit(s.workers[0], lease, ["4"])
        await verify_all(app_state)
        trainer = await trainer_headers(app_state, [s.pool_id])
        first = Follower(s, trainer)
        await first.poll()
        assert len(first.kept) == 3
        saved = first.sdk.state.to_json()

        gone = sorted(first.kept)[1]
        await reverse(s, gone)
        [lease] = await leases(s, s.workers[0], 1)
        await submit(s.workers[0], lease, ["4"])
        await verify_all(app_state)
        again = FeedFollower(
            s.admin,
            s.pool_id,
            trainer["Authorization"].removeprefix("Bearer "),
            state=FollowState.from_json(saved),
        )
        events = await again.poll()
        [new] = [e.verdict_id for e in events if isinstance(e, Take)]
        assert new > max(first.kept)
        assert [e.verdict_id for e in events if isinstance(e, Drop)] == [gone]
        assert again.caught_up and await again.poll() == []
        assert FollowState.from_json(again.state.to_json()) == again.state


async def test_a_follower_saved_after_each_event_and_restarted_misses_none_of_the_page(
    app: Any, app_state: Any
) -> None:
    """The state saved once an event of ``follow`` is applied (as the README does it) is where
    that event leaves the follower: it had already moved past the whole page, so a trainer that
    died after the page's first event never got the rest."""
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s:
        for lease in await leases(s, s.workers[0], 3):
            await submit(s.workers[0], lease, ["4"])
        await verify_all(app_state)
        served, _ = await whole_feed(s, limit=10)
        assert len(served) == 3
        token = (await trainer_headers(app_state, [s.pool_id]))["Authorization"].removeprefix("Bearer ")
        applied: list[int] = []
        follower = FeedFollower(s.admin, s.pool_id, token)
        async for event in follower.follow(interval_s=0):
            assert isinstance(event, Take)
            applied.append(event.verdict_id)
            saved = follower.state.to_json()
            break  # the trainer dies here, before the page's next event
        restarted = FeedFollower(s.admin, s.pool_id, token, state=FollowState.from_json(saved))
        applied += [e.verdict_id for e in await restarted.poll() if isinstance(e, Take)]
        assert applied == [item["verdict_id"] for item in served]  # each once, in order


class FailingChangesOnce(httpx.AsyncBaseTransport):
    """The app, behind a first answer of 400 to a read of the change notices."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner, self.fail = inner, 1

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.fail and request.url.path.endswith("/changes"):
            self.fail -= 1
            body = {"type": "about:blank", "title": "bad", "status": 400, "code": "x", "detail": "x"}
            return httpx.Response(400, json=body, headers={"Content-Type": "application/problem+json"})
        return await self.inner.handle_async_request(request)


async def test_a_poll_that_raises_leaves_the_follower_where_it_was(app: Any, app_state: Any) -> None:
    """A poll that read the feed's page and then failed on the notices had moved the state past
    that page: the same follower's next poll never handed its rollouts out."""
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s:
        for lease in await leases(s, s.workers[0], 2):
            await submit(s.workers[0], lease, ["4"])
        await verify_all(app_state)
        token = (await trainer_headers(app_state, [s.pool_id]))["Authorization"].removeprefix("Bearer ")
        transport = FailingChangesOnce(s.admin._transport)
        async with httpx.AsyncClient(transport=transport, base_url=str(s.admin.base_url)) as http:
            follower = FeedFollower(http, s.pool_id, token, max_retries=0)
            with pytest.raises(OrchestratorAPIError):
                await follower.poll()
            assert follower.state == FollowState()
            events = await follower.poll()
        assert [type(e) for e in events] == [Take, Take]


class BusyOnce(httpx.AsyncBaseTransport):
    """The app, behind a first answer of 503 ``feed_busy`` (what a PostgreSQL feed says while
    verdicts are being written)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner, self.busy = inner, 1

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.busy:
            self.busy -= 1
            body = {
                "type": "about:blank",
                "title": "busy",
                "status": 503,
                "code": "feed_busy",
                "detail": "retry",
            }
            return httpx.Response(
                503, json=body, headers={"Retry-After": "0", "Content-Type": "application/problem+json"}
            )
        return await self.inner.handle_async_request(request)


async def test_the_follower_retries_a_busy_feed_and_raises_what_is_not_retried(
    app: Any, app_state: Any
) -> None:
    async with pool_setup(app, app_state, workers=1) as s:
        [lease] = await leases(s, s.workers[0], 1)
        await submit(s.workers[0], lease, ["4"])
        await verify_all(app_state)
        token = (await trainer_headers(app_state, [s.pool_id]))["Authorization"].removeprefix("Bearer ")
        transport = BusyOnce(s.admin._transport)
        async with httpx.AsyncClient(transport=transport, base_url=str(s.admin.base_url)) as http:
            events = await FeedFollower(http, s.pool_id, token).poll()
            assert transport.busy == 0 and [type(e) for e in events] == [Take]
            with pytest.raises(OrchestratorAPIError) as refused:
                await FeedFollower(http, "pool_elsewhere", token).poll()
            assert (refused.value.status, refused.value.code) == (404, "pool_not_found")


def when(verdict: dict[str, Any]) -> dt.datetime:
    return dt.datetime.fromisoformat(verdict["decided_at"])


def apart(first: dict[str, Any], second: dict[str, Any]) -> int:
    """Whole seconds from the first verdict's decision to the second's (rounded up)."""
    return math.ceil((when(second) - when(first)).total_seconds())


@pytest.mark.parametrize("written_first", ["accepted", "fraud"])
async def test_a_rollout_is_withdrawn_exactly_when_the_fraud_verdict_forfeited_its_reward(
    app: Any, app_state: Any, written_first: str
) -> None:
    """A verifier batch dates its verdicts by its clock when it starts (``decided_at``), before
    it waits for the locks of the nodes it decides; so of two batches deciding for one node, the
    one that started later may take the node's locks first, and write its verdict (with the
    lower id) before the other's, dated earlier. What a fraud verdict forfeits is what it found
    on hold when it was written: the rewards of the node's accepted verdicts written before it,
    whatever their dates. The feed withdraws exactly those (``withdrawn_by``), and notifies them
    (``notify_window``). Constructed here by dating the verdict written second 5 s before the
    first. Going by ``decided_at`` instead, the feed would serve a rollout whose reward the
    fraud verdict took (fraud written second), or withdraw one whose reward stands (accepted
    written second)."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        [w] = s.workers
        trainer = await trainer_headers(app_state, [s.pool_id])
        if written_first == "accepted":
            a = await honest(s, w, app_state)
            f = await fraud(s, w, app_state)
            await result_decided_ago(app_state, f["id"], apart(a, f) + 5)
        else:
            f = await fraud(s, w, app_state)
            a = await honest(s, w, app_state)
            await result_decided_ago(app_state, a["id"], apart(f, a) + 5)
        dated = {v["id"]: when(v) for v in await verdicts(s.admin, s.headers, s.pool_id)}
        assert (dated[f["id"]] < dated[a["id"]]) == (written_first == "accepted")
        assert (f["id"] > a["id"]) == (written_first == "accepted")
        forfeited = written_first == "accepted"
        assert await hold_statuses(app_state) == {w.node_id: ["forfeited" if forfeited else "held"]}
        listed = {v["id"]: v for v in await verdicts(s.admin, s.headers, s.pool_id)}
        assert listed[a["id"]]["withdrawn_by"] == (f["id"] if forfeited else None)
        served = (await feed(s, limit=10))["items"]
        assert [i["verdict_id"] for i in served] == ([] if forfeited else [a["id"]])
        notices = seen(await changes(s, trainer))
        assert notices == ([("withdrawn", a["id"], False)] if forfeited else [])


async def test_a_page_of_notices_reads_at_most_one_results_worth_of_bodies(app: Any, app_state: Any) -> None:
    """As a feed page: a page of notices read every rollout's signed body whole (up to 500, each up
    to ORCH_LIMITS__MAX_RESULT_BODY_BYTES); it now stops once they add up to that limit (the first
    whatever its size) and says has_more."""
    limit = app_state.settings.limits.max_result_body_bytes
    proof = base64.b64encode(b"\x01" * (limit * 3 // 10)).decode()  # 40 % of the limit
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s:
        w = s.workers[0]
        for lease in await leases(s, w, 3):
            await submit(w, lease, ["4"], proof=proof)
        await verify_all(app_state)
        items, _ = await whole_feed(s, limit=100)
        assert len(items) == 3
        for item in items:
            await reverse(s, item["verdict_id"])

        first = await changes(s, limit=100)
        assert len(first["items"]) == 2 and first["has_more"] is True  # a third: 120 %
        second = await changes(s, limit=100, after=first["next_cursor"])
        assert len(second["items"]) == 1 and second["has_more"] is False
        assert [i["change"] for i in first["items"] + second["items"]] == ["reversed"] * 3
