"""Bearer API tokens: created once, stored as SHA-256 hashes, checked by role.

Tokens are 256-bit random strings, so a fast hash is enough (no password stretching is
needed against guessing); the plaintext is shown once, at creation.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import enum
import hashlib
import hmac
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import structlog
from fastapi import Depends, Request, Security
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import bindparam, select
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncSession
from starlette.types import Send

from orchestrator.admin.models import ApiToken
from orchestrator.core.db import utcnow
from orchestrator.core.errors import Conflict, Forbidden, Unauthorized, UnprocessableEntity
from orchestrator.core.routing import before_body, guarded_answer
from orchestrator.core.state import app_state, check_in_transaction
from orchestrator.pools.models import Pool

TOKEN_PREFIX = "orch_"  # noqa: S105 - a prefix, not a secret

# The request's bearer token, as ``_principal`` found it: (its id, the SHA-256 of its secret).
_BEARER = "orchestrator.bearer"

log = structlog.get_logger(__name__)

Chunk = TypeVar("Chunk", bytes, str)


class Role(enum.StrEnum):
    admin = "admin"
    operator = "operator"
    validator = "validator"
    trainer = "trainer"


@dataclass(frozen=True)
class Principal:
    token_id: str
    name: str
    role: Role
    pool_ids: frozenset[str] = frozenset()

    def scoped_to(self, pool_id: str) -> bool:
        """For validator and trainer tokens: the pools the token was created for."""
        return pool_id in self.pool_ids

    # As the audit log names the principal (``audit.service.Actor``).
    @property
    def actor_id(self) -> str:
        return self.token_id

    @property
    def actor_role(self) -> str:
        return self.role.value


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


async def check_scope(session: AsyncSession, role: Role, pool_ids: list[str]) -> None:
    """Validator and trainer tokens act on the pools named at creation, which must exist; admin
    and operator tokens take none (an operator acts on the pools it creates)."""
    if role in (Role.validator, Role.trainer):
        if not pool_ids:
            raise UnprocessableEntity(
                f"a {role.value} token needs at least one pool", code="token_scope_invalid"
            )
        known = set((await session.execute(select(Pool.id).where(Pool.id.in_(pool_ids)))).scalars())
        if missing := sorted(set(pool_ids) - known):
            raise UnprocessableEntity(f"no pool {', '.join(missing)}", code="token_scope_invalid")
    elif pool_ids:
        raise UnprocessableEntity(
            f"only validator and trainer tokens are scoped to pools, not {role.value} tokens",
            code="token_scope_invalid",
        )


async def create_token(
    session: AsyncSession,
    *,
    role: Role,
    name: str,
    pool_ids: list[str] | None = None,
    expires_at: dt.datetime | None = None,
    now: dt.datetime | None = None,
) -> tuple[str, ApiToken]:
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = ApiToken(
        id="tok_" + secrets.token_hex(8),
        name=name,
        role=role.value,
        token_hash=hash_token(token),
        pool_ids=sorted(set(pool_ids)) if pool_ids else None,
        created_at=now or utcnow(),
        expires_at=expires_at,
    )
    session.add(row)
    await session.flush()
    return token, row


async def _locked(session: AsyncSession, token_id: str) -> ApiToken | None:
    """The token's row under its update lock, read afresh (``populate_existing``: a row read
    earlier in the session may be stale). The requests in their transactions with the token hold
    its share lock (``_TOKEN_STILL_VALID``): this waits for them."""
    return (
        await session.execute(
            select(ApiToken)
            .where(ApiToken.id == token_id)
            .with_for_update()
            .execution_options(populate_existing=True)
        )
    ).scalar_one_or_none()


def lock_own_and_target(request: Request, principal: Principal, token_id: str) -> None:
    """Before a request revokes or rotates token ``token_id``: have its transaction begin by
    locking that token's row and the requester's own (``FOR UPDATE``, in id order, one
    statement), before its own token's check (``_TOKEN_STILL_VALID``, which then waits for
    nothing). Otherwise each request holds its own token's share lock and then waits for the
    other's row: two admins revoking or rotating each other's tokens at the same moment
    deadlocked, and PostgreSQL aborted one (503 ``transient_conflict``). In id order they take
    turns: the first changes the other's token, and the second, its own token now revoked or
    rotated, is refused (401) and changes nothing, so one of the two tokens keeps working."""
    ids = sorted({principal.token_id, token_id})

    def lock(connection: Connection) -> None:
        connection.execute(
            select(ApiToken.id).where(ApiToken.id.in_(ids)).order_by(ApiToken.id).with_for_update()
        )

    check_in_transaction(request, lock, before_others=True)


#: ``rotate_token``'s ``expires_at`` when the token keeps its expiry.
KEEP_EXPIRY: Any = object()


async def rotate_token(
    session: AsyncSession, token_id: str, *, expires_at: dt.datetime | None = KEEP_EXPIRY, now: dt.datetime
) -> tuple[str, ApiToken] | None:
    """A new secret for the token, which keeps its id, role, scope, name and so whatever it owns
    (an operator's pools): the old secret is refused from now on, by requests already
    authenticated with it too (their transactions read the token's hash again). None if there is
    no such token. A revoked token stays revoked (409 ``token_revoked``); an expired one is given
    a new secret only with a new ``expires_at`` (None: no expiry), else 409 ``token_expired``."""
    row = await _locked(session, token_id)
    if row is None:
        return None
    if row.revoked_at is not None:
        raise Conflict("the token is revoked, for good: create a new one", code="token_revoked")
    expired = row.expires_at is not None and row.expires_at <= now
    if expired and expires_at is KEEP_EXPIRY:
        raise Conflict(
            "the token has expired: give it a new lifetime (expires_in_s, or null for none) to rotate it",
            code="token_expired",
        )
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row.token_hash = hash_token(token)
    if expires_at is not KEEP_EXPIRY:
        row.expires_at = expires_at
    await session.flush()
    return token, row


async def revoke_token(
    session: AsyncSession, token_id: str, *, now: dt.datetime | None = None
) -> tuple[ApiToken | None, bool]:
    """Revoke a token; returns (its row, None if there is none; whether this call revoked it).
    A revoked token stays revoked: revoking it again changes nothing. Decided under the row's
    lock, read afresh, so of two revocations at once exactly one revokes it and records its
    time."""
    row = await _locked(session, token_id)
    if row is None or row.revoked_at is not None:
        return row, False
    row.revoked_at = now or utcnow()
    await session.flush()
    return row, True


bearer_scheme = HTTPBearer(
    scheme_name="BearerToken",
    description="Operator API token (roles: admin, operator, validator, trainer). "
    "Create one with `orchestrator admin create-token --role ...`.",
    auto_error=False,
)


_TOKEN_BY_HASH = select(
    ApiToken.id,
    ApiToken.name,
    ApiToken.role,
    ApiToken.pool_ids,
    ApiToken.revoked_at,
    ApiToken.expires_at,
    ApiToken.token_hash,
).where(ApiToken.token_hash == bindparam("digest"))


# Read again first in the request's transaction, under a share lock: ``revoke_token`` and
# ``rotate_token`` take the row's update lock, so a revocation or a rotation waits for the
# requests already in their transactions and every one after it with the old secret is refused.
_TOKEN_STILL_VALID = (
    select(ApiToken.revoked_at, ApiToken.expires_at, ApiToken.token_hash)
    .where(ApiToken.id == bindparam("token_id"))
    .with_for_update(read=True)
)


# The same, outside any transaction: a streamed answer's check between its chunks.
_TOKEN_STILL_VALID_NOW = select(ApiToken.revoked_at, ApiToken.expires_at, ApiToken.token_hash).where(
    ApiToken.id == bindparam("token_id")
)


def _token_invalid() -> Unauthorized:
    return Unauthorized(
        "the bearer token is not valid", code="token_invalid", headers={"WWW-Authenticate": "Bearer"}
    )


def _refuse_unusable(row: Any, now: dt.datetime) -> None:
    """401 unless ``row`` (with ``revoked_at`` and ``expires_at``) is a live token's."""
    if row is None or row.revoked_at is not None:
        raise _token_invalid()
    if row.expires_at is not None and row.expires_at <= now:
        raise Unauthorized(
            "the bearer token has expired", code="token_expired", headers={"WWW-Authenticate": "Bearer"}
        )


async def _principal(request: Request) -> Principal:
    """The bearer token's principal, read once per request outside its transaction (an
    autocommit read, as for a signed node): ``core.routing`` runs this before the body is
    decoded, so a request without a valid token is refused before its body costs anything.
    A request that opens a transaction reads the token again first in it (``_TOKEN_STILL_VALID``):
    one revoked while the request waited is refused then, and changes nothing."""

    async def read() -> Principal:
        credentials = await bearer_scheme(request)
        if credentials is None or credentials.scheme.lower() != "bearer":
            raise Unauthorized(
                "a bearer token is required", code="token_missing", headers={"WWW-Authenticate": "Bearer"}
            )
        state = app_state(request)
        digest = hash_token(credentials.credentials)
        async with state.reader.connect() as conn:
            row = (await conn.execute(_TOKEN_BY_HASH, {"digest": digest})).first()
        if row is None or not hmac.compare_digest(row.token_hash, digest):
            raise _token_invalid()
        _refuse_unusable(row, state.clock.utcnow())
        token_id = row.id

        def still_valid(connection: Connection) -> None:
            again = connection.execute(_TOKEN_STILL_VALID, {"token_id": token_id}).first()
            if again is not None and not hmac.compare_digest(again.token_hash, digest):
                raise _token_invalid()  # rotated since: the secret this request carries is dead
            _refuse_unusable(again, state.clock.utcnow())

        check_in_transaction(request, still_valid)
        request.scope[_BEARER] = (token_id, digest)
        structlog.contextvars.bind_contextvars(token_id=row.id)
        return Principal(
            token_id=row.id, name=row.name, role=Role(row.role), pool_ids=frozenset(row.pool_ids or ())
        )

    return await guarded_answer(request, "bearer", read)


class _TokenDied(Exception):
    """Raised by ``_while_valid`` when the token is dead: the stream ends there."""


async def _while_valid(request: Request, chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    """``chunks`` for as long as the request's bearer token stays valid: it is read again (one
    primary-key read, outside any transaction) before every chunk, the first included (the
    request's own transaction has committed before the answer starts, and each chunk is read in
    a transaction of its own after it: a revocation may commit in between); a dead one raises
    ``_TokenDied`` before the next chunk is read."""
    token_id, digest = request.scope[_BEARER]
    state = app_state(request)
    try:
        while True:
            async with state.reader.connect() as conn:
                row = (await conn.execute(_TOKEN_STILL_VALID_NOW, {"token_id": token_id})).first()
            try:
                if row is not None and not hmac.compare_digest(row.token_hash, digest):
                    raise _token_invalid()
                _refuse_unusable(row, state.clock.utcnow())
            except Unauthorized as refused:
                log.warning("stream_token_refused", token_id=token_id, code=refused.code)
                raise _TokenDied(refused.code) from refused
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()


class TokenStreamingResponse(StreamingResponse):
    """A streamed answer (an export, read chunk by chunk in transactions of its own) for a bearer
    request, served only while its token stays valid. A token revoked, rotated or expired while
    the answer streams (or between the request's transaction and its first chunk) reads no more of
    it, as every later request with it is refused. Its status (and maybe first lines) is sent
    already, so no problem can be: the answer is left unfinished (the
    server closes the connection without the end of the chunked body), and the client sees a
    broken download rather than a short file it could take for the whole one."""

    def __init__(self, request: Request, content: AsyncIterator[Chunk], **kwargs: Any) -> None:
        super().__init__(_while_valid(request, content), **kwargs)

    async def stream_response(self, send: Send) -> None:
        with contextlib.suppress(_TokenDied):
            await super().stream_response(send)


@before_body(_principal)
async def authenticate(
    request: Request, _credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer_scheme)]
) -> Principal:
    return await _principal(request)


def require_roles(*roles: Role) -> object:
    allowed = frozenset(roles)

    async def dependency(principal: Annotated[Principal, Depends(authenticate)]) -> Principal:
        if principal.role not in allowed:
            raise Forbidden(
                f"role {principal.role.value!r} may not do this; needs one of "
                + ", ".join(sorted(r.value for r in allowed)),
                code="role_forbidden",
            )
        return principal

    return Depends(dependency)


AdminOnly = Annotated[Principal, require_roles(Role.admin)]
