#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs the dev dependencies into .venv, checks
# lint and types, then runs the tests twice:
#   pass 1: SQLite + the in-process hot store (the embedded default);
#   pass 2: PostgreSQL + Redis (ORCH_TEST_DATABASE_URL / ORCH_TEST_REDIS_URL, defaulting to
#           the local servers on 127.0.0.1). An unreachable server fails the run.
# On a machine without PostgreSQL and Redis, `scripts/test.sh --sqlite-only` runs pass 1 only.
set -euo pipefail
cd "$(dirname "$0")/.."

sqlite_only=0
[ "${1:-}" = "--sqlite-only" ] && sqlite_only=1

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[dev]'

echo "== lint and types"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy

# One pytest process per core (pytest-xdist); ORCH_TEST_PROCESSES=0 runs every test in pytest's own.
PROCESSES=${ORCH_TEST_PROCESSES:-auto}

run_pytest() {
  local rc=0
  .venv/bin/python -m pytest -n "$PROCESSES" "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure" >&2
    exit 1
  fi
  if [ "$rc" -ne 0 ]; then
    exit "$rc"
  fi
}

echo "== pass 1: SQLite + in-process hot store"
(unset ORCH_TEST_DATABASE_URL ORCH_TEST_REDIS_URL; run_pytest)

if [ "$sqlite_only" -eq 1 ]; then
  echo "(--sqlite-only: PostgreSQL + Redis pass not run)"
  exit 0
fi

echo "== pass 2: PostgreSQL + Redis"
export ORCH_TEST_DATABASE_URL=${ORCH_TEST_DATABASE_URL:-postgresql+asyncpg://postgres@127.0.0.1:5432/test}
export ORCH_TEST_REDIS_URL=${ORCH_TEST_REDIS_URL:-redis://127.0.0.1:6379/0}
run_pytest
