"""Rollout backends: the ``Backend`` protocol, the built-ins and the plugin registry."""

from orchestrator.worker.backends.arithmetic import ArithmeticBackend
from orchestrator.worker.backends.base import Backend, BackendError, BackendFactory, Generation
from orchestrator.worker.backends.openai_compat import OpenAIBackend
from orchestrator.worker.backends.registry import ENTRY_POINT_GROUP, available, create_backend

__all__ = [
    "ENTRY_POINT_GROUP",
    "ArithmeticBackend",
    "Backend",
    "BackendError",
    "BackendFactory",
    "Generation",
    "OpenAIBackend",
    "available",
    "create_backend",
]
