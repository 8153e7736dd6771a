"""Withdrawals (provider-signed) and payouts (admin)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import StreamingResponse

from api_schemas.common import NO_NUL, PROBLEM_RESPONSES, Page
from api_schemas.ledger import Balances
from api_schemas.payouts import (
    AdminPayoutOut,
    ExportFormat,
    MarkPaidIn,
    PayoutOut,
    PayoutRunIn,
    PayoutRunOut,
    PayoutStatus,
    RejectPayoutIn,
    RunStatusCount,
    WithdrawalIn,
    WithdrawalOut,
)
from orchestrator.admin.tokens import AdminOnly, TokenStreamingResponse
from orchestrator.core.pagination import ID_MAX, CursorScope
from orchestrator.core.routing import GuardedRoute
from orchestrator.core.state import Session, State
from orchestrator.identity.auth import CurrentProvider
from orchestrator.ledger import service as ledger
from orchestrator.ledger.router import IdempotencyKey
from orchestrator.payouts import export, service
from orchestrator.payouts import repository as repo
from orchestrator.payouts.models import Payout, PayoutRun

router = APIRouter(prefix="/v1", tags=["payouts"], responses=PROBLEM_RESPONSES, route_class=GuardedRoute)
admin_router = APIRouter(
    prefix="/v1/admin", tags=["admin: payouts"], responses=PROBLEM_RESPONSES, route_class=GuardedRoute
)

PayoutId = Annotated[int, Path(ge=1, le=ID_MAX, description="Payout id")]
RunId = Annotated[int, Path(ge=1, le=ID_MAX, description="Payout run id")]
RunFilter = Annotated[int | None, Query(ge=1, le=ID_MAX, description="Only the payouts of this payout run")]
Cursor = Annotated[str | None, Query(max_length=200, description="next_cursor of the previous page")]
Limit = Annotated[int, Query(ge=1, le=500, description="Page size")]
StatusFilter = Annotated[PayoutStatus | None, Query(description="Only payouts in this status")]


def _fields(p: Payout) -> dict[str, object]:
    return {
        "id": p.id,
        "provider_id": p.provider_id,
        "amount": p.amount,
        "status": PayoutStatus(p.status),
        "transfer_id": p.transfer_id,
        "requested_at": p.requested_at,
        "paid_at": p.paid_at,
        "external_reference": p.external_reference,
        "rejected_at": p.rejected_at,
        "rejection_reason": p.rejection_reason,
    }


def _out(p: Payout) -> PayoutOut:
    return PayoutOut.model_validate(_fields(p))


def _admin_out(p: Payout) -> AdminPayoutOut:
    return AdminPayoutOut.model_validate(
        {**_fields(p), "paid_by": p.paid_by, "rejected_by": p.rejected_by, "run_id": p.run_id}
    )


async def _runs_out(session: Session, runs: list[PayoutRun]) -> list[PayoutRunOut]:
    by_run = await repo.runs_by_status(session, [run.id for run in runs]) if runs else {}
    return [_run_out(run, by_run[run.id]) for run in runs]


def _run_out(run: PayoutRun, counts: dict[str, tuple[int, int]]) -> PayoutRunOut:
    return PayoutRunOut(
        id=run.id,
        max_payouts=run.max_payouts,
        payouts=run.payouts,
        amount=run.amount,
        created_at=run.created_at,
        created_by=run.created_by,
        by_status={
            PayoutStatus(status): RunStatusCount(payouts=n, amount=total)
            for status, (n, total) in sorted(counts.items())
        },
    )


async def _page(
    session: Session,
    list_name: str,
    *,
    provider_id: str | None,
    status: PayoutStatus | None,
    cursor: str | None,
    limit: int,
    run_id: int | None = None,
) -> tuple[list[Payout], str | None]:
    status_value = status.value if status else None
    scope = CursorScope(list_name, provider_id=provider_id, status=status_value, run_id=run_id)
    rows = await repo.newest_first(
        session,
        provider_id=provider_id,
        status=status_value,
        before_id=scope.decode_int(cursor),
        limit=limit + 1,
        run_id=run_id,
    )
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, scope.encode(rows[-1].id) if more else None


# ------------------------------------------------------------------ providers


@router.post(
    "/providers/me/withdrawals",
    response_model=WithdrawalOut,
    status_code=201,
    summary="Withdraw claimable rewards into a payout (idempotent by Idempotency-Key)",
    responses={200: {"model": WithdrawalOut, "description": "A retry: the original payout, nothing moved"}},
)
async def withdraw(
    body: WithdrawalIn,
    idempotency_key: IdempotencyKey,
    provider: CurrentProvider,
    session: Session,
    state: State,
    response: Response,
) -> WithdrawalOut:
    payout, created = await service.request_withdrawal(
        session, provider.id, body.amount, idempotency_key, now=state.clock.utcnow()
    )
    if not created:
        response.status_code = 200
    balances = await ledger.provider_balances(session, provider.id)
    return WithdrawalOut(payout=_out(payout), balances=Balances(provider_id=provider.id, **balances))


@router.get(
    "/providers/me/payouts",
    response_model=Page[PayoutOut],
    summary="The signing provider's payouts, newest first",
)
async def my_payouts(
    provider: CurrentProvider,
    session: Session,
    status: StatusFilter = None,
    cursor: Cursor = None,
    limit: Limit = 100,
) -> Page[PayoutOut]:
    rows, next_cursor = await _page(
        session, "providers.me.payouts", provider_id=provider.id, status=status, cursor=cursor, limit=limit
    )
    return Page[PayoutOut](items=[_out(p) for p in rows], next_cursor=next_cursor)


# ------------------------------------------------------------------ admin


@admin_router.get("/payouts", response_model=Page[AdminPayoutOut], summary="Payouts, newest first")
async def list_payouts(
    _: AdminOnly,
    session: Session,
    status: StatusFilter = None,
    provider_id: Annotated[
        str | None, Query(max_length=43, pattern=NO_NUL, description="Only payouts to this provider")
    ] = None,
    run_id: RunFilter = None,
    cursor: Cursor = None,
    limit: Limit = 100,
) -> Page[AdminPayoutOut]:
    rows, next_cursor = await _page(
        session,
        "admin.payouts",
        provider_id=provider_id,
        status=status,
        cursor=cursor,
        limit=limit,
        run_id=run_id,
    )
    return Page[AdminPayoutOut](items=[_admin_out(p) for p in rows], next_cursor=next_cursor)


@admin_router.get(
    "/payouts/export",
    response_class=StreamingResponse,
    summary="Export payouts for settlement (CSV or JSON Lines, oldest first)",
    responses={
        200: {
            "description": "One record per payout with the columns payout_id, provider_id, amount, "
            "status, requested_at, paid_at, external_reference, rejected_at, rejection_reason, run_id "
            "(CSV: a header row, empty cells for null). Covers the payouts that existed when the "
            "export started.",
            "content": {"text/csv": {}, "application/x-ndjson": {}},
        }
    },
)
async def export_payouts(
    request: Request,
    _: AdminOnly,
    session: Session,
    state: State,
    export_format: Annotated[
        ExportFormat, Query(alias="format", description="csv (RFC 4180) or jsonl (one JSON object a line)")
    ] = ExportFormat.csv,
    status: StatusFilter = None,
    run_id: Annotated[
        int | None,
        Query(
            ge=1,
            le=ID_MAX,
            description="Only the payouts of this payout run: the file to settle them from, the same "
            "payouts however often it is downloaded",
        ),
    ] = None,
) -> StreamingResponse:
    if run_id is not None:
        await service.get_run(session, run_id)
    upto_id = await repo.last_id(session)
    chunks = export.payout_chunks(
        state.sessionmaker, status=status.value if status else None, upto_id=upto_id, run_id=run_id
    )
    stamp = state.clock.utcnow().strftime("%Y%m%dT%H%M%SZ")
    scope = f"run-{run_id}-" if run_id is not None else ""
    filename = f"payouts-{scope}{status.value if status else 'all'}-{stamp}.{export_format.value}"
    return TokenStreamingResponse(
        request,
        export.render(export_format, chunks),
        media_type=export.MEDIA_TYPES[export_format],
        headers={
            "Content-Disposition": f'attachment; filename="{filename}"',
            "Cache-Control": "no-store",
        },
    )


@admin_router.post(
    "/payouts/runs",
    response_model=PayoutRunOut,
    status_code=201,
    summary="Take the requested payouts no run holds, oldest first, to settle them together "
    "(idempotent by Idempotency-Key)",
    responses={
        200: {"model": PayoutRunOut, "description": "A retry: the run this key started, nothing taken"}
    },
)
async def start_run(
    idempotency_key: IdempotencyKey,
    principal: AdminOnly,
    session: Session,
    state: State,
    response: Response,
    body: PayoutRunIn | None = None,
) -> PayoutRunOut:
    max_payouts = (body or PayoutRunIn()).max_payouts
    run, created = await service.start_run(
        session, principal, idempotency_key, max_payouts, now=state.clock.utcnow()
    )
    if not created:
        response.status_code = 200
    return (await _runs_out(session, [run]))[0]


@admin_router.get("/payouts/runs", response_model=Page[PayoutRunOut], summary="Payout runs, newest first")
async def list_runs(
    _: AdminOnly, session: Session, cursor: Cursor = None, limit: Limit = 100
) -> Page[PayoutRunOut]:
    scope = CursorScope("admin.payouts.runs")
    rows = await repo.runs_newest_first(session, before_id=scope.decode_int(cursor), limit=limit + 1)
    more = len(rows) > limit
    rows = rows[:limit]
    return Page[PayoutRunOut](
        items=await _runs_out(session, rows),
        next_cursor=scope.encode(rows[-1].id) if more else None,
    )


@admin_router.get("/payouts/runs/{run_id}", response_model=PayoutRunOut, summary="One payout run")
async def get_run(run_id: RunId, _: AdminOnly, session: Session) -> PayoutRunOut:
    return (await _runs_out(session, [await service.get_run(session, run_id)]))[0]


@admin_router.post(
    "/payouts/{payout_id}/mark-paid",
    response_model=AdminPayoutOut,
    summary="Mark a payout paid with its external settlement reference (idempotent)",
)
async def mark_paid(
    payout_id: PayoutId, body: MarkPaidIn, principal: AdminOnly, session: Session, state: State
) -> AdminPayoutOut:
    payout, _ = await service.mark_paid(
        session, principal, payout_id, body.external_reference, now=state.clock.utcnow()
    )
    return _admin_out(payout)


@admin_router.post(
    "/payouts/{payout_id}/reject",
    response_model=AdminPayoutOut,
    summary="Reject a requested payout: its amount goes back to the provider's claimable rewards "
    "(idempotent)",
)
async def reject(
    payout_id: PayoutId, body: RejectPayoutIn, principal: AdminOnly, session: Session, state: State
) -> AdminPayoutOut:
    payout, _ = await service.reject(session, principal, payout_id, body.reason, now=state.clock.utcnow())
    return _admin_out(payout)
