"""``orchestrator admin prune-evidence``: the signed bodies of results decided long ago are
archived, then emptied; nothing is emptied that is not in the archive, results still waiting are
left whole, and what reads bodies (the feed, the evidence check) says so."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import errno
import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update
from typer.testing import CliRunner, Result

from orchestrator.audit.models import AuditEntry
from orchestrator.cli import app as cli
from orchestrator.settings import Settings, get_settings
from orchestrator.tasks import evidence, retention
from orchestrator.tasks.models import Submission
from orchestrator.verification.models import Verdict
from tests.conftest import postgres_only
from tests.tasks_helpers import PoolSetup, pool_setup, task
from tests.verification_helpers import submit, verify_all

pytestmark = pytest.mark.usefixtures("no_audits")


async def prune(settings: Settings, *args: str) -> Result:
    """The command, on the test's database, in a thread (it runs its own event loop)."""

    def run() -> Result:
        get_settings.cache_clear()
        try:
            env = {"ORCH_DB__URL": settings.db.url, "COLUMNS": "200"}
            return CliRunner().invoke(cli, ["admin", "prune-evidence", *args], env=env)
        finally:
            get_settings.cache_clear()

    return await asyncio.to_thread(run)


async def stored(app_state: Any) -> dict[int, tuple[bytes, dt.datetime | None]]:
    async with app_state.sessionmaker() as session:
        rows = await session.execute(select(Submission.id, Submission.body, Submission.evidence_pruned_at))
        return {i: (bytes(body), at) for i, body, at in rows.all()}


async def decided_days_ago(app_state: Any, days: float) -> None:
    async with app_state.sessionmaker() as session, session.begin():
        then = dt.datetime.now(dt.UTC) - dt.timedelta(days=days)
        await session.execute(update(Verdict).values(decided_at=then))


@asynccontextmanager
async def three_results(
    app: Any, app_state: Any
) -> AsyncIterator[tuple[PoolSetup, dict[int, tuple[bytes, dt.datetime | None]]]]:
    """A pool with two results decided 3 days ago (one accepted, one rejected) and one still
    waiting for the verifier; and their stored bodies."""
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=3) as s:
        w = s.workers[0]
        await s.enqueue([task(), task(), task()])
        for answer in ("4", "5"):
            await submit(w, (await w.claim(s.pool_id)).json()["leases"][0], [answer])
        await verify_all(app_state)
        await decided_days_ago(app_state, 3)
        await submit(w, (await w.claim(s.pool_id)).json()["leases"][0], ["4"])
        yield s, await stored(app_state)


