"""GET /v1/admin/audit: the audit log, filtered by pool and actor, with cursor pagination."""

from __future__ import annotations

from fastapi import APIRouter

from api_schemas.common import PROBLEM_RESPONSES

router = APIRouter(prefix="/v1/admin", tags=["admin: audit"], responses=PROBLEM_RESPONSES)
