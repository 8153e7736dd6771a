"""The trainer feed: accepted rollouts in acceptance order, a stable cursor, scoping, the export."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
from typing import Any

import pytest
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession

from orchestrator.admin.tokens import Role, create_token
from orchestrator.core.db import utcnow
from orchestrator.core.pagination import encode_cursor
from orchestrator.feed import service as feed_service
from orchestrator.tasks.models import Submission
from orchestrator.verification.models import Verdict
from tests.conftest import asgi_stream, make_token, postgres_only, problem
from tests.tasks_helpers import PoolSetup, Worker, pool_setup, task
from tests.test_verification import ECON
from tests.verification_helpers import accept_in_transaction, answer_body, submit, verdicts, verify_all
from tests.waits import HANG_S, until_waiting

pytestmark = pytest.mark.usefixtures("no_audits")


_batches = itertools.count()


def arithmetic(n: int = 1) -> dict[str, Any]:
    return task(prompt="What is 2+2?", n=n, verification={"answer": "4"}, metadata={"source": "arith"})


async def leases(s: PoolSetup, worker: Worker, count: int, n: int = 1) -> list[dict[str, Any]]:
    r = await s.enqueue([arithmetic(n) for _ in range(count)], key=f"batch-{next(_batches)}")
    assert r.status_code == 201, r.text
    got: list[dict[str, Any]] = []
    while len(got) < count:
        r = await worker.claim(s.pool_id, max_tasks=count - len(got))
        assert r.status_code == 200, r.text
        assert r.json()["leases"], r.json()
        got += r.json()["leases"]
    return got


async def trainer_headers(app_state: Any, pool_ids: list[str]) -> dict[str, str]:
    async with app_state.sessionmaker() as session, session.begin():
        token, _ = await create_token(session, role=Role.trainer, name="trainer", pool_ids=pool_ids)
    return {"Authorization": f"Bearer {token}"}


async def feed(s: PoolSetup, headers: dict[str, str] | None = None, **params: Any) -> dict[str, Any]:
    r = await s.admin.get(f"/v1/pools/{s.pool_id}/rollouts", params=params, headers=headers or s.headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def whole_feed(s: PoolSetup, limit: int, after: str | None = None) -> tuple[list[dict[str, Any]], str]:
    items: list[dict[str, Any]] = []
    cursor = after
    while True:
        params: dict[str, Any] = {"limit": limit}
        if cursor is not None:
            params["after"] = cursor
        page = await feed(s, **params)
        items += page["items"]
        cursor = page["next_cursor"]
        if not page["has_more"]:
            assert cursor is not None
            return items, cursor


async def test_only_accepted_rollouts_appear_in_acceptance_order_with_server_rewards(
    app: Any, app_state: Any
) -> None:
    async with pool_setup(app, app_state, workers=2, max_leases_per_node=10) as s:
        w, cheat = s.workers
        first, second, wrong, late = await leases(s, w, 4, n=2)
        [fraud] = await leases(s, cheat, 1, n=2)
        # Submitted (and so verified) out of lease order: the feed follows verdicts, not tasks.
        b = await submit(w, second, ["4", "5"])
        a = await submit(w, first, ["4", "4"])
        await submit(w, wrong, ["5", "6"])  # an honest wrong answer: rejected
        # A seed the worker chose: fraud (by another node: it would withdraw w's rollouts).
        await submit(cheat, fraud, ["4", "4"], seed=12345)
        await verify_all(app_state)
        await submit(w, late, ["4", "4"])  # not verified yet

        page = await feed(s)
        assert [i["submission_id"] for i in page["items"]] == [b["submission_id"], a["submission_id"]]
        assert page["has_more"] is False
        item = page["items"][0]
        assert item["node_id"] == w.node_id and item["policy_step"] == 1
        assert item["seed"] == second["seed"]
        assert item["reward"] == 0.5
        assert [x["reward"] for x in item["samples"]] == [1.0, 0.0]
        assert [x["completion"] for x in item["samples"]] == ["Let me think.\n4", "Let me think.\n5"]
        assert item["task"]["task_id"] == await s.task_of(second)  # the real id: the trainer's
        assert item["task"]["prompt"] == "What is 2+2?"
        assert item["task"]["metadata"] == {"source": "arith"}
        assert item["task"]["sampling"]["n"] == 2 and item["task"]["canary"] is False
        assert "verification" not in item["task"]  # the answer key stays on the server
        assert [x["reward"] for x in page["items"][1]["samples"]] == [1.0, 1.0]

        # The late result appears once verified, after the others.
        await verify_all(app_state)
        page = await feed(s, after=page["next_cursor"])
        assert [i["task"]["task_id"] for i in page["items"]] == [await s.task_of(late)]


async def test_each_rollout_says_who_checked_it(app: Any, app_state: Any) -> None:
    """The server against the hidden answer, a quorum of two providers' replicas, or nobody: a
    task with nothing to check whose audit was not drawn (no_audits) is accepted unchecked."""
    open_ended = {"prompt": "Name the capital of France.", "sampling": {"max_tokens": 64}}
    async with pool_setup(app, app_state, workers=2, max_leases_per_node=4) as s:
        one, two = s.workers
        [checked] = await leases(s, one, 1)
        await submit(one, checked, ["4"])
        assert (await s.enqueue([open_ended], key="unchecked")).status_code == 201
        unchecked = (await one.claim(s.pool_id)).json()["leases"][0]
        await submit(one, unchecked, ["Paris"])
        await verify_all(app_state)
        assert (await s.enqueue([{**open_ended, "replication": 2}], key="quorum")).status_code == 201
        for worker in (one, two):
            lease = (await worker.claim(s.pool_id)).json()["leases"][0]
            await submit(worker, lease, ["Paris"])
        await verify_all(app_state)
        items = (await feed(s))["items"]
    assert [(i["verified_by"], i["reward"]) for i in items] == [
        ("server", 1.0),
        (None, None),
        ("quorum", None),
        ("quorum", None),
    ]


async def test_pages_concatenate_and_a_cursor_keeps_working_after_new_verdicts(
    app: Any, app_state: Any
) -> None:
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s:
        w = s.workers[0]
        for lease in await leases(s, w, 4):
            await submit(w, lease, ["4"])
        for lease in await leases(s, w, 3):
            await submit(w, lease, ["4"])
        await verify_all(app_state)

        everything, _ = await whole_feed(s, limit=100)
        assert len(everything) == 7
        ids = [i["verdict_id"] for i in everything]
        assert ids == sorted(ids)
        paged, end = await whole_feed(s, limit=2)
        assert paged == everything
        middle = everything[2]["cursor"]

        # The end of the feed: polling returns nothing new, and the cursor is kept.
        page = await feed(s, after=end)
        assert page["items"] == [] and page["next_cursor"] == end and page["has_more"] is False

        for lease in await leases(s, w, 2):
            await submit(w, lease, ["4"])
        await verify_all(app_state)
        newer, _ = await whole_feed(s, limit=1, after=end)
        assert len(newer) == 2 and min(i["verdict_id"] for i in newer) > max(ids)
        # An older cursor still resumes exactly where it was issued.
        resumed, _ = await whole_feed(s, limit=3, after=middle)
        assert resumed == everything[3:] + newer


async def test_a_reversed_verdict_is_absent_on_a_re_read(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s:
        w = s.workers[0]
        for lease in await leases(s, w, 3):
            await submit(w, lease, ["4"])
        await verify_all(app_state)
        before = (await feed(s))["items"]
        r = await s.admin.post(
            f"/v1/admin/verdicts/{before[1]['verdict_id']}/reverse",
            json={"reason": "appeal upheld"},
            headers=s.admin_headers,
        )
        assert r.status_code == 200, r.text
        after = (await feed(s))["items"]
        assert [i["verdict_id"] for i in after] == [before[0]["verdict_id"], before[2]["verdict_id"]]
        # A cursor issued at the reversed verdict still works.
        page = await feed(s, after=before[1]["cursor"])
        assert [i["verdict_id"] for i in page["items"]] == [before[2]["verdict_id"]]
        # A trainer scoped to the pool finds the reversal in the pool's verdicts; one scoped
        # to another pool does not see them.
        trainer = await trainer_headers(app_state, [s.pool_id])
        verdicts = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/verdicts", headers=trainer)
        assert verdicts.status_code == 200, verdicts.text
        reversed_ = [v["id"] for v in verdicts.json()["items"] if v["reversed_at"] is not None]
        assert reversed_ == [before[1]["verdict_id"]]
        elsewhere = await trainer_headers(app_state, ["pool_elsewhere"])
        problem(
            await s.admin.get(f"/v1/admin/pools/{s.pool_id}/verdicts", headers=elsewhere),
            404,
            "pool_not_found",
        )


async def test_the_feed_is_scoped_to_the_pool(app: Any, app_state: Any) -> None:
    async with (
        pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s,
        pool_setup(app, app_state) as other,
    ):
        w = s.workers[0]
        [lease] = await leases(s, w, 1)
        await submit(w, lease, ["4"])
        await verify_all(app_state)
        path = f"/v1/pools/{s.pool_id}/rollouts"
        for suffix in ("", "/export"):
            # another operator, and a trainer scoped to another pool: as if the pool did not exist
            problem(await s.admin.get(path + suffix, headers=other.headers), 404, "pool_not_found")
            elsewhere = await trainer_headers(app_state, [other.pool_id])
            problem(await s.admin.get(path + suffix, headers=elsewhere), 404, "pool_not_found")
            validator = {"Authorization": f"Bearer {await make_token(app_state, 'validator')}"}
            problem(await s.admin.get(path + suffix, headers=validator), 403, "role_forbidden")
            problem(await s.admin.get(path + suffix), 401, "token_missing")
        problem(await s.admin.get("/v1/pools/nope/rollouts", headers=s.admin_headers), 404, "pool_not_found")
        # The pool's trainer, its operator and an admin read the same feed.
        trainer = await trainer_headers(app_state, [s.pool_id])
        seen = [(await feed(s, headers=h))["items"] for h in (trainer, s.headers, s.admin_headers)]
        assert len(seen[0]) == 1 and seen[0] == seen[1] == seen[2]
        # Another pool's feed does not show this pool's rollouts.
        assert (await feed(other))["items"] == []


async def test_a_cursor_the_feed_did_not_issue_is_refused(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state) as s:
        for bad in ("garbage!", encode_cursor("17"), encode_cursor("rollouts:x")):
            r = await s.admin.get(f"/v1/pools/{s.pool_id}/rollouts", params={"after": bad}, headers=s.headers)
            problem(r, 400, "cursor_invalid")


async def test_the_export_streams_exactly_the_paged_feed(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(feed_service, "EXPORT_CHUNK", 2)  # several chunks, several transactions
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s:
        w = s.workers[0]
        answers = [["4", "4"], ["5", "5"], ["4", "5"], ["4", "4"], ["4", "4"]]
        for lease, a in zip(await leases(s, w, 5, n=2), answers, strict=True):
            await submit(w, lease, a)
        await verify_all(app_state)
        paged, _ = await whole_feed(s, limit=2)
        assert len(paged) == 4  # the all-wrong result is rejected

        r = await s.admin.get(f"/v1/pools/{s.pool_id}/rollouts/export", headers=s.headers)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.text.splitlines()]
        assert lines == paged

        r = await s.admin.get(
            f"/v1/pools/{s.pool_id}/rollouts/export", params={"after": paged[0]["cursor"]}, headers=s.headers
        )
        assert [json.loads(line) for line in r.text.splitlines()] == paged[1:]

        empty = await s.admin.get(
            f"/v1/pools/{s.pool_id}/rollouts/export", params={"after": paged[-1]["cursor"]}, headers=s.headers
        )
        assert empty.status_code == 200 and empty.text == ""


@pytest.mark.parametrize("change", ["revoke", "rotate"])
async def test_an_export_stops_when_its_token_is_revoked_or_rotated_while_it_streams(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """A trainer token revoked (or given a new secret) while its export streams served the rest
    of the export all the same: every request after a revocation is refused, but the export read
    on in transactions of its own, for as long as the pool's feed was (hours, for a large one).
    The export now checks its token before each further chunk and breaks off (the answer is not
    completed, so the client sees a broken download, not a short file) once it is dead."""
    monkeypatch.setattr(feed_service, "EXPORT_CHUNK", 1)
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s:
        w = s.workers[0]
        for lease in await leases(s, w, 3):
            await submit(w, lease, ["4"])
        await verify_all(app_state)
        async with app_state.sessionmaker() as session, session.begin():
            secret, row = await create_token(session, role=Role.trainer, name="trainer", pool_ids=[s.pool_id])
        path = f"/v1/pools/{s.pool_id}/rollouts/export"

        # Untouched, the token reads the whole export.
        parts, completed = await asgi_stream(app, path, secret, lambda: asyncio.sleep(0))
        assert completed
        assert len(b"".join(parts).splitlines()) == 3

        async def change_token() -> None:
            r = await s.admin.post(f"/v1/admin/tokens/{row.id}/{change}", headers=s.admin_headers)
            assert r.status_code == 200, r.text

        parts, completed = await asgi_stream(app, path, secret, change_token)
        assert len(b"".join(parts).splitlines()) == 1  # the chunk sent before the change
        assert not completed
        problem(await s.admin.get(path, headers={"Authorization": f"Bearer {secret}"}), 401, "token_invalid")


async def test_an_export_whose_token_is_revoked_before_its_first_chunk_serves_none_of_it(
    app: Any, app_state: Any
) -> None:
    """The export checked its token again only before the chunks after the first, taking the
    first as vouched for by the request's transaction. That transaction commits before the answer
    starts, and the first chunk (up to EXPORT_CHUNK rollouts) is read in a transaction of its own
    after it: a revocation that committed in between (it waits only for transactions under way)
    still had the first chunk served. The token is now read again before every chunk."""
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s:
        w = s.workers[0]
        for lease in await leases(s, w, 2):
            await submit(w, lease, ["4"])
        await verify_all(app_state)
        async with app_state.sessionmaker() as session, session.begin():
            secret, row = await create_token(session, role=Role.trainer, name="trainer", pool_ids=[s.pool_id])

        async def revoke() -> None:
            r = await s.admin.post(f"/v1/admin/tokens/{row.id}/revoke", headers=s.admin_headers)
            assert r.status_code == 200, r.text

        path = f"/v1/pools/{s.pool_id}/rollouts/export"
        parts, completed = await asgi_stream(app, path, secret, revoke, at_start=True)
        assert parts == []  # not one rollout read after the revocation
        assert not completed


async def test_a_page_of_the_feed_reads_at_most_one_results_worth_of_bodies(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page read and parsed every rollout's signed body whole, up to 500 of them, each up to
    ORCH_LIMITS__MAX_RESULT_BODY_BYTES (10 MiB: token ids beside long completions, proofs), the
    nodes' choice: one trainer's page could take gigabytes of the API process's memory. A page
    (and each chunk of the export) now stops once its bodies add up to that limit (the first
    rollout whatever its size) and says has_more; the export serves every rollout all the same."""
    monkeypatch.setattr(feed_service, "EXPORT_CHUNK", 100)
    limit = app_state.settings.limits.max_result_body_bytes
    proof = base64.b64encode(b"\x01" * (limit * 3 // 10)).decode()  # 40 % of the limit
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s:
        w = s.workers[0]
        for lease in await leases(s, w, 3):
            await submit(w, lease, ["4"], proof=proof)
        await verify_all(app_state)

        first = await feed(s, limit=100)
        assert len(first["items"]) == 2 and first["has_more"] is True  # a third: 120 %
        second = await feed(s, limit=100, after=first["next_cursor"])
        assert len(second["items"]) == 1 and second["has_more"] is False

        r = await s.admin.get(f"/v1/pools/{s.pool_id}/rollouts/export", headers=s.headers)
        assert [json.loads(line) for line in r.text.splitlines()] == first["items"] + second["items"]


@postgres_only
@pytest.mark.parametrize("change", ["prune", "reverse"])
@pytest.mark.parametrize("which", ["last", "all"])
async def test_rollouts_that_change_between_a_pages_sizes_and_its_rows_are_neither_served_nor_skip_others(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch, change: str, which: str
) -> None:
    """A page (and an export chunk) reads its rollouts' sizes, then the rollouts by id, two
    statements that each see what committed before them on PostgreSQL. A result whose evidence
    was pruned between them was parsed from its emptied body (a 500 for every read of that page)
    and a verdict reversed between them was served. Such a rollout now drops out as if it had
    changed before the read; the pages that follow, and the export, go on after it and serve
    every other rollout once."""
    monkeypatch.setattr(feed_service, "EXPORT_CHUNK", 2)
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s:
        w = s.workers[0]
        for lease in await leases(s, w, 5):
            await submit(w, lease, ["4"])
        await verify_all(app_state)
        items = (await feed(s, limit=100))["items"]
        verdict_ids = [i["verdict_id"] for i in items]
        real_execute = AsyncSession.execute

        def between_sizes_and_rows(drop: list[int]) -> None:
            pending = True

            async def spy(self: AsyncSession, statement: Any, *args: Any, **kwargs: Any) -> Any:
                nonlocal pending
                sql = str(statement)
                if pending and "submissions.body" in sql and "length(" not in sql:
                    pending = False  # the first read of rows: change them in another transaction
                    async with app_state.sessionmaker() as other, other.begin():
                        if change == "reverse":
                            await other.execute(
                                update(Verdict).where(Verdict.id.in_(drop)).values(reversed_at=utcnow())
                            )
                        else:
                            subs = [i["submission_id"] for i in items if i["verdict_id"] in drop]
                            await other.execute(
                                update(Submission)
                                .where(Submission.id.in_(subs))
                                .values(body=b"", evidence_pruned_at=utcnow())
                            )
                return await real_execute(self, statement, *args, **kwargs)

            monkeypatch.setattr(AsyncSession, "execute", spy)

        # Pages of two: the page's last rollout, or both, change between its two reads.
        drop = verdict_ids[1:2] if which == "last" else verdict_ids[:2]
        between_sizes_and_rows(drop)
        first = await feed(s, limit=2)
        assert [i["verdict_id"] for i in first["items"]] == [v for v in verdict_ids[:2] if v not in drop]
        assert first["has_more"] is True
        rest, _ = await whole_feed(s, limit=2, after=first["next_cursor"])
        assert [i["verdict_id"] for i in first["items"] + rest] == [v for v in verdict_ids if v not in drop]

        # The export, chunks of two: its first chunk's last rollout, or both, change between its reads.
        remaining = [v for v in verdict_ids if v not in drop]
        drop = remaining[1:2] if which == "last" else remaining[:2]
        between_sizes_and_rows(drop)
        r = await s.admin.get(f"/v1/pools/{s.pool_id}/rollouts/export", headers=s.headers)
        assert r.status_code == 200, r.text
        served = [json.loads(line)["verdict_id"] for line in r.text.splitlines()]
        assert served == [v for v in remaining if v not in drop]


async def test_results_signed_with_an_older_policy_carry_their_own_step(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s:
        w = s.workers[0]
        [old] = await leases(s, w, 1)
        assert (await s.publish(2)).status_code == 201
        [new] = await leases(s, w, 1)
        await submit(w, old, ["4"])
        await submit(w, new, ["4"])
        await verify_all(app_state)
        assert [i["policy_step"] for i in (await feed(s))["items"]] == [1, 2]


@postgres_only
async def test_a_verdict_committed_out_of_id_order_is_not_skipped(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=2) as s:
        early, late = s.workers
        [a] = await leases(s, early, 1)
        [b] = await leases(s, late, 1)
        sub_a = (await submit(early, a, ["4"]))["submission_id"]
        sub_b = (await submit(late, b, ["4"]))["submission_id"]

        # A's verdict gets the lower id but commits last; B's commits first.
        a_decided, release = asyncio.Event(), asyncio.Event()
        slow = asyncio.create_task(accept_in_transaction(app_state, sub_a, a_decided, release))
        await asyncio.wait_for(a_decided.wait(), 10)
        await accept_in_transaction(app_state, sub_b, asyncio.Event(), None)

        read = asyncio.create_task(feed(s))
        try:
            await until_waiting(app_state, 1, read, on="table")
            assert not read.done(), "the feed must wait for the verdict still being written"
        finally:
            release.set()
            await slow
        page = await asyncio.wait_for(read, 10)
        assert [i["submission_id"] for i in page["items"]] == [sub_a, sub_b]


@postgres_only
async def test_a_feed_read_that_waits_too_long_is_told_to_retry(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(feed_service, "LOCK_TIMEOUT_MS", 200)
    async with pool_setup(app, app_state, workers=1) as s:
        w = s.workers[0]
        [lease] = await leases(s, w, 1)
        sub = (await submit(w, lease, ["4"]))["submission_id"]
        decided, release = asyncio.Event(), asyncio.Event()
        slow = asyncio.create_task(accept_in_transaction(app_state, sub, decided, release))
        await asyncio.wait_for(decided.wait(), 10)
        try:
            r = await s.admin.get(f"/v1/pools/{s.pool_id}/rollouts", headers=s.headers)
            problem(r, 503, "feed_busy")
            assert r.headers["retry-after"] == "2"
        finally:
            release.set()
            await slow
        assert [i["submission_id"] for i in (await feed(s))["items"]] == [sub]


async def test_integers_past_64_bits_are_served_by_the_page_and_the_export_alike(
    app: Any, app_state: Any
) -> None:
    """A task's metadata may hold any JSON integer (the enqueue accepts it and the paged feed
    serves it), and a body stored before token ids were bounded may too; orjson reads and writes
    only 64-bit ones. The export used to fail on such a rollout (and the page on such a body)."""
    from sqlalchemy import update

    async with pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s:
        w = s.workers[0]
        big = task(prompt="What is 2+2?", verification={"answer": "4"}, metadata={"id": 2**64})
        r = await s.enqueue([big, arithmetic()], key="big-ints")
        assert r.status_code == 201, r.text
        r = await w.claim(s.pool_id, max_tasks=2)
        tasks = {lease["assignment_id"]: await s.task_of(lease) for lease in r.json()["leases"]}
        first, second = sorted(r.json()["leases"], key=lambda lease: tasks[lease["assignment_id"]])
        await submit(w, first, ["4"])
        sub = (await submit(w, second, ["4"]))["submission_id"]
        await verify_all(app_state)
        legacy = answer_body(second, ["4"])
        legacy["samples"][0]["token_ids"] = [10**400, 7]
        async with app_state.sessionmaker() as session, session.begin():
            await session.execute(
                update(Submission).where(Submission.id == sub).values(body=json.dumps(legacy).encode())
            )

        paged, _ = await whole_feed(s, limit=1)
        assert [i["task"]["metadata"] for i in paged] == [{"id": 2**64}, {"source": "arith"}]
        assert paged[1]["samples"][0]["token_ids"] == [10**400, 7]
        r = await s.admin.get(f"/v1/pools/{s.pool_id}/rollouts/export", headers=s.headers)
        assert r.status_code == 200, r.text
        assert [json.loads(line) for line in r.text.splitlines()] == paged


async def test_token_ids_past_64_bits_are_refused_so_the_feed_serves_them_exactly(
    app: Any, app_state: Any
) -> None:
    """The feed reads signed bodies with orjson, which reads an integer past 64 bits as a float:
    a token id of 2^64 + 1, accepted, reached the trainer as 2^64. Such a body is bad input."""
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=10) as s:
        w = s.workers[0]
        [lease] = await leases(s, w, 1)
        for bad in (2**64 + 1, 2**63, -(2**63) - 1):
            body = answer_body(lease, ["4"])
            body["samples"][0]["token_ids"] = [5, bad]
            r = await w.client.post(
                f"/v1/assignments/{lease['assignment_id']}/result", json=body, auth=w.contributor.node_auth
            )
            problem(r, 422, "validation_failed")
        body = answer_body(lease, ["4"])
        body["samples"][0]["token_ids"] = [2**63 - 1, -(2**63), 0]
        r = await w.client.post(
            f"/v1/assignments/{lease['assignment_id']}/result", json=body, auth=w.contributor.node_auth
        )
        assert r.status_code == 201, r.text
        await verify_all(app_state)
        [item] = (await feed(s))["items"]
        assert item["samples"][0]["token_ids"] == [2**63 - 1, -(2**63), 0]


async def test_a_cursor_from_another_pool_or_never_issued_is_refused_instead_of_skipping_rollouts(
    app: Any, app_state: Any
) -> None:
    """A cursor is a verdict id. Pool A's cursor, passed to pool B's feed, used to be read as a
    position in B's feed: B's rollouts below it were skipped for ever, without an error. A
    cursor past the newest verdict (never issued) answered empty pages for as long as ids stayed
    below it, hiding every new rollout."""
    async with (
        pool_setup(app, app_state, workers=1, max_leases_per_node=10) as a,
        pool_setup(app, app_state, workers=1, max_leases_per_node=10) as b,
    ):
        [in_a] = await leases(a, a.workers[0], 1)
        first_b, second_b, wrong_b = await leases(b, b.workers[0], 3)
        await submit(b.workers[0], first_b, ["4"])
        await submit(b.workers[0], wrong_b, ["5"])  # rejected: its verdict id was never a cursor
        await verify_all(app_state)
        await submit(a.workers[0], in_a, ["4"])
        await verify_all(app_state)
        await submit(b.workers[0], second_b, ["4"])
        await verify_all(app_state)
        [a_item] = (await feed(a))["items"]
        b_items = (await feed(b))["items"]
        assert (
            len(b_items) == 2 and b_items[0]["verdict_id"] < a_item["verdict_id"] < b_items[1]["verdict_id"]
        )
        rejected = await verdicts(b.admin, b.headers, b.pool_id)
        [wrong_id] = [v["id"] for v in rejected if v["outcome"] == "rejected"]

        not_issued = [
            a_item["cursor"],  # another pool's
            encode_cursor(f"rollouts:{b_items[-1]['verdict_id'] + 1000}"),  # past the newest verdict
            encode_cursor(f"rollouts:{wrong_id}"),  # a rejected verdict of this pool
            encode_cursor("rollouts:0"),
        ]
        for cursor in not_issued:
            for suffix in ("", "/export"):
                r = await b.admin.get(
                    f"/v1/pools/{b.pool_id}/rollouts{suffix}", params={"after": cursor}, headers=b.headers
                )
                problem(r, 400, "cursor_invalid")
        # B's own cursors still work, a reversed one included.
        page = await feed(b, after=b_items[0]["cursor"])
        assert [i["verdict_id"] for i in page["items"]] == [b_items[1]["verdict_id"]]
        r = await b.admin.post(
            f"/v1/admin/verdicts/{b_items[0]['verdict_id']}/reverse",
            json={"reason": "appeal upheld"},
            headers=b.admin_headers,
        )
        assert r.status_code == 200, r.text
        page = await feed(b, after=b_items[0]["cursor"])
        assert [i["verdict_id"] for i in page["items"]] == [b_items[1]["verdict_id"]]


@postgres_only
async def test_verdicts_are_written_while_a_feed_page_is_being_built(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read's table lock (which makes it wait for verdicts still being written) was held to
    the end of the request, while the page's signed bodies were parsed and built: up to 500
    results of up to 1024 samples each. Every verdict (the verifier's, a validator's, an
    appeal) waited that long, as did whatever those transactions had locked already."""
    import threading

    building, release = threading.Event(), threading.Event()
    real = feed_service._rollouts

    def slow_rollouts(rows: Any) -> Any:
        building.set()
        assert release.wait(20)
        return real(rows)

    monkeypatch.setattr(feed_service, "_rollouts", slow_rollouts)
    async with pool_setup(app, app_state, workers=2) as s:
        first, second = s.workers
        [a] = await leases(s, first, 1)
        [b] = await leases(s, second, 1)
        sub_a = (await submit(first, a, ["4"]))["submission_id"]
        sub_b = (await submit(second, b, ["4"]))["submission_id"]
        await accept_in_transaction(app_state, sub_a, asyncio.Event(), None)

        read = asyncio.create_task(feed(s))
        accept = None
        try:
            assert await asyncio.to_thread(building.wait, 10)
            accept = asyncio.create_task(accept_in_transaction(app_state, sub_b, asyncio.Event(), None))
            done, _ = await asyncio.wait({accept}, timeout=HANG_S)
            assert accept in done, "a verdict must not wait for a feed page to be built"
        finally:
            release.set()
            page = await asyncio.wait_for(read, 20)
            if accept is not None:
                await asyncio.wait_for(accept, 20)
        # The page is what had committed when it was read; the new verdict comes next.
        assert [i["submission_id"] for i in page["items"]] == [sub_a]
        monkeypatch.setattr(feed_service, "_rollouts", real)
        later = await feed(s, after=page["next_cursor"])
        assert [i["submission_id"] for i in later["items"]] == [sub_b]


async def test_a_fraud_verdict_withdraws_its_nodes_rollouts_in_the_hold_window_until_appealed(
    app: Any, app_state: Any
) -> None:
    """INTELLECT-2's window: the work a fraud verdict's node did within the hold window is as
    suspect as its forfeited rewards. Those rollouts leave the feed, whether or not they earned a
    reward; older ones, another node's and the node's later ones stay; an appeal brings them back."""
    open_ended = {"prompt": "Name the capital of France.", "sampling": {"max_tokens": 64}}
    async with pool_setup(app, app_state, workers=2, economics=ECON, stake=1000, max_leases_per_node=10) as s:
        cheat, honest = s.workers
        [old] = await leases(s, cheat, 1)
        await submit(cheat, old, ["4"])
        await verify_all(app_state)
        async with app_state.sessionmaker() as session, session.begin():  # its window is over
            await session.execute(update(Verdict).values(hold_until=Verdict.decided_at))
        [recent] = await leases(s, cheat, 1)
        await submit(cheat, recent, ["4"])
        assert (await s.enqueue([open_ended], key="unchecked")).status_code == 201
        [unpaid] = (await cheat.claim(s.pool_id)).json()["leases"]
        await submit(cheat, unpaid, ["Paris"])  # accepted unchecked, for no reward
        [other] = await leases(s, honest, 1)
        await submit(honest, other, ["4"])
        await verify_all(app_state)
        items = (await feed(s))["items"]
        everything = [i["verdict_id"] for i in items]
        assert len(everything) == 4
        # The old one was decided first; the others in the verifier's order (on PostgreSQL by
        # provider partition), so each is found by its node and reward.
        old_id = everything[0]
        [other_id] = [i["verdict_id"] for i in items if i["node_id"] == honest.node_id]
        [recent_id] = [
            i["verdict_id"] for i in items[1:] if i["node_id"] == cheat.node_id and i["reward"] == 1.0
        ]
        [unpaid_id] = [
            i["verdict_id"] for i in items if i["node_id"] == cheat.node_id and i["reward"] is None
        ]

        [forged] = await leases(s, cheat, 1)
        await submit(cheat, forged, ["5"], claimed_reward=1.0)  # a reward claim the server refutes
        await verify_all(app_state)
        fraud = (await verdicts(s.admin, s.headers, s.pool_id))[-1]
        assert fraud["category"] == "fraud"
        [later] = await leases(s, cheat, 1)
        await submit(cheat, later, ["4"])
        await verify_all(app_state)
        later_id = (await verdicts(s.admin, s.headers, s.pool_id))[-1]["id"]

        kept = sorted([old_id, other_id, later_id])
        assert [i["verdict_id"] for i in (await feed(s))["items"]] == kept
        exported = await s.admin.get(f"/v1/pools/{s.pool_id}/rollouts/export", headers=s.headers)
        assert [json.loads(line)["verdict_id"] for line in exported.text.splitlines()] == kept
        trainer = await trainer_headers(app_state, [s.pool_id])
        listed = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/verdicts", headers=trainer)
        assert listed.status_code == 200, listed.text
        withdrawn = {v["id"]: v["withdrawn_by"] for v in listed.json()["items"]}
        assert withdrawn == {
            old_id: None,
            recent_id: fraud["id"],
            unpaid_id: fraud["id"],
            other_id: None,
            fraud["id"]: None,
            later_id: None,
        }

        r = await s.admin.post(
            f"/v1/admin/verdicts/{fraud['id']}/reverse",
            json={"reason": "appeal upheld"},
            headers=s.admin_headers,
        )
        assert r.status_code == 200, r.text
        assert [i["verdict_id"] for i in (await feed(s))["items"]] == [*everything, later_id]
