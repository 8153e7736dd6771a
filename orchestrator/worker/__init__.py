"""The contributor side: a signing SDK, the worker loop and its rollout backends.

* ``WorkerClient`` (``client.py``): signed, retrying calls of the worker wire protocol.
* ``run_worker`` / ``WorkerConfig`` / ``WorkerStats`` (``runner.py``): the worker loop.
* ``backends/``: the ``Backend`` protocol, ``arithmetic``, ``openai`` and plugins.
* ``problems.py``: generated arithmetic problems for the toy workload.
"""

from orchestrator.worker.client import WorkerClient
from orchestrator.worker.errors import (
    BackendError,
    NodeKeyRequired,
    OrchestratorAPIError,
    ProviderKeyRequired,
    WorkerEnded,
    WorkerError,
)
from orchestrator.worker.runner import WorkerConfig, WorkerStats, run_worker

__all__ = [
    "BackendError",
    "NodeKeyRequired",
    "OrchestratorAPIError",
    "ProviderKeyRequired",
    "WorkerClient",
    "WorkerConfig",
    "WorkerEnded",
    "WorkerError",
    "WorkerStats",
    "run_worker",
]