async def test_old_results_are_archived_then_emptied_and_waiting_ones_kept(
    app: Any, app_state: Any, settings: Settings, tmp_path: Path
) -> None:
    async with three_results(app, app_state) as (s, before):
        first, second, waiting = sorted(before)
        size = len(before[first][0]) + len(before[second][0])
        feed = await s.admin.get(f"/v1/pools/{s.pool_id}/rollouts", headers=s.headers)
        assert [r["submission_id"] for r in feed.json()["items"]] == [first]

        # Decided 3 days ago: not more than 4 days ago.
        archive = tmp_path / "evidence.jsonl.gz"
        done = await prune(settings, "--older-than-days", "4", "--archive", str(archive))
        assert done.exit_code == 0, done.output
        assert "nothing to prune" in done.output and not archive.exists()

        dry = await prune(settings, "--older-than-days", "2", "--dry-run")
        assert dry.exit_code == 0, dry.output
        assert f"would prune 2 results ({size} bytes of signed bodies)" in dry.output
        assert await stored(app_state) == before and not archive.exists()

        done = await prune(settings, "--older-than-days", "2", "--archive", str(archive), "--batch-size", "1")
        assert done.exit_code == 0, done.output
        assert f"pruned 2 results ({size} bytes of signed bodies)" in done.output

        # The archive holds each whole request; the database keeps only the waiting one's body.
        lines = [json.loads(line) for line in gzip.decompress(archive.read_bytes()).splitlines()]
        assert [line["submission_id"] for line in lines] == [first, second]
        assert [line["verdict"]["outcome"] for line in lines] == ["accepted", "rejected"]
        after = await stored(app_state)
        for line in lines:
            body = base64.b64decode(line["body_base64"])
            assert body == before[line["submission_id"]][0]
            assert hashlib.sha256(body).hexdigest() == line["body_sha256"]
            assert after[line["submission_id"]][0] == b"" and after[line["submission_id"]][1] is not None
        assert after[waiting] == before[waiting]

        # The archived request still verifies against the signature the database kept.
        async with app_state.sessionmaker() as session:
            kept = await session.get(Submission, first)
            assert kept is not None
            assert evidence.recheck(kept, window_s=300).code == "evidence_pruned"
            kept.body = base64.b64decode(lines[0]["body_base64"])
            kept.evidence_pruned_at = None
            assert evidence.recheck(kept, window_s=300).valid
            await session.rollback()

        # What reads bodies says so: the feed leaves the result out, the task's view has no body.
        feed = await s.admin.get(f"/v1/pools/{s.pool_id}/rollouts", headers=s.headers)
        assert feed.json()["items"] == []
        task_id = await s.admin.get(f"/v1/admin/pools/{s.pool_id}/tasks", headers=s.headers)
        views = []
        for t in task_id.json()["items"]:
            r = await s.admin.get(
                f"/v1/admin/pools/{s.pool_id}/tasks/{t['id']}/submissions",
                params={"include_body": "true"},
                headers=s.headers,
            )
            views += r.json()["submissions"]
        by_id = {v["id"]: v for v in views}
        assert by_id[first]["check"]["code"] == "evidence_pruned"
        assert by_id[first]["evidence"]["body_base64"] is None
        assert by_id[first]["evidence"]["pruned_at"] is not None
        assert by_id[waiting]["check"]["valid"] and by_id[waiting]["evidence"]["pruned_at"] is None

        # Audited once; a second run finds nothing left and writes no archive.
        again = await prune(settings, "--older-than-days", "2", "--archive", str(tmp_path / "again.jsonl"))
        assert again.exit_code == 0 and "nothing to prune" in again.output
        assert not (tmp_path / "again.jsonl").exists()
        async with app_state.sessionmaker() as session:
            entries = (
                await session.execute(select(AuditEntry).where(AuditEntry.action == "evidence.prune"))
            ).scalars()
            [entry] = list(entries)
        assert (entry.actor, entry.after["submissions"], entry.after["body_bytes"]) == ("cli", 2, size)
        assert entry.after["archive"] == str(archive.resolve())


async def test_an_archive_that_exists_or_is_missing_is_refused_before_anything_changes(
    app: Any, app_state: Any, settings: Settings, tmp_path: Path
) -> None:
    async with three_results(app, app_state) as (_, before):
        taken = tmp_path / "taken.jsonl"
        taken.write_bytes(b"an earlier run's\n")
        for args, says in (
            (["--archive", str(taken)], "exists and is not an evidence archive"),
            ([], "name the file that keeps the pruned evidence"),
            (["--archive", str(tmp_path / "no" / "such.jsonl")], "is not a writable directory"),
        ):
            r = await prune(settings, "--older-than-days", "1", *args)
            assert r.exit_code == 2, r.output
            assert says in " ".join(r.output.split())
        assert taken.read_bytes() == b"an earlier run's\n"
        assert await stored(app_state) == before


@postgres_only
async def test_two_runs_at_once_archive_and_prune_each_result_once(
    app: Any, app_state: Any, tmp_path: Path
) -> None:
    async with pool_setup(app, app_state, workers=1, max_leases_per_node=6) as s:
        w = s.workers[0]
        await s.enqueue([task() for _ in range(6)])
        for lease in (await w.claim(s.pool_id, max_tasks=6)).json()["leases"]:
            await submit(w, lease, ["4"])
        await verify_all(app_state)
        now = dt.datetime.now(dt.UTC)
        archives = [retention.Archive(tmp_path / f"run-{i}.jsonl") for i in range(2)]
        batches: list[int] = []
        try:
            reports = await asyncio.gather(
                *(
                    retention.prune(
                        app_state.sessionmaker,
                        a,
                        cutoff=now,
                        now=now,
                        batch=1,
                        on_batch=lambda n, _: batches.append(n),
                    )
                    for a in archives
                )
            )
        finally:
            for a in archives:
                a.close()
    archived = [
        [json.loads(line)["submission_id"] for line in a.path.read_text().splitlines()]
        for a in archives
        if a.path.exists()
    ]
    everything = sorted(await stored(app_state))
    assert sorted(i for ids in archived for i in ids) == everything  # each result in one archive, once
    assert sum(r.submissions for r in reports) == 6
    assert batches == [1] * 6  # the progress bar's steps
    assert all(body == b"" and at is not None for body, at in (await stored(app_state)).values())


