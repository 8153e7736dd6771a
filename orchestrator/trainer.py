"""The trainer SDK: follow a pool's accepted rollouts and the changes to them.

A trainer reads the feed (``GET /v1/pools/{id}/rollouts``) forward. A rollout it has taken may
later stop counting (its verdict reversed on appeal, or withdrawn by a fraud verdict against its
node) or count again (that fraud verdict reversed); the change notices
(``GET /v1/pools/{id}/rollouts/changes``) say so, in commit order. ``FeedFollower`` reads both
and turns them into what a trainer does::

    follower = FeedFollower(http, pool_id, token, state=FollowState.from_json(saved))
    async for event in follower.follow():
        if isinstance(event, Take):
            buffer[event.verdict_id] = event.rollout  # train on it
        else:
            buffer.pop(event.verdict_id, None)  # stop using it (unlearn if you can)
        saved = follower.state.to_json()  # once the event is applied

The rules it applies (README, "The trainer feed"): every feed item is a ``Take``; a notice of a
rollout at or before the follower's place in the feed is a ``Take`` (of the rollout as the feed
serves it) if the rollout stands as the notice is read, else a ``Drop``; a notice past that
place is skipped, because the feed serves that rollout, or leaves it out, as it stands when the
follower gets there. Events are idempotent by ``verdict_id`` (a rollout may be taken, or
dropped, more than once): apply them as "the rollout counts" / "it does not". A notice whose
rollout stands but whose evidence was pruned carries no rollout and gives no event.

``state`` is the follower's whole position (three values). Persist it after applying the
events of a ``poll`` (or each event of ``follow``): restarted from it, the follower reads on from
there, and what it reads again is only what was not yet applied.

GETs are idempotent, so each is retried (tenacity; exponential backoff with full jitter) on
transport errors, 429 and 5xx, ``Retry-After`` honoured (a PostgreSQL feed answers 503
``feed_busy`` while verdicts are being written). Error answers are raised as
``OrchestratorAPIError`` with the problem's ``code``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt

from orchestrator.worker.errors import Backoff, OrchestratorAPIError

__all__ = ["Drop", "FeedFollower", "FollowState", "OrchestratorAPIError", "Take"]

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass
class FollowState:
    """Where a follower is: the last rollout taken from the feed, and both cursors."""

    position: int = 0
    feed_cursor: str | None = None
    changes_cursor: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | None) -> FollowState:
        """A saved state; a new one (the beginning of both) for None or an empty string."""
        if not text:
            return cls()
        raw = json.loads(text)
        return cls(
            position=int(raw.get("position", 0)),
            feed_cursor=raw.get("feed_cursor"),
            changes_cursor=raw.get("changes_cursor"),
        )


@dataclass(frozen=True)
class Take:
    """The rollout counts: train on it (again, if you had dropped it)."""

    verdict_id: int
    rollout: dict[str, Any]


@dataclass(frozen=True)
class Drop:
    """The rollout no longer counts: ``notice`` is the change notice that says why."""

    verdict_id: int
    notice: dict[str, Any]


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, OrchestratorAPIError):
        return exc.status in RETRY_STATUSES
    return isinstance(exc, httpx.TransportError)


class FeedFollower(Backoff):
    """Reads a pool's feed and its change notices with a trainer's (or operator's) bearer token."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        pool_id: str,
        token: str,
        *,
        state: FollowState | None = None,
        page_size: int = 100,
        max_retries: int = 5,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        retry_after_cap_s: float = 60.0,
    ) -> None:
        if not 1 <= page_size <= 500:
            raise ValueError("page_size must be 1 to 500 (the feed's limit)")
        self._http = http
        self._headers = {"Authorization": f"Bearer {token}"}
        self._base = f"/v1/pools/{pool_id}/rollouts"
        self.state = state or FollowState()
        self.page_size = page_size
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.retry_after_cap_s = retry_after_cap_s
        #: Whether the last ``poll`` reached the end of both the feed and the notices.
        self.caught_up = False

    async def poll(self) -> list[Take | Drop]:
        """One page of the feed, then one page of notices: their events, in order. Advances
        ``state`` (only once both pages are read); ``caught_up`` says whether both were read
        to their end."""
        steps, final = await self._read()
        self.state = final
        return [event for event, _ in steps]

    async def _read(self) -> tuple[list[tuple[Take | Drop, FollowState]], FollowState]:
        """The events of one feed page and one notices page, each with the state that includes
        it (and everything before it), and the state after both pages."""
        state = self.state  # never changed in place: each step is a new state
        steps: list[tuple[Take | Drop, FollowState]] = []
        feed = await self._page("", state.feed_cursor)
        for item in feed["items"]:
            state = replace(state, position=item["verdict_id"], feed_cursor=item["cursor"])
            steps.append((Take(item["verdict_id"], item), state))
        state = replace(state, feed_cursor=feed["next_cursor"])
        notices = await self._page("/changes", state.changes_cursor)
        for notice in notices["items"]:
            state = replace(state, changes_cursor=notice["cursor"])
            verdict_id = notice["verdict_id"]
            if verdict_id > state.position:
                continue  # the feed serves it, or not, as it stands when the follower gets there
            if not notice["stands"]:
                steps.append((Drop(verdict_id, notice), state))
            elif notice["rollout"] is not None:
                steps.append((Take(verdict_id, notice["rollout"]), state))
        self.caught_up = not feed["has_more"] and not notices["has_more"]
        return steps, replace(state, changes_cursor=notices["next_cursor"])

    async def follow(self, interval_s: float = 2.0) -> AsyncIterator[Take | Drop]:
        """``poll`` for ever, waiting ``interval_s`` whenever both are read to their end. When an
        event is yielded, ``state`` is the state that includes it and nothing after it."""
        while True:
            steps, final = await self._read()
            for event, state in steps:
                self.state = state
                yield event
            self.state = final
            if self.caught_up:
                await asyncio.sleep(interval_s)

    async def _page(self, suffix: str, cursor: str | None) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": self.page_size}
        if cursor is not None:
            params["after"] = cursor
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_retries + 1),
            wait=self._wait,
            retry=retry_if_exception(_retryable),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                response = await self._http.get(self._base + suffix, params=params, headers=self._headers)
                if response.is_error:
                    raise OrchestratorAPIError.from_response(response)
                page: dict[str, Any] = response.json()
                return page
        raise AssertionError("unreachable: tenacity either returns or reraises")  # pragma: no cover
