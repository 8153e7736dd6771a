"""The hot store: short-lived, high-write state that does not belong in SQL.

It holds signature nonces, liveness (last heartbeat per node, in sorted sets by stage so
the sweeper reads only what changed), and rate-limit counters. ``RedisHotStore`` is the
production implementation and works across any number of API processes;
``MemoryHotStore`` serves the embedded default and is only correct inside one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import redis.asyncio as aioredis
import structlog

from orchestrator.core import metrics
from orchestrator.core.clock import CLOCK_SKEW_WARN_S
from orchestrator.core.errors import ServiceUnavailable

if TYPE_CHECKING:
    from orchestrator.settings import RedisSettings

log = structlog.get_logger(__name__)

# The key (under the store's prefix) that says since when, in whole epoch seconds of Redis's own
# clock (``TIME``), this Redis has held the spent nonces: set by the first admission that finds
# it missing (a new Redis, or one that lost its keys), and never expiring. Redis's clock, not the
# finding API process's: every process then refuses by the same time, and one whose clock runs
# ahead no longer sets a marker in the future that refuses the requests signed afresh meanwhile.
NONCES_SINCE_KEY = "nonces-since"

# The in-process store's limit on live nonces, and separately on live rate-limit counters
# (about 250 bytes each: some 125 MB of nonces when full).
MEMORY_STORE_MAX_KEYS = 500_000

# Liveness stages, as sorted sets: member = node id, score = last beat (epoch seconds).
# ``dying`` holds the nodes the sweeper is marking dead, until their SQL transition commits.
HEALTHY = "healthy"
UNHEALTHY = "unhealthy"
DYING = "dying"
STAGES = (HEALTHY, UNHEALTHY, DYING)


@dataclass(frozen=True)
class RateDecision:
    allowed: bool
    remaining: int
    retry_after_s: int


@dataclass(frozen=True)
class Quota:
    """A rate limit a signed request counts toward (``HotStore.admit``): up to ``limit`` in
    ``bucket`` in a fixed window of ``window_s`` (as ``HotStore.hit`` counts them; a limit of 0
    counts nothing and allows all). ``what`` names what is counted, for the refusal's detail."""

    bucket: str
    limit: int
    window_s: int
    what: str = field(default="", compare=False)


@dataclass(frozen=True)
class Admitted:
    """``HotStore.admit``'s answer for a nonce not spent yet: ``refused_by`` the first quota the
    request is past (None: within them all, and its nonce is spent now)."""

    refused_by: Quota | None
    retry_after_s: int = 0
    #: Set when the request is refused because the store holds the nonces spent only since
    #: this time (epoch seconds; it lost those before) and the signature was created earlier:
    #: its nonce may have been spent then. Nothing was counted, and the nonce is not spent.
    forgotten_before: int | None = None