async def test_a_gzip_archive_of_a_run_killed_between_batches_reads_whole(
    app: Any, app_state: Any, tmp_path: Path
) -> None:
    async with three_results(app, app_state):
        path = tmp_path / "evidence.jsonl.gz"
        archive = retention.Archive(path)
        left: list[bytes] = []  # the file as a kill after each batch's commit leaves it
        try:
            now = dt.datetime.now(dt.UTC)
            await retention.prune(
                app_state.sessionmaker,
                archive,
                cutoff=now - dt.timedelta(days=2),
                now=now,
                batch=1,
                on_batch=lambda *_: left.append(path.read_bytes()),
            )
        finally:
            archive.close()
        emptied = sorted(i for i, (body, at) in (await stored(app_state)).items() if at is not None)
    assert len(left) == 2
    for n, data in enumerate(left, start=1):
        lines = [json.loads(line) for line in gzip.decompress(data).splitlines()]
        assert [line["submission_id"] for line in lines] == emptied[:n]
    assert gzip.decompress(path.read_bytes()).count(b"\n") == 2


class ShortWriteThenFull:
    """The archive's file, on a disk that fills during the second write: part of that write
    lands (a short write), then ENOSPC."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.writes = raw, 0

    def write(self, data: bytes) -> int:
        self.writes += 1
        if self.writes == 2:
            self.raw.write(bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return int(self.raw.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


@pytest.mark.parametrize("name", ["evidence.jsonl.gz", "evidence.jsonl"])
async def test_a_write_that_fills_the_disk_part_way_leaves_the_archive_whole(
    app: Any, app_state: Any, tmp_path: Path, name: str
) -> None:
    """The first batch's bodies are emptied (they are only in the archive now); the second's
    write fails part way: the file is cut back to the first batch, which still reads whole (a
    torn gzip member was EOFError for every line; a plain file ended in half a line)."""
    async with three_results(app, app_state):
        path = tmp_path / name
        archive = retention.Archive(path)
        archive._raw = ShortWriteThenFull(archive._raw)  # type: ignore[assignment]
        now = dt.datetime.now(dt.UTC)
        try:
            with pytest.raises(OSError, match="No space left"):
                await retention.prune(
                    app_state.sessionmaker, archive, cutoff=now - dt.timedelta(days=2), now=now, batch=1
                )
        finally:
            archive.close()
        emptied = sorted(i for i, (_, at) in (await stored(app_state)).items() if at is not None)
    data = path.read_bytes()
    lines = (gzip.decompress(data) if name.endswith(".gz") else data).splitlines(keepends=True)
    assert [json.loads(line)["submission_id"] for line in lines] == emptied and len(emptied) == 1
    assert lines[-1].endswith(b"\n")


async def test_a_run_that_fails_midway_audits_what_it_pruned(
    app: Any, app_state: Any, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with three_results(app, app_state) as (_, before):
        write = retention.Archive.write
        writes: list[int] = []

        def disk_fills(archive: retention.Archive, lines: list[bytes]) -> None:
            writes.append(len(lines))
            if len(writes) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            write(archive, lines)

        monkeypatch.setattr(retention.Archive, "write", disk_fills)
        archive = tmp_path / "evidence.jsonl"
        r = await prune(settings, "--older-than-days", "2", "--archive", str(archive), "--batch-size", "1")
        assert r.exit_code != 0
        emptied = [i for i, (_, at) in (await stored(app_state)).items() if at is not None]
        assert len(emptied) == 1  # the first batch was archived and emptied before the disk filled
        async with app_state.sessionmaker() as session:
            entries = list(
                (
                    await session.execute(select(AuditEntry).where(AuditEntry.action == "evidence.prune"))
                ).scalars()
            )
        assert [(e.after["submissions"], e.after["body_bytes"]) for e in entries] == [
            (1, len(before[emptied[0]][0]))
        ]
        assert entries[0].after["archive"] == str(archive.resolve())


async def test_a_pool_that_does_not_exist_is_refused_not_found_empty(
    app: Any, app_state: Any, settings: Settings, tmp_path: Path
) -> None:
    async with three_results(app, app_state) as (s, before):
        archive = tmp_path / "evidence.jsonl"
        for args in (["--archive", str(archive)], ["--dry-run"]):
            r = await prune(settings, "--older-than-days", "2", "--pool", s.pool_id + "x", *args)
            assert r.exit_code == 2, r.output
            assert f"no pool {s.pool_id}x" in r.output and "prune" not in r.output
        assert not archive.exists() and await stored(app_state) == before
        r = await prune(settings, "--older-than-days", "2", "--pool", s.pool_id, "--dry-run")
        assert r.exit_code == 0 and "would prune 2 results" in r.output


# A prune-evidence run that is SIGKILLed in the middle of its second batch's write: half of that
# write is on disk (a torn gzip member, a torn line), and its transaction never commits.
KILLED_MID_WRITE = """
import os, signal, sys
from orchestrator.cli import app
from orchestrator.tasks import retention

