"""Tables for verification jobs, verdicts, node trust, reward holds and validator jobs."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    ScalarSelect,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    func,
    select,
    text,
)
from sqlalchemy.orm import Mapped, aliased, mapped_column

from orchestrator.core.db import Base, UTCDateTime, utcnow

ID = BigInteger().with_variant(Integer, "sqlite")
KEY_ID = String(43)
POOL_ID = String(40)


class VerificationJob(Base):
    """One per submission; the pipeline's durable state, so a crash loses no step.

    stages: checks (cheap checks to run) -> quorum (waiting for the task's other replicas)
    -> validator (waiting for an external validator) -> done.
    """

    __tablename__ = "verification_jobs"
    __table_args__ = (
        CheckConstraint("stage IN ('checks', 'quorum', 'validator', 'done')", name="stage_known"),
        Index(
            "ix_verification_jobs_pending",
            "id",
            postgresql_where=text("stage = 'checks'"),
            sqlite_where=text("stage = 'checks'"),
        ),
        # Unfinished jobs by stage (the /metrics gauges); jobs leave it when they are done.
        Index(
            "ix_verification_jobs_waiting",
            "stage",
            postgresql_where=text("stage <> 'done'"),
            sqlite_where=text("stage <> 'done'"),
        ),
        Index("ix_verification_jobs_task_id", "task_id"),
        # Each verifier partition's backlog in id order: a batch's pick is a range of it.
        Index(
            "ix_verification_jobs_partition_pending",
            "verifier_partition",
            "id",
            postgresql_where=text("stage = 'checks'"),
            sqlite_where=text("stage = 'checks'"),
        ),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    submission_id: Mapped[int] = mapped_column(
        ID, ForeignKey("submissions.id", ondelete="RESTRICT"), unique=True
    )
    task_id: Mapped[int] = mapped_column(ID, ForeignKey("tasks.id", ondelete="RESTRICT"))
    pool_id: Mapped[str] = mapped_column(POOL_ID)
    stage: Mapped[str] = mapped_column(String(16), default="checks")
    server_reward: Mapped[float | None] = mapped_column(Float)
    correct_samples: Mapped[int | None] = mapped_column(Integer)
    canonical: Mapped[str | None] = mapped_column(Text, doc="canonical answers, compared by quorum")
    findings: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    audited: Mapped[bool] = mapped_column(Boolean, default=False)
    verifier_partition: Mapped[int] = mapped_column(
        SmallInteger, default=0, server_default="0", doc="the submitting provider's verifier partition"
    )
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


# A rejection that still counts as a verified attempt in ReST^EM's solve rates: the server
# checked every sample and none was right. It has a hold window, as an accepted verdict has.
WRONG_ANSWER = "wrong_answer"


def has_window(outcome: str, reason: str) -> bool:
    """Whether a verdict has a hold window (``Verdict.hold_until``): the ones that count."""
    return outcome == "accepted" or reason == WRONG_ANSWER


class Verdict(Base):
    """The decision on one submission. Never edited: an appeal adds a reversal.

    An accepted verdict's ``hold_until`` ends its hold window (its reward's ``release_at``; set
    whether or not it earned a reward); so does a rejected ``wrong_answer`` one's, decided by
    the same terms (``has_window``). A fraud verdict against the same node in the same pool,
    decided after it and before that, withdraws it (``withdrawn_by``): the trainer feed, its
    export and ReST^EM datasets leave an accepted one out, as the fraud verdict forfeits its
    reward, and ReST^EM's solve rates leave out both (the cheater's right answers and its wrong
    ones alike). That is read, not written (a ``RolloutChange`` notice tells trainers of the
    accepted ones): reversing the fraud verdict on appeal brings them back."""

    __tablename__ = "verdicts"
    __table_args__ = (
        CheckConstraint("outcome IN ('accepted', 'rejected')", name="outcome_known"),
        CheckConstraint("category IN ('valid', 'invalid', 'fraud', 'inconclusive')", name="category_known"),
        Index("ix_verdicts_node_id_id", "node_id", "id"),
        Index("ix_verdicts_provider_id_id", "provider_id", "id"),
        Index("ix_verdicts_pool_id_id", "pool_id", "id"),
        Index(
            "ix_verdicts_fraud",
            "node_id",
            "id",
            postgresql_where=text("category = 'fraud'"),
            sqlite_where=text("category = 'fraud'"),
        ),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    submission_id: Mapped[int] = mapped_column(
        ID, ForeignKey("submissions.id", ondelete="RESTRICT"), unique=True
    )
    task_id: Mapped[int] = mapped_column(ID)
    pool_id: Mapped[str] = mapped_column(POOL_ID)
    node_id: Mapped[str] = mapped_column(KEY_ID)
    provider_id: Mapped[str] = mapped_column(KEY_ID)
    outcome: Mapped[str] = mapped_column(String(16))
    category: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(String(64))
    verifier: Mapped[str] = mapped_column(String(64))
    details: Mapped[dict[str, Any]] = mapped_column(JSON)
    server_reward: Mapped[float | None] = mapped_column(Float)
    paid_samples: Mapped[int] = mapped_column(Integer, default=0)
    reward_amount: Mapped[int] = mapped_column(BigInteger, default=0)
    slashed_amount: Mapped[int] = mapped_column(BigInteger, default=0)
    decided_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    reversed_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    reversal_reason: Mapped[str | None] = mapped_column(Text)
    hold_until: Mapped[dt.datetime | None] = mapped_column(
        UTCDateTime(),
        doc="accepted, or rejected as wrong_answer: the end of its hold window (NULL: any other "
        "rejection, an accepted verdict decided before 0034, a wrong_answer one decided by older code)",
    )
    reversed_after: Mapped[int | None] = mapped_column(
        ID,
        doc="reversed on appeal: the id of the node's latest verdict in the pool when the appeal "
        "reversed it, read under the locks every verdict of the node's is written under, so its "
        "reversal comes after that verdict and before every later one in the write order the "
        "node's money followed (service._replay_order). A reversal before 0045: the place its "
        "reversed_at gave it, the latest fraud or invalid verdict of the node's in the pool dated no "
        "later, or the verdict itself if later. NULL: not reversed, or reversed by the release before "
        "0045 during a rolling upgrade (placed so by time at each replay: service._place_by_time)",
    )
    reward_paid_on_appeal: Mapped[int] = mapped_column(
        BigInteger,
        default=0,
        server_default="0",
        doc="a fraud or invalid verdict reversed on appeal: the reward that paid (its RewardHold's amount)",
    )
    reward_forfeited_by: Mapped[int | None] = mapped_column(
        ID,
        doc="a verdict whose appeal paid a reward: the fraud verdict against the node, decided within "
        "the result's own hold window, that forfeited the payment at once, as it would have forfeited "
        "the reward of an acceptance (NULL: nothing forfeited it when the appeal paid it)",
    )


def withdrawn_by() -> ScalarSelect[int]:
    """The id of the first unreversed fraud verdict that withdraws the ``Verdict`` row it is
    selected with (see ``Verdict``), or NULL: a correlated subquery (``ix_verdicts_fraud``).
    "After" is by id, not ``decided_at``: a node's verdicts are written under its membership's
    lock (``service.lock_for_verdicts``), so ids are the order they were written in, the order
    in which a fraud verdict found the rewards it forfeits on hold (``service._held``), while
    ``decided_at`` is the batch's clock when it began, before it waited for that lock."""
    fraud = aliased(Verdict)
    return (
        select(func.min(fraud.id))
        .where(
            fraud.node_id == Verdict.node_id,
            fraud.pool_id == Verdict.pool_id,
            fraud.category == "fraud",
            fraud.reversed_at.is_(None),
            fraud.id > Verdict.id,
            fraud.decided_at < Verdict.hold_until,
        )
        .correlate(Verdict)
        .scalar_subquery()
    )