class HotStore(Protocol):
    shared_across_processes: bool

    async def ping(self) -> bool:
        """Whether the store answers and takes writes (raises, or False, if not)."""

    async def admit(
        self, keyid: str, nonce: str, ttl_s: int, quotas: Sequence[Quota], now: float, created: int
    ) -> Admitted | None:
        """When the nonce is new, count the request toward each of ``quotas`` in turn, up to the
        first it is past (none after that one counted), and, if it is within them all, spend the
        nonce, in one step: None if the nonce was already spent. A replay
        counts nothing, so replaying a captured request cannot spend its signer's limits (nor a
        registration's); a request refused for a limit spends no nonce, so the same signed
        request can be sent again after ``retry_after_s``. A store that lost the nonces spent
        before some time (Redis emptied: its marker, ``NONCES_SINCE_KEY``, gone with them; the
        time is the one its own clock read when an admission found the marker gone, not
        ``now``) refuses a signature ``created`` earlier as a possible replay
        (``Admitted.forgotten_before``), counting nothing and spending no nonce. ``now`` (the
        caller's clock) places the request in the quotas' windows."""

    async def unadmit(
        self, keyid: str, nonce: str, quotas: Sequence[Quota], now: float, *, spent: bool
    ) -> None:
        """Undo ``admit`` (same ``quotas`` and ``now``) of a request that then did nothing: take
        its count back from each of ``quotas`` and, unless ``spent`` (a replay found elsewhere:
        the nonce stays spent), forget its nonce."""

    async def record_beat(self, node_id: str, at: float, metrics: Mapping[str, str], ttl_s: int) -> None:
        """Mark the node healthy as of ``at`` and keep its latest metrics for ``ttl_s``."""

    async def last_beat(self, node_id: str) -> float | None: ...

    async def last_beats(self, node_ids: Sequence[str]) -> list[float | None]:
        """``last_beat`` of each of ``node_ids``, in order, in one call (one round trip)."""

    async def move_stale(self, src: str, dst: str | None, cutoff: float, limit: int) -> list[str]:
        """Atomically move members of stage ``src`` last seen at or before ``cutoff``
        to stage ``dst`` (or drop them when ``dst`` is None); return their ids."""

    async def stage_members(self, stage: str, limit: int) -> list[str]:
        """Up to ``limit`` members of ``stage``, oldest first (read only)."""

    async def drop(self, stage: str, node_ids: Sequence[str]) -> None:
        """Remove ``node_ids`` from ``stage`` (absent ones are ignored)."""

    async def watch_if_absent(self, node_ids: Sequence[str], stage: str, at: float) -> list[str]:
        """Atomically add each of ``node_ids`` that is in no liveness stage to ``stage`` as if
        last seen at ``at``; return the ids added. Their last-beat hash is not touched."""

    async def forget_node(self, node_id: str) -> None: ...

    async def hit(self, bucket: str, limit: int, window_s: int, now: float) -> RateDecision:
        """Count one event in a fixed window; refuse past ``limit``."""

    async def aclose(self) -> None: ...


# KEYS: the nonce, the marker (``NONCES_SINCE_KEY``), then the quotas' counters; ARGV: the
# nonce's TTL, the signature's created, then each counter's TTL and limit. Answers {outcome, 1
# if this call set the marker (else 0), the marker's time}: the outcome is -1 for a spent nonce,
# -2 for a signature created before the marker's time (nothing counted, the nonce not spent),
# else the position (from 1) among the counters of the first past its limit (those after it not
# counted), or 0: within them all, and the nonce is spent. A missing marker means the store lost
# every nonce spent before now (or never held one): it is set to now by Redis's clock, in whole
# seconds (a script runs alone, so of several processes that find it missing, one sets it; TIME
# before a write is allowed as scripts replicate their effects, the only way since Redis 7 and
# the default since 5). ``created`` is compared with it as it is, with no allowance for the
# signer's clock: one would let the requests signed just before the loss be replayed.
_ADMIT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {-1, 0, ''}
end
local since = redis.call('GET', KEYS[2])
local marked = 0
if not since then
  since = redis.call('TIME')[1]
  redis.call('SET', KEYS[2], since)
  marked = 1
end
if tonumber(ARGV[2]) < tonumber(since) then
  return {-2, marked, since}
end
for i = 3, #KEYS do
  local n = redis.call('INCR', KEYS[i])
  if n == 1 then
    redis.call('EXPIRE', KEYS[i], ARGV[2 * i - 3])
  end
  if n > tonumber(ARGV[2 * i - 2]) then
    return {i - 2, marked, since}
  end
end
redis.call('SET', KEYS[1], '1', 'EX', ARGV[1])
return {0, marked, since}
"""

# KEYS: the nonce, then the counters to take one back from (those expired meanwhile are left
# alone); ARGV: 1 to forget the nonce.
_UNADMIT = """
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('DECR', KEYS[i])
  end
end
if ARGV[1] == '1' then
  redis.call('DEL', KEYS[1])
end
return 0
"""

_MOVE_STALE = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
for i = 1, #ids, 2 do
  redis.call('ZREM', KEYS[1], ids[i])
  if KEYS[2] ~= nil and KEYS[2] ~= '' then
    redis.call('ZADD', KEYS[2], ids[i+1], ids[i])
  end
  table.insert(out, ids[i])
end
return out
"""