class Torn:
    def __init__(self, raw):
        self.raw, self.writes = raw, 0
    def write(self, data):
        self.writes += 1
        if self.writes == 2:
            self.raw.write(bytes(data[: len(data) // 2]))
            os.kill(os.getpid(), signal.SIGKILL)
        return self.raw.write(data)
    def __getattr__(self, name):
        return getattr(self.raw, name)

opened = retention.Archive.__init__
def torn(self, path, **kwargs):
    opened(self, path, **kwargs)
    self._raw = Torn(self._raw)
retention.Archive.__init__ = torn
app(["admin", "prune-evidence", *sys.argv[1:]])
"""


@pytest.mark.parametrize("name", ["evidence.jsonl.gz", "evidence.jsonl"])
async def test_the_next_run_cuts_off_the_batch_a_killed_run_tore_and_archives_it_once(
    app: Any, app_state: Any, settings: Settings, tmp_path: Path, name: str
) -> None:
    async with three_results(app, app_state) as (_, before):
        first, second, waiting = sorted(before)
        path = tmp_path / name
        args = ["--older-than-days", "2", "--archive", str(path), "--batch-size", "1"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
        killed = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", KILLED_MID_WRITE, *args],
            env=env | {"ORCH_DB__URL": settings.db.url, "PYTHONPATH": str(Path(__file__).parents[1])},
            capture_output=True,
        )
        assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
        after = await stored(app_state)
        assert after[first][1] is not None and after[second] == before[second]  # 2nd not emptied
        torn = path.read_bytes()
        if name.endswith(".gz"):
            with pytest.raises(EOFError):  # the whole file is unreadable, not just the torn batch
                gzip.decompress(torn)
        else:
            assert not torn.endswith(b"\n")

        again = await prune(settings, *args)
        assert again.exit_code == 0, again.output
        said = " ".join(again.output.split())
        assert "bytes off the end of" in said and "pruned 1 results" in said
        data = path.read_bytes()
        lines = (gzip.decompress(data) if name.endswith(".gz") else data).splitlines(keepends=True)
        assert [json.loads(line)["submission_id"] for line in lines] == [first, second]
        assert all(line.endswith(b"\n") for line in lines)
        assert base64.b64decode(json.loads(lines[1])["body_base64"]) == before[second][0]
        after = await stored(app_state)
        assert after[second] == (b"", after[second][1]) and after[second][1] is not None
        assert after[waiting] == before[waiting]

        # A run with nothing left to prune keeps the archive as it is.
        nothing = await prune(settings, *args)
        assert nothing.exit_code == 0 and "nothing added to" in " ".join(nothing.output.split())
        assert path.read_bytes() == data


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("evidence.jsonl", b'{"submission_id":1}\nnot an archive line'),
        ("evidence.jsonl", b'{"submission_id":1}\n\0\0\0\0'),  # zeros, not a torn write
        ("notes.txt", b"no newline at all"),
        ("evidence.jsonl.gz", b"not gzip'd at all\n"),
        ("evidence.jsonl.gz", gzip.compress(b"some other text\n", mtime=0)),
        ("evidence.jsonl.gz", gzip.compress(b'{"submission_id":1}\n', mtime=0) + b"\0" * 16),
        ("evidence.jsonl.gz", gzip.compress(b'{"submission_id":1}\n', mtime=0)[:-12] + b"x" * 12),
    ],
    # Named, not by their bytes: a gzip header holds its time, which pytest-xdist's workers
    # would each collect differently.
    ids=["bad-line", "zeros", "no-newline", "not-gzip", "gzip-other-text", "gzip-zeros", "gzip-bad-trailer"],
)
async def test_an_existing_file_that_is_not_an_archive_is_refused_untouched(
    app: Any, app_state: Any, settings: Settings, tmp_path: Path, name: str, content: bytes
) -> None:
    async with three_results(app, app_state) as (_, before):
        path = tmp_path / name
        path.write_bytes(content)
        r = await prune(settings, "--older-than-days", "2", "--archive", str(path))
        assert r.exit_code == 2, r.output
        assert "is not an evidence archive" in " ".join(r.output.split())
        assert path.read_bytes() == content
        assert await stored(app_state) == before


async def test_an_archive_another_run_writes_to_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "evidence.jsonl"
    first = retention.Archive(path)
    try:
        first.write([b'{"submission_id":1}\n'])
        with pytest.raises(retention.ArchiveBusy):
            retention.Archive(path)
    finally:
        first.close()
    again = retention.Archive(path)
    again.close()
    assert path.read_bytes() == b'{"submission_id":1}\n'


@pytest.mark.parametrize("name", ["evidence.jsonl.gz", "evidence.jsonl"])
def test_an_archive_cut_anywhere_in_its_last_batch_is_cut_back_to_what_reads_whole(
    tmp_path: Path, name: str
) -> None:
    """Wherever the kill fell in the last batch's write (in a gzip member's header, its data,
    its trailer; in a line), the next run keeps all that reads whole before it: every earlier
    batch; gzip'd, none of the torn batch (a member is a batch), so every batch is in the file
    once; plain, the torn batch's lines written whole, if any (named again by the next run)."""
    batches = [
        [b'{"submission_id":%d,"n":"%s"}\n' % (i, b"x" * 40 * i) for i in (2 * b, 2 * b + 1)]
        for b in range(3)
    ]
    gzipped = name.endswith(".gz")
    path = tmp_path / name
    archive = retention.Archive(path)
    ends = []
    for lines in batches:
        archive.write(lines)
        ends.append(path.stat().st_size)
    archive.close()
    whole = path.read_bytes()

    def content(data: bytes) -> bytes:
        return gzip.decompress(data) if gzipped else data

    assert content(whole) == b"".join(line for b in batches for line in b)
    for cut in range(ends[1] + 1, ends[2]):
        path.write_bytes(whole[:cut])
        kept = ends[1] if gzipped else whole.rfind(b"\n", 0, cut) + 1
        resumed = retention.Archive(path)
        try:
            assert resumed.cut == cut - kept, cut
            resumed.write(batches[2])
        finally:
            resumed.close()
        assert content(path.read_bytes()) == content(whole[:kept]) + b"".join(batches[2]), cut


async def test_a_torn_end_holding_results_already_emptied_is_refused_untouched(
    app: Any, app_state: Any, settings: Settings, tmp_path: Path
) -> None:
    """Before each batch was a gzip member of its own, a run wrote one gzip stream, finished only
    at its end: one killed in its third batch left a single torn member holding the first two,
    whose bodies it had emptied. Cutting that member off would destroy the only copy of their
    evidence, so such an archive is refused, untouched, like any file the next run cannot
    safely append to."""
    async with three_results(app, app_state) as (_, before):
        first, second, _waiting = sorted(before)
        plain = tmp_path / "plain.jsonl"
        r = await prune(settings, "--older-than-days", "2", "--archive", str(plain))
        assert r.exit_code == 0, r.output
        emptied = await stored(app_state)
        assert emptied[first][1] is not None and emptied[second][1] is not None
        path = tmp_path / "evidence.jsonl.gz"
        old = gzip.compress(plain.read_bytes(), mtime=0)[:-10]  # one stream, killed before its end
        path.write_bytes(old)
        again = await prune(settings, "--older-than-days", "2", "--archive", str(path))
        assert again.exit_code == 2, again.output
        said = " ".join(again.output.split())
        assert "already emptied" in said, said
        assert path.read_bytes() == old
        assert await stored(app_state) == emptied


def test_an_archive_changed_since_its_torn_end_was_checked_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "evidence.jsonl"
    path.write_bytes(b'{"submission_id":1}\n{"submission_id":2')
    checked = retention.whole_length(path)
    with path.open("ab") as f:  # another run wrote (and was killed) after the check
        f.write(b'}\n{"submission_id":3')
    with pytest.raises(retention.ArchiveBusy):
        retention.Archive(path, checked=checked)
    assert path.read_bytes() == b'{"submission_id":1}\n{"submission_id":2}\n{"submission_id":3'
