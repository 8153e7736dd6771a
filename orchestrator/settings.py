"""Configuration: one ``Settings`` object, read from ``ORCH_*`` environment variables.

Nested groups use a double underscore: ``ORCH_DB__URL``, ``ORCH_REDIS__URL``,
``ORCH_HEARTBEAT__INTERVAL_S``. See the README's configuration table.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal, get_args

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

PLACEHOLDER_SECRETS = {"", "change-me", "changeme", "dev-secret", "secret", "placeholder"}
DEV_SEED_SECRET = "dev-secret"  # noqa: S105 - the dev placeholder, refused in prod
SUPPORTED_DB_DRIVERS = ("sqlite+aiosqlite", "postgresql+asyncpg")
SUPPORTED_DB_URLS = "sqlite+aiosqlite:///path or postgresql+asyncpg://user:pass@host/db"


class DatabaseSettings(BaseModel):
    url: str = Field(
        default="sqlite+aiosqlite:///./orchestrator.db",
        description="SQLAlchemy async URL: sqlite+aiosqlite:///path or postgresql+asyncpg://user@host/db",
    )
    pool_size: int = Field(
        default=20, ge=1, le=200, description="Connections kept open per process (PostgreSQL)."
    )
    max_overflow: int = Field(
        default=5,
        ge=0,
        le=500,
        description="Extra connections opened past pool_size under bursts, closed again when returned.",
    )
    pool_recycle_s: int = Field(
        default=1800, ge=0, description="Replace a pooled connection older than this (0: never)."
    )
    pool_pre_ping: bool = Field(
        default=False,
        description=(
            "Test each connection on checkout (three extra round trips per request). Only worth it "
            "behind a proxy that silently drops idle connections."
        ),
    )
    echo: bool = False

    @field_validator("url")
    @classmethod
    def _supported_url(cls, url: str) -> str:
        # A URL SQLAlchemy cannot parse, or one for another driver (a plain postgresql:// picks
        # psycopg, which is not installed), ended every command in a traceback. The message
        # never holds the URL: it may carry a password.
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            driver = make_url(url).drivername
        except (ArgumentError, ValueError):
            raise ValueError(f"not a database URL; use {SUPPORTED_DB_URLS}") from None
        if driver not in SUPPORTED_DB_DRIVERS:
            raise ValueError(f"the driver {driver!r} is not supported; use {SUPPORTED_DB_URLS}")
        return url

    @property
    def is_sqlite(self) -> bool:
        return self.url.startswith("sqlite")


class RedisSettings(BaseModel):
    url: SecretStr | None = Field(
        default=None,
        description="redis://host:port/db. Unset: the in-process hot store (single process only).",
    )
    prefix: str = Field(
        default="orch:", description="Key prefix, so several deployments can share one Redis."
    )
    max_connections: int = Field(
        default=200,
        ge=1,
        le=10_000,
        description=(
            "Redis connections per process. A request that finds them all busy waits for one, up "
            "to pool_timeout_s, then gets 503 hot_store_unavailable (with Retry-After)."
        ),
    )
    pool_timeout_s: float = Field(default=5.0, gt=0, le=60, description="Wait for a free Redis connection.")


class SignatureSettings(BaseModel):
    window_s: int = Field(default=300, ge=5, le=3600, description="Accepted |server time - created|.")
    nonce_ttl_s: int = Field(
        default=0,
        ge=0,
        description=(
            "How long a nonce is remembered; 0 means 2 * window_s + 1 (covers past and future skew), "
            "the least accepted."
        ),
    )

    @model_validator(mode="after")
    def _nonce_outlives_the_window(self) -> SignatureSettings:
        least = 2 * self.window_s + 1
        if self.nonce_ttl_s and self.nonce_ttl_s < least:
            raise ValueError(
                f"nonce_ttl_s ({self.nonce_ttl_s}) must be 0 or at least 2 * window_s + 1 = {least}: a "
                f"signature stays acceptable for up to 2 * window_s seconds (created from {self.window_s} s "
                "in the future to as far in the past), and a nonce forgotten sooner could be replayed"
            )
        return self

    @property
    def effective_nonce_ttl_s(self) -> int:
        return self.nonce_ttl_s or 2 * self.window_s + 1


class LimitSettings(BaseModel):
    max_body_bytes: int = Field(default=1_048_576, ge=1024, description="Largest request body in general.")
    max_result_body_bytes: int = Field(
        default=10_485_760, ge=1024, description="Largest result submission body (proofs included)."
    )
    registration_per_ip: int = Field(default=60, ge=1, description="Registrations per IP per window.")
    registration_per_key: int = Field(default=20, ge=1, description="Registrations per key per window.")
    registration_window_s: int = Field(default=60, ge=1)
    unseen_keys_per_ip: int = Field(
        default=600,
        ge=0,
        description=(
            "Signed requests per IP (an IPv6 /64) per unseen_keys_window_s whose key the API "
            "process has not read as registered yet (a key's first request to each process, and "
            "every request of a key that is not registered): each costs a database read, so past "
            "it they are refused with 429 rate_limited before that read. 0 turns the limit off."
        ),
    )
    unseen_keys_window_s: int = Field(default=60, ge=1)
    signed_per_key: int = Field(
        default=300,
        ge=0,
        description=(
            "Requests signed by a node key (one per machine: claims, heartbeats, results ...) per "
            "key per window; past it 429 rate_limited with Retry-After. 0 turns the limit off."
        ),
    )
    signed_per_provider_key: int = Field(
        default=3000,
        ge=0,
        description=(
            "Requests signed by a provider key (its registration, balance, verdicts, withdrawals) "
            "per key per window. Every machine of a provider signs these with the same key: a "
            "worker run with the provider key reads the balance every 30 s (its verdicts it reads "
            "with its node key). 0: no limit."
        ),
    )
    signed_window_s: int = Field(
        default=10, ge=1, description="The window of signed_per_key and signed_per_provider_key, in seconds."
    )


class HeartbeatSettings(BaseModel):
    interval_s: float = Field(default=10.0, gt=0, le=3600, description="Interval told to workers.")
    unhealthy_after_missed: int = Field(default=3, ge=1, description="Missed intervals before unhealthy.")
    dead_after_missed: int = Field(default=9, ge=2, description="Missed intervals before dead.")
    sweep_interval_s: float = Field(default=5.0, gt=0, description="How often the liveness sweeper ticks.")

    @model_validator(mode="after")
    def _dead_after_unhealthy(self) -> HeartbeatSettings:
        if self.dead_after_missed <= self.unhealthy_after_missed:
            raise ValueError("dead_after_missed must be greater than unhealthy_after_missed")
        return self

    @property
    def unhealthy_after_s(self) -> float:
        return self.interval_s * self.unhealthy_after_missed

    @property
    def dead_after_s(self) -> float:
        return self.interval_s * self.dead_after_missed


class VerifierSettings(BaseModel):
    batch_size: int = Field(
        default=20,
        ge=1,
        le=1000,
        description="Results verified per transaction; each batch's verdicts are visible when it commits.",
    )
    tick_budget_s: float = Field(
        default=0.8,
        gt=0,
        le=3600,
        description="How long one verifier tick (every second) keeps taking batches while results wait; "
        "a tick that runs out of it still deciding results is followed by the next at once "
        "(SQLite: after 0.4 s, for the requests waiting for the write lock).",
    )
    quorum_wait_s: float = Field(
        default=3600,
        ge=1,
        le=30 * 86_400,
        description=(
            "How long results wait for a node to take the replicas they are compared with (an "
            "audit, a tie-break, or the rest of an operator's replicas once two results are in). "
            "The wait runs only while the pool is active (a resume starts it afresh). "
            "Past that a replica no node holds is withdrawn: an audited result still alone is "
            "decided on its own checks (verdict details: audit_skipped); two or more results go to "
            "the quorum rule without it, and an undecided vote is inconclusive (quorum_timeout)."
        ),
    )
    validator_wait_s: float = Field(
        default=4 * 3600,
        ge=60,
        le=30 * 86_400,
        description=(
            "How long a result sent to validators (a pool whose audit_method is validator) waits "
            "for a validator's verdict, counted from when its checks sent it. Past that a job no "
            "validator holds a live lease on is withdrawn from the validators and the result "
            "decided on the server's own checks, as a skipped audit (verdict details: "
            "audit_skipped); a claim no longer offers it, and a lease taken within the wait may be "
            "extended up to 3600 s (the longest lease) past it, no further."
        ),
    )
    reward_timeout_s: float = Field(
        default=10,
        gt=0,
        le=600,
        description=(
            "Longest the pool's reward function may take over one result (all its samples); past "
            "it the scoring process is killed and the result is inconclusive (reward_unscorable)."
        ),
    )
    vote_compare_s: float = Field(
        default=2,
        gt=0,
        le=600,
        description=(
            "Longest a math quorum's comparisons of answers may take while its transaction holds "
            "the task's locks (SQLite: the one write lock), capped by reward_timeout_s; a "
            "comparison cut short counts the two answers as different (equivalence_unchecked). "
            "The comparisons are made before the transaction, under reward_timeout_s, whenever "
            "the votes are known then; only a quorum whose votes changed meanwhile, or one "
            "decided when its missing replicas are withdrawn, compares them under the locks."
        ),
    )
    reward_retry_s: float = Field(
        default=3600,
        ge=0,
        le=7 * 86_400,
        description=(
            "How long after a result arrived the verifier keeps trying it again while its reward "
            "function raises RewardUnavailable (a service it needs is down), 1 s after the first "
            "try, then twice as long each time, at most a minute apart; past it the result is "
            "inconclusive (reward_unavailable). 0: inconclusive at once."
        ),
    )
    reward_memory_mb: int = Field(
        default=1024,
        ge=256,
        le=1_048_576,
        description="Address-space cap of each scoring process; a result needing more is inconclusive.",
    )
    reward_processes: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Scoring processes per server or background process; a batch is scored across them.",
    )


class ServerSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    workers: int = Field(default=1, ge=1, le=64)
    migrate_on_start: bool = True
    background_loops: bool = Field(
        default=True, description="Run the sweeper and other loops in this process."
    )
    trust_proxy_headers: bool = False
    forwarded_allow_ips: str = Field(
        default="*",
        min_length=1,
        description=(
            "With trust_proxy_headers: the proxies (comma-separated addresses or CIDRs) whose "
            "X-Forwarded-For and X-Forwarded-Proto are honoured. The client is then the rightmost "
            "X-Forwarded-For address that is not one of them, so a proxy that appends to a "
            "client-sent header is safe. '*' honours any sender and takes the leftmost address: "
            "only for a proxy that overwrites the header and is the only way to the server."
        ),
    )
    public_scheme: Literal["http", "https"] | None = Field(
        default=None,
        description=(
            "The scheme clients use to reach the service, used to rebuild the URL that request "
            "signatures cover (@target-uri). Set https when TLS ends at a proxy or ingress in front "
            "of a plain-http server. Unset: the scheme the server received (with "
            "trust_proxy_headers, the proxy's X-Forwarded-Proto)."
        ),
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description=(
            "The host names (without port) that signed requests may address, as a JSON list, e.g. "
            '["api.example.org"]. A signed request whose Host names another is refused (400 '
            "host_not_allowed) before its signature is checked, so a request signed for another "
            "deployment that knows the same keys, over @authority or @target-uri, cannot be "
            "replayed here (a signature over @path and @query alone does not sign the host). "
            "Empty: any host. Unsigned routes (probes, public reads) are not affected."
        ),
    )

    @field_validator("allowed_hosts")
    @classmethod
    def _lowercase_hosts(cls, hosts: list[str]) -> list[str]:
        return [host.strip().lower() for host in hosts if host.strip()]


# The level names that both uvicorn and structlog know (ORCH_LOG_LEVEL, `worker run --log-level`).
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="ORCH_", env_nested_delimiter="__", env_file=None, extra="ignore"
    )

    env: Literal["dev", "test", "prod"] = "dev"
    log_level: LogLevel = "INFO"
    log_json: bool = True
    seed_secret: SecretStr = Field(
        default=SecretStr(DEV_SEED_SECRET),
        description="Server secret for task seeds and the task references nodes see; must be set to a real "
        "value outside dev.",
    )
    db: DatabaseSettings = DatabaseSettings()
    redis: RedisSettings = RedisSettings()
    signature: SignatureSettings = SignatureSettings()
    limits: LimitSettings = LimitSettings()
    heartbeat: HeartbeatSettings = HeartbeatSettings()
    verifier: VerifierSettings = VerifierSettings()
    server: ServerSettings = ServerSettings()

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_case_level(cls, level: object) -> object:
        return level.strip().upper() if isinstance(level, str) else level

    @model_validator(mode="after")
    def _no_placeholder_secrets_in_prod(self) -> Settings:
        if self.env == "prod" and self.seed_secret.get_secret_value().lower() in PLACEHOLDER_SECRETS:
            raise ValueError("ORCH_SEED_SECRET must be set to a real secret when ORCH_ENV=prod")
        return self

    @property
    def seed_key(self) -> bytes:
        """``seed_secret`` as the key that task seeds are derived with."""
        return self.seed_secret.get_secret_value().encode()

    @property
    def redis_url(self) -> str | None:
        url = self.redis.url.get_secret_value().strip() if self.redis.url is not None else ""
        return url or None


@lru_cache
def get_settings() -> Settings:
    return Settings()
