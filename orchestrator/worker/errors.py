"""Errors the worker SDK raises.

::

    WorkerError
    ├── OrchestratorAPIError        the server answered with an error (RFC 9457 problem)
    ├── ProviderKeyRequired         a provider-signed call on a client without the provider key
    ├── BackendError                a rollout backend could not produce samples
    └── WorkerEnded                 ``run_worker`` ended on its own: the pool completed, the
                                    node's membership ended, or its provider was retired

Transport failures that outlast the retries are raised as the ``httpx.TransportError``
they are (``httpx.ConnectError``, ``httpx.ReadTimeout`` ...).
"""

from __future__ import annotations

import datetime as dt
import email.utils
import random
from typing import Any

import httpx
from tenacity import RetryCallState


class WorkerError(Exception):
    """Base class of the worker SDK's own errors."""


class OrchestratorAPIError(WorkerError):
    """An error answer from the server, parsed from its ``application/problem+json`` body.

    ``code`` is the stable machine code (``lease_expired``, ``not_a_member``, ...); for an
    answer that is not a problem document (a proxy's HTML page, say) it is ``http_<status>``.
    """

    def __init__(
        self,
        status: int,
        code: str,
        detail: str,
        body: dict[str, Any] | None = None,
        *,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail
        self.body: dict[str, Any] = body or {}
        self.retry_after = retry_after

    @classmethod
    def from_response(cls, response: httpx.Response) -> OrchestratorAPIError:
        body: dict[str, Any] = {}
        try:
            parsed = response.json()
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            body = parsed
        code = body.get("code")
        detail = body.get("detail") or body.get("title")
        return cls(
            response.status_code,
            code if isinstance(code, str) and code else f"http_{response.status_code}",
            detail if isinstance(detail, str) and detail else response.reason_phrase or "error",
            body,
            retry_after=parse_retry_after(response.headers.get("retry-after")),
        )


class ProviderKeyRequired(WorkerError):
    """The call must be signed by the provider key, and this client was not given one."""


class NodeKeyRequired(WorkerError):
    """The call must be signed by the node key, and this client was made with the provider's
    key only (``WorkerClient(base_url, None, provider_key)``: balance, withdrawals, payouts)."""


class BackendError(WorkerError):
    """A backend failed to generate samples for a lease (the lease should be given back)."""


class WorkerEnded(WorkerError):
    """``run_worker`` ended on its own, for good, after settling the leases it held (as a stop
    does): waiting would bring no more work in the pool.

    ``reason`` is one of ``ENDINGS``: ``pool_completed`` (the pool's operator completed it,
    which ended every membership), ``membership_ended`` (the node left the pool, or its provider
    was blacklisted there, or an operator or the verifier ejected it, or its join was rejected)
    or ``provider_retired`` (an admin retired the provider: its nodes are revoked and its money
    went to its successor).
    ``stats`` is the run's final ``WorkerStats`` (with ``provider_retired``, ``earnings`` is
    None: the provider's earnings are its successor's now).
    """

    def __init__(self, reason: str, detail: str, stats: Any) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.stats = stats


#: The reasons a ``WorkerEnded`` gives.
ENDINGS = ("pool_completed", "membership_ended", "provider_retired")


def parse_retry_after(value: str | None, *, now: dt.datetime | None = None) -> float | None:
    """``Retry-After`` as seconds to wait: delta-seconds or an HTTP date (RFC 9110 10.2.3)."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return max(0.0, (when - (now or dt.datetime.now(dt.UTC))).total_seconds())


class Backoff:
    """The wait between retries of an SDK client (``wait=self._wait`` for tenacity), set by its
    ``backoff_base_s``, ``backoff_max_s`` and ``retry_after_cap_s``: the server's
    ``Retry-After`` when it gave one (at most ``retry_after_cap_s``), else exponential backoff
    with full jitter, a uniform draw from 0 to ``min(backoff_max_s, backoff_base_s * 2**(n - 1))``
    before retry ``n``."""

    backoff_base_s: float
    backoff_max_s: float
    retry_after_cap_s: float

    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, OrchestratorAPIError) and exc.retry_after is not None:
            return min(exc.retry_after, self.retry_after_cap_s)
        ceiling = min(self.backoff_max_s, self.backoff_base_s * 2 ** (state.attempt_number - 1))
        return random.uniform(0, ceiling)  # noqa: S311 - jitter, not a secret
