"""Pool endpoints: public listing, node membership (signed), operator administration."""

from __future__ import annotations

from fastapi import APIRouter

from api_schemas.common import PROBLEM_RESPONSES

router = APIRouter(prefix="/v1", tags=["pools"], responses=PROBLEM_RESPONSES)
admin_router = APIRouter(prefix="/v1/admin", tags=["admin: pools"], responses=PROBLEM_RESPONSES)
