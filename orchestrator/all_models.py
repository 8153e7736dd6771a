"""Imports every table module so ``Base.metadata`` is complete (Alembic, tests)."""

from orchestrator.admin import models as admin_models
from orchestrator.audit import models as audit_models
from orchestrator.core import nonces, ticks
from orchestrator.core.db import Base
from orchestrator.identity import models as identity_models
from orchestrator.ledger import models as ledger_models
from orchestrator.liveness import serving as liveness_serving
from orchestrator.payouts import models as payouts_models
from orchestrator.pools import models as pools_models
from orchestrator.restem import models as restem_models
from orchestrator.tasks import models as tasks_models
from orchestrator.verification import models as verification_models

__all__ = [
    "Base",
    "admin_models",
    "audit_models",
    "identity_models",
    "ledger_models",
    "liveness_serving",
    "nonces",
    "payouts_models",
    "pools_models",
    "restem_models",
    "tasks_models",
    "ticks",
    "verification_models",
]