# KEYS: the stages; ARGV: the score, the index in KEYS of the stage to add to, then the ids.
_WATCH_IF_ABSENT = """
local out = {}
local dst = KEYS[tonumber(ARGV[2])]
for i = 3, #ARGV do
  local seen = false
  for k = 1, #KEYS do
    if redis.call('ZSCORE', KEYS[k], ARGV[i]) then
      seen = true
      break
    end
  end
  if not seen then
    redis.call('ZADD', dst, ARGV[1], ARGV[i])
    table.insert(out, ARGV[i])
  end
end
return out
"""


class RedisHotStore:
    shared_across_processes = True

    def __init__(self, client: aioredis.Redis, prefix: str = "orch:") -> None:
        self._r = client
        self._p = prefix
        self._move = client.register_script(_MOVE_STALE)
        self._watch = client.register_script(_WATCH_IF_ABSENT)
        self._admit = client.register_script(_ADMIT)
        self._unadmit = client.register_script(_UNADMIT)

    @classmethod
    def from_url(
        cls, url: str, prefix: str = "orch:", *, max_connections: int = 200, pool_timeout_s: float = 5.0
    ) -> RedisHotStore:
        # A blocking pool: with every connection busy a request waits for one (up to
        # pool_timeout_s) instead of failing at once, as redis-py's default pool does past its
        # limit (a burst of concurrent requests was a 500).
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=pool_timeout_s,
            decode_responses=True,
            socket_timeout=5,
            socket_connect_timeout=5,
            health_check_interval=30,
        )
        return cls(aioredis.Redis.from_pool(pool), prefix)  # the client owns (and closes) the pool

    def _k(self, *parts: str) -> str:
        return self._p + ":".join(parts)

    async def ping(self) -> bool:
        # A write, not PING: a Redis out of memory (noeviction) or a read-only replica (a primary
        # a failover demoted) answers PING while it refuses every nonce and beat; taken as up,
        # it let the serving marks go on, and the sweeper marked the fleet dead meanwhile.
        return bool(await self._r.set(self._k("alive"), "1", ex=60))

    async def time(self) -> tuple[int, int]:
        """Redis's clock: seconds and microseconds since the epoch (``TIME``)."""
        seconds, micros = await self._r.time()
        return int(seconds), int(micros)

    async def memory_policy(self) -> str | None:
        """Redis's ``maxmemory-policy``: by ``CONFIG GET``, or where ``CONFIG`` is disabled or
        renamed (as managed Redis services do) from ``INFO memory``; None if neither answers."""
        with contextlib.suppress(aioredis.ResponseError):
            policy = (await self._r.config_get("maxmemory-policy")).get("maxmemory-policy")
            if policy:
                return str(policy)
        with contextlib.suppress(aioredis.ResponseError):
            policy = (await self._r.info("memory")).get("maxmemory_policy")
            if policy:
                return str(policy)
        return None

    async def admit(
        self, keyid: str, nonce: str, ttl_s: int, quotas: Sequence[Quota], now: float, created: int
    ) -> Admitted | None:
        counted = _counted(quotas)
        keys = [
            self._k("nonce", keyid, nonce),
            self._k(NONCES_SINCE_KEY),
            *(self._counter(q, now) for q in counted),
        ]
        args: list[int] = [ttl_s, created]
        for quota in counted:
            args += [quota.window_s + 1, quota.limit]
        outcome, marked, since = await self._admit(keys=keys, args=args)
        refused = int(outcome)
        if int(marked):
            _memory_lost(int(since))
        if refused == -1:
            return None
        if refused == -2:
            return Admitted(None, forgotten_before=int(since))
        if refused == 0:
            return ADMITTED
        quota = counted[refused - 1]
        return Admitted(quota, _window_left(quota.window_s, now))

    async def unadmit(
        self, keyid: str, nonce: str, quotas: Sequence[Quota], now: float, *, spent: bool
    ) -> None:
        keys = [self._k("nonce", keyid, nonce), *(self._counter(q, now) for q in _counted(quotas))]
        await self._unadmit(keys=keys, args=[0 if spent else 1])

    def _counter(self, quota: Quota, now: float) -> str:
        return self._k("rl", quota.bucket, str(int(now // quota.window_s)))  # as ``hit`` counts

    async def record_beat(self, node_id: str, at: float, metrics: Mapping[str, str], ttl_s: int) -> None:
        hb = self._k("hb", node_id)
        mapping: dict[Any, Any] = {**metrics, "at": repr(at)}  # the beat's time is never a metric's
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.zadd(self._k("live", HEALTHY), {node_id: at})
            pipe.zrem(self._k("live", UNHEALTHY), node_id)
            pipe.zrem(self._k("live", DYING), node_id)
            pipe.hset(hb, mapping=mapping)
            pipe.expire(hb, ttl_s)
            await pipe.execute()

    async def last_beat(self, node_id: str) -> float | None:
        value = await self._r.hget(self._k("hb", node_id), "at")
        return float(value) if value is not None else None

    async def last_beats(self, node_ids: Sequence[str]) -> list[float | None]:
        if not node_ids:
            return []
        async with self._r.pipeline(transaction=False) as pipe:  # one round trip, no MULTI
            for node_id in node_ids:
                pipe.hget(self._k("hb", node_id), "at")
            values = await pipe.execute()
        return [float(v) if v is not None else None for v in values]

    async def move_stale(self, src: str, dst: str | None, cutoff: float, limit: int) -> list[str]:
        keys = [self._k("live", src), self._k("live", dst) if dst else ""]
        result = await self._move(keys=keys, args=[repr(cutoff), limit])
        return [str(x) for x in result]

    async def stage_members(self, stage: str, limit: int) -> list[str]:
        return [str(x) for x in await self._r.zrange(self._k("live", stage), 0, limit - 1)]

    async def drop(self, stage: str, node_ids: Sequence[str]) -> None:
        if node_ids:
            await self._r.zrem(self._k("live", stage), *node_ids)

    async def watch_if_absent(self, node_ids: Sequence[str], stage: str, at: float) -> list[str]:
        if not node_ids:
            return []
        keys = [self._k("live", s) for s in STAGES]
        result = await self._watch(keys=keys, args=[repr(at), STAGES.index(stage) + 1, *node_ids])
        return [str(x) for x in result]

    async def forget_node(self, node_id: str) -> None:
        async with self._r.pipeline(transaction=True) as pipe:
            for stage in STAGES:
                pipe.zrem(self._k("live", stage), node_id)
            pipe.delete(self._k("hb", node_id))
            await pipe.execute()

    async def hit(self, bucket: str, limit: int, window_s: int, now: float) -> RateDecision:
        window = int(now // window_s)
        key = self._k("rl", bucket, str(window))
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.incr(key)
            pipe.expire(key, window_s + 1)
            count, _ = await pipe.execute()
        return _decision(int(count), limit, window_s, now)

    async def aclose(self) -> None:
        await self._r.aclose()


ADMITTED = Admitted(refused_by=None)


def _memory_lost(since: int) -> None:
    """Report that this call found the Redis without its marker and set it (once a loss, of
    all the processes: the script that sets it runs alone)."""
    metrics.HOT_STORE_MEMORY_LOST.inc()
    log.warning(
        "hot_store_memory_lost",
        nonces_remembered_since=since,
        detail=(
            "Redis held no nonces-since marker: it is new, or it lost its keys (FLUSHDB, a restart "
            "without persistence, eviction). Signed requests created before this time are refused "
            "as possible replays (401 nonce_replayed) until they leave the signature window"
        ),
    )


async def check_memory_policy(store: HotStore, timeout_s: float = 5) -> str | None:
    """At startup: log one ``hot_store_evicts`` warning when the Redis hot store may evict keys
    (a ``maxmemory-policy`` other than ``noeviction``), or one
    ``hot_store_memory_policy_unknown`` when its policy cannot be read; the policy, if read.
    Nothing for the in-process store, which evicts nothing (it refuses when full)."""
    if not isinstance(store, RedisHotStore):
        return None
    try:
        policy = await asyncio.wait_for(store.memory_policy(), timeout_s)
    except Exception as exc:  # unreachable at startup: the requests will say so (503)
        policy, why = None, f"{type(exc).__name__}: {exc}"
    else:
        why = "neither CONFIG GET maxmemory-policy nor INFO memory answered it"
    if policy is None:
        log.warning(
            "hot_store_memory_policy_unknown",
            reason=why,
            detail=(
                "could not read the Redis hot store's maxmemory-policy; it must be noeviction "
                "(README, Redis): check it by hand"
            ),
        )
    elif policy != "noeviction":
        log.warning(
            "hot_store_evicts",
            maxmemory_policy=policy,
            detail=(
                f"the Redis hot store's maxmemory-policy is {policy}, not noeviction: when Redis "
                "fills it evicts spent nonces, so a captured signed request can be replayed "
                "within its signature window, unseen (volatile-* policies never evict the "
                "nonces-since marker that would detect the loss), and rate-limit counters, "
                "which lets more through. Set maxmemory-policy noeviction"
            ),
        )
    return policy


async def check_hot_store_clock(
    store: HotStore, now: Callable[[], float], timeout_s: float = 5
) -> float | None:
    """At startup: this process's clock (``now``) less the Redis hot store's, in seconds (read in
    the middle of the round trip), with one ``hot_store_clock_skew`` warning when they differ by
    more than ``CLOCK_SKEW_WARN_S`` beyond what the round trip leaves uncertain. The nonce-loss
    marker is dated by Redis's clock (``NONCES_SINCE_KEY``) and this process checks signatures'
    ``created`` by its own. None for the in-process store (one clock), or if Redis does not
    answer (the requests will say so)."""
    if not isinstance(store, RedisHotStore):
        return None
    try:
        before = now()
        seconds, micros = await asyncio.wait_for(store.time(), timeout_s)
        after = now()
    except Exception:
        return None
    offset = (before + after) / 2 - (seconds + micros / 1e6)
    if abs(offset) - (after - before) / 2 > CLOCK_SKEW_WARN_S:
        log.warning(
            "hot_store_clock_skew",
            offset_s=round(offset, 3),
            detail=(
                "this process's clock differs from the Redis hot store's: after Redis loses its "
                "keys, signatures are refused by Redis's clock (nonces_remembered_since) and "
                "checked by this process's; the hosts' clocks must agree (NTP)"
            ),
        )
    return offset


def _counted(quotas: Sequence[Quota]) -> list[Quota]:
    """The quotas that count (a limit of 0 counts nothing and allows all)."""
    return [quota for quota in quotas if quota.limit > 0]


def _window_left(window_s: int, now: float) -> int:
    """Seconds until the fixed window of ``window_s`` that ``now`` is in ends, at least 1."""
    return max(1, math.ceil((int(now // window_s) + 1) * window_s - now))


def _decision(count: int, limit: int, window_s: int, now: float) -> RateDecision:
    return RateDecision(
        allowed=count <= limit, remaining=max(0, limit - count), retry_after_s=_window_left(window_s, now)
    )


class _Stage:
    """A sorted set with O(log n) updates and pops of the oldest members (a lazy heap)."""

    def __init__(self) -> None:
        self.scores: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []

    def add(self, member: str, score: float) -> None:
        self.scores[member] = score
        heapq.heappush(self._heap, (score, member))
        if len(self._heap) > 4 * len(self.scores) + 64:
            self._heap = [(s, m) for m, s in self.scores.items()]
            heapq.heapify(self._heap)

    def remove(self, member: str) -> None:
        self.scores.pop(member, None)

    def pop_until(self, cutoff: float, limit: int) -> list[tuple[float, str]]:
        out: list[tuple[float, str]] = []
        while self._heap and len(out) < limit and self._heap[0][0] <= cutoff:
            score, member = heapq.heappop(self._heap)
            if self.scores.get(member) == score:  # skip entries superseded by a later beat
                del self.scores[member]
                out.append((score, member))
        return out


class HotStoreFull(ServiceUnavailable):
    code = "hot_store_full"

    def __init__(self, what: str, limit: int, retry_after: float) -> None:
        super().__init__(
            f"the in-process hot store already holds {limit} live {what}, its limit; retry when the "
            "oldest have expired (a deployment with this much traffic needs ORCH_REDIS__URL)",
            headers={"Retry-After": str(max(1, math.ceil(retry_after)))},
        )


V = TypeVar("V")


class _ExpiringMap(Generic[V]):
    """Values that expire, with a min-heap of (expiry, key) kept in step with the dict: each
    write first drops what has expired, oldest first, so dropping an entry costs O(log n) once,
    paid by the write that added it. At most ``max_keys`` live entries: adding one more raises
    ``HotStoreFull`` rather than evicting a live entry (an evicted nonce could be replayed)."""

    def __init__(self, what: str, max_keys: int) -> None:
        self.what = what
        self.max_keys = max_keys
        self._values: dict[str, tuple[V, float]] = {}
        self._expiries: list[tuple[float, str]] = []

    def live(self, key: str, now: float) -> tuple[V, float] | None:
        """The value and expiry of ``key``, after dropping every entry expired by ``now``."""
        self._drop_expired(now)
        return self._values.get(key)

    def full(self, now: float) -> bool:
        """Whether a new entry would be refused now."""
        self._drop_expired(now)
        return len(self._values) >= self.max_keys

    def _drop_expired(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            expired_at, old = heapq.heappop(self._expiries)
            entry = self._values.get(old)
            if entry is not None and entry[1] == expired_at:
                del self._values[old]

    def check_room(self, now: float, keys: Sequence[str] = ()) -> None:
        """Raise ``HotStoreFull`` unless there is room now for one new entry, or, given ``keys``,
        for those of them not live."""
        self._drop_expired(now)
        new = sum(1 for key in keys if key not in self._values) if keys else 1
        if new and len(self._values) + new > self.max_keys:
            raise HotStoreFull(self.what, self.max_keys, self._expiries[0][0] - now)

    def add(self, key: str, value: V, expires_at: float, now: float) -> None:
        """Add ``key``, which ``live`` just found absent."""
        if len(self._values) >= self.max_keys:
            raise HotStoreFull(self.what, self.max_keys, self._expiries[0][0] - now)
        self._values[key] = (value, expires_at)
        heapq.heappush(self._expiries, (expires_at, key))

    def replace(self, key: str, value: V) -> None:
        """Give the live ``key`` a new value; its expiry stays."""
        self._values[key] = (value, self._values[key][1])

    def discard(self, key: str) -> None:
        """Drop ``key`` before its expiry (its heap entry is skipped when it comes up: a key
        added again meanwhile has another expiry)."""
        self._values.pop(key, None)


class MemoryHotStore:
    """In-process hot store for the embedded default. Correct only in a single process.

    Nonces and rate-limit counters expire as in Redis; each kind holds at most ``max_keys``
    live entries, past which a new one is refused with 503 ``hot_store_full``.
    """

    shared_across_processes = False

    def __init__(
        self, *, max_keys: int = MEMORY_STORE_MAX_KEYS, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self._monotonic = monotonic
        self._nonces: _ExpiringMap[None] = _ExpiringMap("nonces", max_keys)
        self._stages: dict[str, _Stage] = {stage: _Stage() for stage in STAGES}
        self._beats: dict[str, tuple[float, dict[str, str], float]] = {}
        self._counters: _ExpiringMap[int] = _ExpiringMap("rate-limit counters", max_keys)

    async def ping(self) -> bool:
        """False while the nonces or the rate-limit counters are at their limit: every new signed
        request is refused then (``hot_store_full``), heartbeats too, so the service takes no
        beats, as when Redis refuses writes (the serving marks stop and the sweeper holds)."""
        now = self._monotonic()
        return not (self._nonces.full(now) or self._counters.full(now))

    async def admit(
        self, keyid: str, nonce: str, ttl_s: int, quotas: Sequence[Quota], now: float, created: int
    ) -> Admitted | None:
        # ``created`` plays no part: this process's nonces are also in ``spent_nonces``, which
        # a restart does not lose (``core.nonces``).
        mono = self._monotonic()
        key = f"{keyid}\x00{nonce}"
        if self._nonces.live(key, mono) is not None:
            return None
        counted = _counted(quotas)
        # A full store refuses before it counts anything: room for the nonce and for every
        # counter the request would add.
        self._nonces.check_room(mono)
        self._counters.check_room(mono, [_counter_key(q.bucket, q.window_s, now) for q in counted])
        for quota in counted:
            decision = self._count(quota.bucket, quota.limit, quota.window_s, now)
            if not decision.allowed:
                return Admitted(quota, decision.retry_after_s)
        self._nonces.add(key, None, mono + ttl_s, mono)
        return ADMITTED

    async def unadmit(
        self, keyid: str, nonce: str, quotas: Sequence[Quota], now: float, *, spent: bool
    ) -> None:
        mono = self._monotonic()
        for quota in _counted(quotas):
            counter = _counter_key(quota.bucket, quota.window_s, now)
            entry = self._counters.live(counter, mono)
            if entry is not None:
                self._counters.replace(counter, entry[0] - 1)
        if not spent:
            self._nonces.discard(f"{keyid}\x00{nonce}")

    async def record_beat(self, node_id: str, at: float, metrics: Mapping[str, str], ttl_s: int) -> None:
        self._stages[HEALTHY].add(node_id, at)
        self._stages[UNHEALTHY].remove(node_id)
        self._stages[DYING].remove(node_id)
        self._beats[node_id] = (at, dict(metrics), self._monotonic() + ttl_s)

    async def last_beat(self, node_id: str) -> float | None:
        return self._beat_at(node_id, self._monotonic())

    async def last_beats(self, node_ids: Sequence[str]) -> list[float | None]:
        now = self._monotonic()
        return [self._beat_at(node_id, now) for node_id in node_ids]

    def _beat_at(self, node_id: str, now: float) -> float | None:
        entry = self._beats.get(node_id)
        if entry is None or entry[2] <= now:
            return None
        return entry[0]

    async def move_stale(self, src: str, dst: str | None, cutoff: float, limit: int) -> list[str]:
        moved = self._stages[src].pop_until(cutoff, limit)
        if dst is not None:
            for score, node in moved:
                self._stages[dst].add(node, score)
        return [node for _, node in moved]

    async def stage_members(self, stage: str, limit: int) -> list[str]:
        scores = self._stages[stage].scores
        return heapq.nsmallest(limit, scores, key=lambda node: (scores[node], node))

    async def drop(self, stage: str, node_ids: Sequence[str]) -> None:
        for node_id in node_ids:
            self._stages[stage].remove(node_id)

    async def watch_if_absent(self, node_ids: Sequence[str], stage: str, at: float) -> list[str]:
        added = [n for n in node_ids if not any(n in s.scores for s in self._stages.values())]
        for node_id in added:
            self._stages[stage].add(node_id, at)
        return added

    async def forget_node(self, node_id: str) -> None:
        for stage in self._stages.values():
            stage.remove(node_id)
        self._beats.pop(node_id, None)

    async def hit(self, bucket: str, limit: int, window_s: int, now: float) -> RateDecision:
        return self._count(bucket, limit, window_s, now)

    def _count(self, bucket: str, limit: int, window_s: int, now: float) -> RateDecision:
        key = _counter_key(bucket, window_s, now)
        mono = self._monotonic()
        entry = self._counters.live(key, mono)
        if entry is None:
            count = 1
            self._counters.add(key, count, mono + window_s + 1, mono)
        else:
            count = entry[0] + 1
            self._counters.replace(key, count)
        return _decision(count, limit, window_s, now)

    async def aclose(self) -> None:
        return None


def _counter_key(bucket: str, window_s: int, now: float) -> str:
    """The in-process store's counter for ``bucket`` in the fixed window ``now`` is in."""
    return f"{bucket}\x00{int(now // window_s)}"


def make_hot_store(url: str | None, redis: RedisSettings) -> HotStore:
    """Redis at ``url`` (``Settings.redis_url``) with ``redis``'s prefix and pool; without a
    URL, the in-process store."""
    if url:
        return RedisHotStore.from_url(
            url, redis.prefix, max_connections=redis.max_connections, pool_timeout_s=redis.pool_timeout_s
        )
    return MemoryHotStore()
