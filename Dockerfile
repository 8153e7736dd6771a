# orchestrator: production image.
#
#   docker build -t orchestrator:local .
#   docker run --rm -e ORCH_DB__URL=... orchestrator:local orchestrator migrate   # one-shot schema upgrade
#   docker run -p 8000:8000 -e ORCH_ENV=prod -e ORCH_SEED_SECRET=... -e ORCH_DB__URL=... orchestrator:local
#
# Without ORCH_DB__URL both use the embedded SQLite default, ./orchestrator.db inside the
# container (/app, gone with it): migrate would upgrade a throw-away file.
#
# Migrations are NOT run by `serve` here (ORCH_SERVER__MIGRATE_ON_START=false): with several
# replicas they run once, as a separate job (`orchestrator migrate`, see docker-compose.yml).
# For a lone container, run `orchestrator migrate` first or pass ORCH_SERVER__MIGRATE_ON_START=true.

# ---- builder: resolve and install the project (non-editable) into a venv -----------------
FROM python:3.11-slim AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN python -m venv /opt/venv
ENV PATH="/opt/venv/bin:${PATH}"

WORKDIR /src
# Everything the wheel is built from: metadata plus the three packages that
# [tool.setuptools.packages.find] includes (orchestrator, api_schemas, migrations), so the
# Alembic scripts ship inside site-packages and `orchestrator migrate` works from any cwd.
COPY pyproject.toml README.md ./
COPY orchestrator ./orchestrator
COPY api_schemas ./api_schemas
COPY migrations ./migrations
RUN pip install . \
    && orchestrator --help >/dev/null \
    && python -c "import migrations.versions, api_schemas, orchestrator.app"

# ---- runtime: the venv only, no build context, non-root ---------------------------------
FROM python:3.11-slim AS runtime

RUN groupadd --system --gid 10001 orchestrator \
    && useradd --system --uid 10001 --gid 10001 --home-dir /app --no-create-home \
        --shell /usr/sbin/nologin orchestrator \
    && mkdir -p /app \
    && chown 10001:10001 /app

COPY --from=builder /opt/venv /opt/venv

ENV PATH="/opt/venv/bin:${PATH}" \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    ORCH_SERVER__HOST=0.0.0.0 \
    ORCH_SERVER__PORT=8000 \
    ORCH_SERVER__MIGRATE_ON_START=false

WORKDIR /app
USER 10001:10001

EXPOSE 8000

# Liveness only (the process answers); slim has no curl, so use the interpreter.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]

CMD ["orchestrator", "serve", "--host", "0.0.0.0", "--port", "8000"]
