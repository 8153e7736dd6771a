"""Balances (provider-signed) and deposits (admin, idempotent)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request, Response

from api_schemas.common import PROBLEM_RESPONSES, KeyId
from api_schemas.ledger import Balances, DepositIn, DepositOut, TransferOut
from orchestrator.admin.tokens import AdminOnly
from orchestrator.audit.service import record
from orchestrator.core.errors import BadRequest, NotFound
from orchestrator.core.routing import GuardedRoute
from orchestrator.core.state import Session
from orchestrator.identity import repository as identity_repo
from orchestrator.identity.auth import CurrentProvider
from orchestrator.ledger import IDEMPOTENCY_KEY_PATTERN, service

router = APIRouter(prefix="/v1", tags=["ledger"], responses=PROBLEM_RESPONSES, route_class=GuardedRoute)


async def _idempotency_key(
    request: Request,
    key: Annotated[
        str,
        Header(
            alias="Idempotency-Key",
            min_length=8,
            max_length=100,
            pattern=IDEMPOTENCY_KEY_PATTERN,
            description="Unique per intended operation; a retry with the same key has no further effect",
        ),
    ],
) -> str:
    """The request's one ``Idempotency-Key``. Two were taken silently, one of them used: a
    client that sent two keys could not know which operation its retries would repeat."""
    if len(request.headers.getlist("idempotency-key")) > 1:
        raise BadRequest("send one Idempotency-Key header, not several", code="invalid_header")
    return key


IdempotencyKey = Annotated[str, Depends(_idempotency_key)]


async def _balances(session: Session, provider_id: str) -> Balances:
    return Balances(provider_id=provider_id, **await service.provider_balances(session, provider_id))


@router.get("/providers/me/balance", response_model=Balances, summary="The signing provider's balances")
async def my_balance(provider: CurrentProvider, session: Session) -> Balances:
    return await _balances(session, provider.id)


@router.get(
    "/admin/providers/{provider_id}/balance",
    response_model=Balances,
    tags=["admin"],
    summary="A provider's balances",
)
async def provider_balance(provider_id: KeyId, _: AdminOnly, session: Session) -> Balances:
    if await identity_repo.get_provider(session, provider_id) is None:
        raise NotFound("no provider with this id", code="provider_not_found")
    return await _balances(session, provider_id)


@router.post(
    "/admin/providers/{provider_id}/deposits",
    response_model=DepositOut,
    status_code=201,
    tags=["admin"],
    summary="Credit stake paid in off-chain (idempotent by Idempotency-Key)",
    responses={200: {"model": DepositOut, "description": "A retry: the original deposit, nothing moved"}},
)
async def deposit(
    provider_id: KeyId,
    body: DepositIn,
    idempotency_key: IdempotencyKey,
    principal: AdminOnly,
    session: Session,
    response: Response,
) -> DepositOut:
    if await identity_repo.get_provider(session, provider_id) is None:
        raise NotFound("no provider with this id", code="provider_not_found")
    result = await service.deposit(
        session,
        provider_id,
        body.amount,
        key=f"deposit:{provider_id}:{idempotency_key}",
        actor=principal.token_id,
        reference=body.reference,
    )
    t = result.transfer
    if result.created:
        await record(
            session,
            principal,
            "ledger.deposit",
            target_type="provider",
            target_id=provider_id,
            after={"transfer_id": t.id, "amount": t.amount, "reference": body.reference},
        )
    else:
        response.status_code = 200
    return DepositOut(
        transfer=TransferOut(id=t.id, reason=t.reason, amount=t.amount, memo=t.memo, created_at=t.created_at),
        balances=await _balances(session, provider_id),
    )