class RolloutChange(Base):
    """A notice that an accepted verdict's standing may have changed, for trainers that already
    took its rollout from the feed: its verdict was reversed on appeal (``reversed``), a fraud
    verdict against its node withdrew it (``withdrawn``), or that fraud verdict was reversed
    (``restored``). Written in the transaction that made the change, so every change of a
    rollout's standing has a notice committed with it; whether the rollout stands is read when
    the notices are (``feed.service.changes``), so notices written by racing transactions, or
    one too many, cannot mislead a reader. ``cause_verdict_id``: the fraud verdict of a
    withdrawal or restoration."""

    __tablename__ = "rollout_changes"
    __table_args__ = (
        CheckConstraint("change IN ('reversed', 'withdrawn', 'restored')", name="change_known"),
        Index("ix_rollout_changes_pool_id_id", "pool_id", "id"),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    pool_id: Mapped[str] = mapped_column(POOL_ID)
    verdict_id: Mapped[int] = mapped_column(ID, ForeignKey("verdicts.id", ondelete="RESTRICT"))
    change: Mapped[str] = mapped_column(String(16))
    cause_verdict_id: Mapped[int | None] = mapped_column(ID, ForeignKey("verdicts.id", ondelete="RESTRICT"))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class NodeTrust(Base):
    """A node's track record in a pool: drives audit rates, strikes and ejection."""

    __tablename__ = "node_trust"

    pool_id: Mapped[str] = mapped_column(POOL_ID, primary_key=True)
    node_id: Mapped[str] = mapped_column(KEY_ID, primary_key=True)
    provider_id: Mapped[str] = mapped_column(KEY_ID)
    consecutive_valid: Mapped[int] = mapped_column(Integer, default=0)
    valid: Mapped[int] = mapped_column(Integer, default=0)
    invalid: Mapped[int] = mapped_column(Integer, default=0)
    fraud: Mapped[int] = mapped_column(Integer, default=0)
    strikes: Mapped[int] = mapped_column(Integer, default=0)
    #: The rewards its verdicts that stand credited (their ``reward_amount``; an appeal takes
    #: its verdict's off): their sum over a pool is what its ``reward_budget`` counts, read over
    #: the pool's members rather than over all its verdicts. The server default is migration
    #: 0042's, which counted the verdicts before it.
    rewards_credited: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class RewardHold(Base):
    """A reward in ``rewards_pending`` until ``release_at``, when the release loop moves it to
    ``rewards_claimable``. Verdicts against the node may forfeit it meanwhile (``RewardForfeit``):
    a fraud verdict all of it, a soft-invalid penalty part of it. ``forfeited_amount`` is the
    part forfeited now (it is in a system ``slashed`` account); the rest, ``amount -
    forfeited_amount``, is the provider's. Statuses: ``held`` (the provider's part in pending),
    ``forfeited`` (all of it forfeited), ``released`` (the provider's part went to claimable),
    ``reversed`` (the rewarded verdict was reversed on appeal: the reward went back to the system).
    An appeal against a forfeiting verdict gives its forfeit back: a forfeited hold is ``held``
    again, and released when due. ``verdict_id`` is the accepted verdict that credited it, or a
    fraud or invalid verdict whose appeal paid it (``Verdict.reward_paid_on_appeal``; reversed
    already, it is never reversed again)."""

    __tablename__ = "reward_holds"
    __table_args__ = (
        CheckConstraint("status IN ('held', 'released', 'forfeited', 'reversed')", name="status_known"),
        Index(
            "ix_reward_holds_due",
            "release_at",
            postgresql_where=text("status = 'held'"),
            sqlite_where=text("status = 'held'"),
        ),
        Index("ix_reward_holds_node", "pool_id", "node_id", "status"),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    verdict_id: Mapped[int] = mapped_column(ID, ForeignKey("verdicts.id", ondelete="RESTRICT"), unique=True)
    pool_id: Mapped[str] = mapped_column(POOL_ID)
    node_id: Mapped[str] = mapped_column(KEY_ID)
    provider_id: Mapped[str] = mapped_column(KEY_ID)
    amount: Mapped[int] = mapped_column(BigInteger)
    forfeited_amount: Mapped[int] = mapped_column(
        BigInteger,
        default=0,
        server_default="0",
        doc="the part of amount forfeited now (sum of live forfeits)",
    )
    release_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    status: Mapped[str] = mapped_column(String(16), default="held")
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class RewardForfeit(Base):
    """What one verdict took from one reward hold: a fraud verdict forfeits the whole of each of
    the node's held rewards, a soft-invalid penalty parts of them, oldest first. The money went
    from the provider's ``rewards_pending`` to ``slashed_account_id``.

    ``forfeited`` while in force; ``restored`` when the forfeiting verdict was reversed (the
    amount went back to the provider: to pending, or to claimable if the hold was released
    meanwhile); ``returned`` when the rewarded verdict was reversed instead (the amount went
    from the slashed account back to the system account that paid the reward, and a later
    reversal of the forfeiting verdict has nothing to give back)."""

    __tablename__ = "reward_forfeits"
    __table_args__ = (
        CheckConstraint("status IN ('forfeited', 'restored', 'returned')", name="status_known"),
        CheckConstraint("amount > 0", name="amount_positive"),
        UniqueConstraint("verdict_id", "hold_id"),
        Index("ix_reward_forfeits_hold_id", "hold_id"),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    verdict_id: Mapped[int] = mapped_column(ID, ForeignKey("verdicts.id", ondelete="RESTRICT"))
    hold_id: Mapped[int] = mapped_column(ID, ForeignKey("reward_holds.id", ondelete="RESTRICT"))
    amount: Mapped[int] = mapped_column(BigInteger)
    slashed_account_id: Mapped[int] = mapped_column(ID, ForeignKey("ledger_accounts.id", ondelete="RESTRICT"))
    status: Mapped[str] = mapped_column(String(16), default="forfeited")
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ValidationJob(Base):
    """An expensive check (e.g. a TOPLOC proof) offered to trusted validators, leased like a task.

    statuses: open (waiting for a claim) -> leased (a validator holds it until
    ``lease_expires_at``; back to open when that passes) -> done (the validator's verdict,
    ``result``), or withdrawn (it waited ``verifier.validator_wait_s`` with no live lease and
    was decided on the server's checks, as a skipped audit; a verdict posted later is refused).
    """

    __tablename__ = "validation_jobs"
    __table_args__ = (
        CheckConstraint("status IN ('open', 'leased', 'done', 'withdrawn')", name="status_known"),
        Index(
            "ix_validation_jobs_open",
            "pool_id",
            "id",
            postgresql_where=text("status = 'open'"),
            sqlite_where=text("status = 'open'"),
        ),
        # The open jobs oldest first: the verifier's housekeeping withdraws those past their wait.
        Index(
            "ix_validation_jobs_open_since",
            "created_at",
            postgresql_where=text("status = 'open'"),
            sqlite_where=text("status = 'open'"),
        ),
        # The leases by deadline: the housekeeping (every second) reopens those that ran out,
        # reading only the leased jobs, not the whole history of decided ones.
        Index(
            "ix_validation_jobs_leased_expiry",
            "lease_expires_at",
            postgresql_where=text("status = 'leased'"),
            sqlite_where=text("status = 'leased'"),
        ),
    )

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    submission_id: Mapped[int] = mapped_column(
        ID, ForeignKey("submissions.id", ondelete="RESTRICT"), unique=True
    )
    pool_id: Mapped[str] = mapped_column(POOL_ID)
    status: Mapped[str] = mapped_column(String(16), default="open")
    fencing_token: Mapped[int] = mapped_column(Integer, default=0)
    validator_token_id: Mapped[str | None] = mapped_column(String(32))
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    per_sample_rewards: Mapped[list[float | None] | None] = mapped_column(
        JSON, doc="the server's reward per sample, as the checks computed it (NULL: made before 0031)"
    )
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    decided_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
