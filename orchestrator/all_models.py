"""Imports every table module so ``Base.metadata`` is complete (Alembic, tests)."""

from orchestrator.admin import models as admin_models
from orchestrator.core import ticks
from orchestrator.core.db import Base
from orchestrator.identity import models as identity_models

__all__ = ["Base", "admin_models", "identity_models", "ticks"]
