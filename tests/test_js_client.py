"""PROTOCOL.md is a contract for third-party clients: a worker written in JavaScript from it
alone (``tests/js/worker.mjs``: Node's crypto and fetch, RFC 9421 built by hand, JSON numbers
read as doubles) registers, joins, claims, answers and is paid as valid, against `orchestrator
serve` over HTTP. Runs in the SQLite pass (the protocol does not depend on the database) where
Node.js is installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.process_helpers import embedded_env, serving

WORKER = Path(__file__).parent / "js" / "worker.mjs"
TASKS = 3

pytestmark = [
    pytest.mark.skipif(
        bool(os.environ.get("ORCH_TEST_DATABASE_URL")),
        reason="the protocol does not depend on the database: it runs in the SQLite pass",
    ),
    pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js (node) for the JavaScript client"),
]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """`orchestrator serve` on the embedded default, with its background loops (the verifier),
    and an admin token."""
    env = embedded_env()
    with serving(tmp_path, env) as (_, port):
        made = subprocess.run(
            [
                sys.executable,
                "-m",
                "orchestrator.cli",
                "admin",
                "create-token",
                "--role",
                "admin",
                "--name",
                "js",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        yield f"http://127.0.0.1:{port}", made.stdout.strip().splitlines()[-1]


def test_a_javascript_worker_written_from_the_protocol_is_paid_for_its_answers(
    served: tuple[str, str],
) -> None:
    base, token = served
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30) as admin:
        body = {
            "name": "js",
            "economics": {"reward_per_sample": 5, "reward_hold_s": 60},
            "policy": {"replication_factor": 1, "audit_rate_floor": 0.0, "max_leases_per_node": TASKS},
        }
        pool_id = admin.post("/v1/admin/pools", json=body).json()["id"]
        assert admin.post(f"/v1/admin/pools/{pool_id}/activate").status_code == 200
        policy = {"step": 1, "uri": "s3://ckpt/step-1", "sha256": "a" * 64, "size": 1024}
        assert admin.post(f"/v1/admin/pools/{pool_id}/policies", json=policy).status_code == 201
        tasks = [
            {
                "prompt": f"{i} + {4 - i}?",
                "sampling": {"max_tokens": 8},
                "verification": {"expected_answer": "4"},
            }
            for i in range(TASKS)
        ]
        r = admin.post(f"/v1/admin/pools/{pool_id}/tasks", json={"batch_key": "js", "tasks": tasks})
        assert r.status_code == 201, r.text

        done = subprocess.run(
            ["node", str(WORKER), base, pool_id, str(TASKS)], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout.strip().splitlines()[-1])

        # Seeds large enough to matter (a double holds every integer up to 2^53 only), echoed
        # exactly: every result valid, none judged fraud for its seed.
        assert len(out["seeds"]) == TASKS and max(out["seeds"]) > 2**32
        assert out["again"] == out["submissions"][0]  # the same body again: the first answer
        assert out["verdicts"] == [["valid", "verified"]] * TASKS
        provider = admin.get(f"/v1/admin/nodes/{out['node_id']}").json()["provider_id"]
        balance = admin.get(f"/v1/admin/providers/{provider}/balance").json()
        assert balance["rewards_pending"] == 5 * TASKS
