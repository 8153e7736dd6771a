"""An admin retires a provider whose key is lost or stolen, naming a successor: the key is refused
from then on, its nodes are revoked, and its money goes to the successor, what is free at once
and the rest as it matures; none is stranded and none is paid twice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import structlog
from sqlalchemy import select, update

from orchestrator.core.clock import FakeClock
from orchestrator.core.keys import generate_key, key_id_of
from orchestrator.identity.models import Provider
from orchestrator.ledger import jobs as ledger_jobs
from orchestrator.ledger import service as ledger
from orchestrator.ledger.models import LedgerAccount
from orchestrator.ledger.service import ProviderAccount, SystemAccount, provider_account, system_account
from orchestrator.payouts.service import request_withdrawal
from orchestrator.verification.jobs import release_once
from orchestrator.verification.models import RewardHold
from tests.conftest import Contributor, new_contributor, postgres_only, problem
from tests.pools_helpers import join, leave
from tests.tasks_helpers import PoolSetup, Worker, pool_setup
from tests.test_ban_ejects import audit, statuses
from tests.test_node_revocation import ECON
from tests.test_verification import one_lease
from tests.verification_helpers import books_balance, submit, verdicts, verify_all
from tests.waits import until_waiting

pytestmark = pytest.mark.usefixtures("no_audits")

HOLD_S = ECON["reward_hold_s"]
UNBONDING_S = ECON["unbonding_period_s"]


def retire_url(provider_id: str) -> str:
    return f"/v1/admin/providers/{provider_id}/retire"


async def retire(
    s: PoolSetup, provider_id: str, successor_id: str, *, key: str = "retire-0001", reason: str = "key lost"
) -> httpx.Response:
    return await s.admin.post(
        retire_url(provider_id),
        json={"successor_id": successor_id, "reason": reason},
        headers={**s.admin_headers, "Idempotency-Key": key},
    )


@asynccontextmanager
async def retirement_held(
    app_state: Any, provider_id: str, successor_id: str, key: str
) -> AsyncIterator[None]:
    """An admin's retirement of ``provider_id`` (reason "stolen") done in a transaction that
    stays open, holding its locks, until the block ends; then committed."""
    from orchestrator.identity import retirement
    from tests.test_node_revocation import ADMIN

    session = app_state.sessionmaker()
    await session.begin()
    try:
        await retirement.retire(
            session, app_state, provider_id, successor_id, "stolen", key=key, principal=ADMIN
        )
        yield
        await session.commit()
    finally:
        await session.close()


async def blacklisted_in(app_state: Any, pool_id: str) -> list[str]:
    """The providers the pool blacklists."""
    from orchestrator.pools.models import PoolProviderBlacklist

    async with app_state.sessionmaker() as session:
        rows = await session.execute(
            select(PoolProviderBlacklist.provider_id).where(PoolProviderBlacklist.pool_id == pool_id)
        )
        return sorted(rows.scalars())


async def registered_provider(s: PoolSetup) -> Contributor:
    """A provider (with no node yet) that can be named successor."""
    c = new_contributor()
    r = await s.admin.post("/v1/providers", json={"display_name": "heir"}, auth=c.provider_auth)
    assert r.status_code == 201, r.text
    return c


async def provider_balances(s: PoolSetup, provider_id: str) -> dict[str, int]:
    r = await s.admin.get(f"/v1/admin/providers/{provider_id}/balance", headers=s.admin_headers)
    assert r.status_code == 200, r.text
    return {k: v for k, v in r.json().items() if k != "provider_id"}


async def earn(s: PoolSetup, app_state: Any, w: Worker) -> None:
    """One correct result of ``w``'s, decided: 7 more on hold for ``HOLD_S``."""
    await submit(w, await one_lease(s, w), ["4"])
    await verify_all(app_state)


async def release_now(app_state: Any, clock: FakeClock) -> int:
    """Release the rewards on hold now, at the next release tick (the clock moves 31 s only: the
    signatures of the tests' requests, made at the real time, stay within their window)."""
    async with app_state.sessionmaker() as session, session.begin():
        await session.execute(
            update(RewardHold).where(RewardHold.status == "held").values(release_at=clock.utcnow())
        )
    clock.advance(31)
    return await release_once(app_state)


async def test_retiring_moves_free_money_at_once_and_the_rest_as_it_matures(
    app: Any, app_state: Any, client: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1500) as s:
        [lost] = s.workers
        await earn(s, app_state, lost)
        assert await release_now(app_state, clock) == 1  # 7 claimable
        await earn(s, app_state, lost)  # 7 more, on hold
        heir = await registered_provider(s)
        p, h = lost.contributor.provider_id, heir.provider_id
        assert await provider_balances(s, p) == {
            "stake_free": 500,
            "stake_locked": 1000,
            "stake_unbonding": 0,
            "rewards_pending": 7,
            "rewards_claimable": 7,
            "withdrawn": 0,
        }

        r = await retire(s, p, h, reason="laptop with the provider key stolen")
        assert r.status_code == 201, r.text
        out = r.json()
        assert out["provider"]["id"] == p
        assert out["provider"]["successor_id"] == h
        assert out["provider"]["retirement_reason"] == "laptop with the provider key stolen"
        assert out["provider"]["retired_at"] is not None
        assert out["revoked_nodes"] == {lost.node_id: [s.pool_id]}
        assert out["moved"] == {"stake_free": 500, "rewards_claimable": 7}
        assert out["maturing"] == {"rewards_pending": 7, "stake_unbonding": 1000}
        assert out["payouts_requested"] == [] and out["blacklists_copied"] == []

        # Free now: moved at once. The node's stake unbonds, its reward stays on hold.
        assert await provider_balances(s, p) == {
            "stake_free": 0,
            "stake_locked": 0,
            "stake_unbonding": 1000,
            "rewards_pending": 7,
            "rewards_claimable": 0,
            "withdrawn": 0,
        }
        heirs = await provider_balances(s, h)
        assert (heirs["stake_free"], heirs["rewards_claimable"]) == (500, 7)
        await books_balance(app_state)
        # The node is revoked, as its provider's own revocation does, by the admin.
        assert await statuses(s, s.pool_id) == {lost.node_id: "ejected"}
        view = (await s.admin.get(f"/v1/admin/nodes/{lost.node_id}", headers=s.admin_headers)).json()
        assert view["status"] == "banned" and view["revoked_at"] is not None
        [revoked] = await audit(s, "node.revoke")
        assert (revoked["actor_role"], revoked["target_id"]) == ("admin", lost.node_id)
        [entry] = await audit(s, "provider.retire")
        assert (entry["target_type"], entry["target_id"], entry["actor_role"]) == ("provider", p, "admin")
        assert entry["after"]["successor_id"] == h and entry["after"]["moved"] == out["moved"]

        # The reward on hold, released later, lands on the successor.
        clock.advance(HOLD_S + 1)
        assert await release_once(app_state) == 1
        assert (await provider_balances(s, p))["rewards_pending"] == 0
        assert (await provider_balances(s, p))["rewards_claimable"] == 0
        assert (await provider_balances(s, h))["rewards_claimable"] == 14
        await books_balance(app_state)

        # The stake unbonding, completed later, lands on the successor.
        clock.advance(UNBONDING_S)
        assert (await ledger_jobs.release_once(app_state)).released == 1
        assert (await provider_balances(s, p))["stake_unbonding"] == 0
        assert (await provider_balances(s, p))["stake_free"] == 0
        assert (await provider_balances(s, h))["stake_free"] == 1500
        await books_balance(app_state)

        # The admin view of the provider shows the retirement.
        r = await s.admin.get(f"/v1/admin/providers/{p}", headers=s.admin_headers)
        assert r.status_code == 200, r.text
        assert r.json() == out["provider"]


async def test_the_retired_key_is_refused_everywhere(app: Any, app_state: Any, clock: FakeClock) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1500) as s:
        [lost] = s.workers
        heir = await registered_provider(s)
        c, http = lost.contributor, lost.client
        assert (await retire(s, c.provider_id, heir.provider_id)).status_code == 201

        auth = c.provider_auth
        problem(await http.get("/v1/providers/me/balance", auth=auth), 403, "provider_retired")
        problem(await http.get("/v1/providers/me/nodes", auth=auth), 403, "provider_retired")
        problem(await http.get("/v1/providers/me/verdicts", auth=auth), 403, "provider_retired")
        problem(await http.get("/v1/providers/me/payouts", auth=auth), 403, "provider_retired")
        r = await http.post(
            "/v1/providers/me/withdrawals",
            json={"amount": 1},
            headers={"Idempotency-Key": "thief-0001"},
            auth=auth,
        )
        problem(r, 403, "provider_retired")
        r = await http.post(f"/v1/providers/me/nodes/{c.node_id}/revoke", auth=auth)
        problem(r, 403, "provider_retired")
        # The key cannot come back: not by registering again, nor with a node naming it.
        problem(await http.post("/v1/providers", json={}, auth=auth), 403, "provider_retired")
        thief = Contributor(provider_key=c.provider_key, node_key=generate_key())
        r = await http.post("/v1/nodes", json=thief.node_body(), auth=thief.node_auth)
        problem(r, 403, "provider_retired")
        # Its node was revoked.
        problem(await lost.beat(), 403, "node_banned")
        problem(await http.post("/v1/nodes", json=c.node_body(), auth=c.node_auth), 403, "node_key_revoked")
        # The successor's key works.
        r = await http.get("/v1/providers/me/balance", auth=heir.provider_auth)
        assert r.status_code == 200, r.text
        assert r.json()["stake_free"] == 500


async def test_a_retired_providers_node_is_told_that_its_ban_is_the_retirement(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A worker run without the provider key cannot ask whether its provider was retired (only
    the provider key can, and is refused provider_retired): every refusal of its node's key says
    so, ``provider_retired: true`` in the node_banned problem, and false for a node banned for
    anything else (here an admin's ban). Before, the two problems were the same."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1500) as s:
        [lost] = s.workers
        banned = await s.add_worker(stake=1000)
        heir = await registered_provider(s)
        lease = await one_lease(s, lost)
        r = await s.admin.post(
            f"/v1/admin/nodes/{banned.node_id}/ban", json={"reason": "cheating"}, headers=s.admin_headers
        )
        assert r.status_code == 200, r.text
        assert (await retire(s, lost.contributor.provider_id, heir.provider_id)).status_code == 201

        for w, retired in ((lost, True), (banned, False)):
            auth = w.contributor.node_auth
            answers = {
                "claim": await w.claim(s.pool_id),
                "result": await w.submit(lease),
                "release": await w.release(lease),
                "heartbeat": await w.beat(),
                "me": await w.client.get("/v1/nodes/me", auth=auth),
                "leases": await w.client.get("/v1/nodes/me/leases", auth=auth),
                "verdicts": await w.client.get("/v1/nodes/me/verdicts", auth=auth),
                "policy": await w.client.get(f"/v1/pools/{s.pool_id}/policy", auth=auth),
                "join": await join(w.client, w.contributor, s.pool_id),
                "leave": await leave(w.client, w.contributor, s.pool_id),
            }
            for route, answer in answers.items():
                body = problem(answer, 403, "node_banned")
                assert body["provider_retired"] is retired, (route, body)
                assert ("retired its provider" in body["detail"]) is retired, (route, body)
        schemas = (await s.admin.get("/openapi.json")).json()["components"]["schemas"]
        assert "node_banned" in schemas["Problem"]["properties"]["provider_retired"]["description"]


async def test_the_same_call_again_is_answered_the_same_and_changes_nothing(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1500) as s:
        [lost] = s.workers
        heir, other = await registered_provider(s), await registered_provider(s)
        p = lost.contributor.provider_id
        first = await retire(s, p, heir.provider_id, key="retire-same")
        assert first.status_code == 201, first.text
        before = await provider_balances(s, heir.provider_id)
        clock.advance(5)

        again = await retire(s, p, heir.provider_id, key="retire-same")
        assert again.status_code == 200, again.text
        assert again.json() == first.json()
        assert await provider_balances(s, heir.provider_id) == before
        assert len(await audit(s, "provider.retire")) == 1

        # The same key with another body, and another key: refused, nothing changes.
        body = problem(
            await retire(s, p, other.provider_id, key="retire-same"), 409, "idempotency_key_reused"
        )
        assert body["successor_id"] == heir.provider_id
        problem(
            await retire(s, p, heir.provider_id, key="retire-same", reason="other"),
            409,
            "idempotency_key_reused",
        )
        body = problem(await retire(s, p, other.provider_id, key="retire-other"), 409, "provider_retired")
        assert body["successor_id"] == heir.provider_id
        assert await provider_balances(s, heir.provider_id) == before
        assert await provider_balances(s, other.provider_id) == dict.fromkeys(before, 0)
        await books_balance(app_state)


async def test_bad_retirements_are_refused_and_change_nothing(app: Any, app_state: Any) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1500) as s:
        [lost] = s.workers
        p = lost.contributor.provider_id
        heir, retired, next_ = [await registered_provider(s) for _ in range(3)]
        assert (
            await retire(s, retired.provider_id, next_.provider_id, key="retire-first")
        ).status_code == 201
        before = await provider_balances(s, p)

        unknown = key_id_of(generate_key())
        problem(await retire(s, unknown, heir.provider_id), 404, "provider_not_found")
        problem(await retire(s, p, p), 422, "successor_is_provider")
        problem(await retire(s, p, unknown), 422, "successor_not_found")
        body = problem(await retire(s, p, retired.provider_id), 409, "successor_retired")
        assert body["successor_id"] == next_.provider_id
        problem(
            await s.admin.post(
                retire_url(p),
                json={"successor_id": heir.provider_id, "reason": ""},
                headers={**s.admin_headers, "Idempotency-Key": "retire-0001"},
            ),
            422,
            "validation_failed",
        )
        r = await s.admin.post(
            retire_url(p), json={"successor_id": heir.provider_id, "reason": "x"}, headers=s.admin_headers
        )
        problem(r, 400, "invalid_header")  # no Idempotency-Key
        # An operator is no admin.
        r = await s.admin.post(
            retire_url(p),
            json={"successor_id": heir.provider_id, "reason": "x"},
            headers={**s.headers, "Idempotency-Key": "retire-0001"},
        )
        problem(r, 403, "role_forbidden")

        assert await provider_balances(s, p) == before
        detail = (await s.admin.get(f"/v1/admin/providers/{p}", headers=s.admin_headers)).json()
        assert (detail["retired_at"], detail["successor_id"], detail["retirement_reason"]) == (
            None,
            None,
            None,
        )
        assert (await lost.beat()).status_code == 200
        problem(
            await s.admin.get(f"/v1/admin/providers/{unknown}", headers=s.admin_headers),
            404,
            "provider_not_found",
        )


async def test_a_requested_payout_rejected_after_the_retirement_goes_to_the_successor(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        [lost] = s.workers
        await earn(s, app_state, lost)
        assert await release_now(app_state, clock) == 1
        r = await lost.client.post(
            "/v1/providers/me/withdrawals",
            json={"amount": 7},
            headers={"Idempotency-Key": "before-0001"},
            auth=lost.contributor.provider_auth,
        )
        assert r.status_code == 201, r.text
        payout_id = r.json()["payout"]["id"] if "payout" in r.json() else r.json()["id"]
        heir = await registered_provider(s)
        out = (await retire(s, lost.contributor.provider_id, heir.provider_id)).json()
        assert out["payouts_requested"] == [payout_id]

        r = await s.admin.post(
            f"/v1/admin/payouts/{payout_id}/reject",
            json={"reason": "provider key stolen"},
            headers=s.admin_headers,
        )
        assert r.status_code == 200, r.text
        p = await provider_balances(s, lost.contributor.provider_id)
        assert (p["withdrawn"], p["rewards_claimable"]) == (0, 0)
        assert (await provider_balances(s, heir.provider_id))["rewards_claimable"] == 7
        await books_balance(app_state)


async def test_the_successor_is_blacklisted_where_the_retired_provider_is(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        [lost] = s.workers
        heir_worker = await s.add_worker(stake=1000)
        r = await s.admin.post(
            f"/v1/admin/pools/{s.pool_id}/blacklist",
            json={"provider_id": lost.contributor.provider_id, "reason": "cheating"},
            headers=s.headers,
        )
        assert r.status_code in (200, 201), r.text
        out = (await retire(s, lost.contributor.provider_id, heir_worker.contributor.provider_id)).json()
        assert out["blacklists_copied"] == [s.pool_id]
        assert (await statuses(s, s.pool_id))[heir_worker.node_id] == "left"
        r = await join(heir_worker.client, heir_worker.contributor, s.pool_id)
        assert r.status_code == 403, r.text
        await books_balance(app_state)


async def test_money_a_retired_provider_is_credited_later_is_swept_to_its_heir_down_the_chain(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A successor retired in turn hands on to its own: a reward of the first provider released
    after both retirements lands on the last; and money credited to a retired provider by a
    path that does not forward it (an appeal's restoration) is swept there by the release tick."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        [lost] = s.workers
        middle, last = await registered_provider(s), await registered_provider(s)
        await earn(s, app_state, lost)
        p = lost.contributor.provider_id
        assert (await retire(s, p, middle.provider_id, key="retire-p-0001")).status_code == 201
        assert (await retire(s, middle.provider_id, last.provider_id, key="retire-m-0001")).status_code == 201
        async with app_state.sessionmaker() as session, session.begin():
            await ledger.transfer(
                session,
                debit=system_account(SystemAccount.rewards),
                credit=provider_account(p, ProviderAccount.rewards_claimable),
                amount=5,
                key="as-an-appeal-gives-back",
                reason="forfeit_restore",
                actor="test",
            )
        clock.advance(HOLD_S + 1)
        assert await release_once(app_state) == 1
        for provider in (p, middle.provider_id):
            b = await provider_balances(s, provider)
            assert (b["rewards_pending"], b["rewards_claimable"]) == (0, 0)
        assert (await provider_balances(s, last.provider_id))["rewards_claimable"] == 12
        await books_balance(app_state)


async def test_a_retired_provider_whose_heir_cannot_take_its_money_does_not_stop_the_others_sweep(
    client: httpx.AsyncClient, app_state: Any, admin_headers: dict[str, str]
) -> None:
    """The sweep forwards each retired provider's money in a savepoint of its own: one whose heir
    cannot take it (the heir's balance would pass the ledger's 64-bit bound) is logged and left,
    and the others are swept. Before, that one refusal rolled back the sweep's whole transaction,
    at every tick: no retired provider's later credit reached its heir any more."""
    from orchestrator.ledger import succession

    lost1, heir1, lost2, heir2 = (new_contributor() for _ in range(4))
    for c in (lost1, heir1, lost2, heir2):
        assert (await client.post("/v1/providers", json={}, auth=c.provider_auth)).status_code == 201
    for i, (lost, heir) in enumerate(((lost1, heir1), (lost2, heir2))):
        r = await client.post(
            f"/v1/admin/providers/{lost.provider_id}/retire",
            json={"successor_id": heir.provider_id, "reason": "key lost"},
            headers={**admin_headers, "Idempotency-Key": f"retire-{i:04}"},
        )
        assert r.status_code == 201, r.text
    near_full = ledger.MAX_BALANCE - 5
    async with app_state.sessionmaker() as session, session.begin():
        # heir1's free stake is 5 short of the largest balance (from the system's rewards).
        ids = [
            await ledger.account_id(session, ref)
            for ref in (
                system_account(SystemAccount.rewards),
                provider_account(heir1.provider_id, ProviderAccount.stake_free),
            )
        ]
        for account, balance in zip(ids, (-near_full, near_full), strict=True):
            await session.execute(
                update(LedgerAccount).where(LedgerAccount.id == account).values(balance=balance)
            )
        for lost in (lost1, lost2):  # credited after the retirement: the sweep's to forward
            await ledger.deposit(
                session, lost.provider_id, 10, key=f"late-{lost.provider_id}", actor="t", reference=None
            )
    with structlog.testing.capture_logs() as logs:
        async with app_state.sessionmaker() as session, session.begin():
            assert await succession.sweep(session) == 1
    assert [e["provider_id"] for e in logs if e["event"] == "succession_sweep_failed"] == [lost1.provider_id]
    async with app_state.sessionmaker() as session:
        assert (await ledger.provider_balances(session, lost2.provider_id))["stake_free"] == 0
        assert (await ledger.provider_balances(session, heir2.provider_id))["stake_free"] == 10
        assert (await ledger.provider_balances(session, lost1.provider_id))["stake_free"] == 10
        assert (await ledger.provider_balances(session, heir1.provider_id))["stake_free"] == near_full
        # Summed here: SQLite's sum() of these balances overflows on its way.
        assert sum((await session.execute(select(LedgerAccount.balance))).scalars()) == 0


@postgres_only
async def test_a_retirement_racing_a_withdrawal_cannot_both_take_the_claimable_rewards(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        [lost] = s.workers
        await earn(s, app_state, lost)
        assert await release_now(app_state, clock) == 1
        heir = await registered_provider(s)
        p = lost.contributor.provider_id
        # The withdrawal holds the claimable rewards (its transaction open): the retirement waits.
        session = app_state.sessionmaker()
        await session.begin()
        try:
            from orchestrator.payouts import service as payouts

            await payouts.request_withdrawal(session, p, 7, "thief-0001", now=clock.utcnow())
            retiring = asyncio.create_task(retire(s, p, heir.provider_id))
            await until_waiting(app_state, 1, retiring, on="row")
            assert not retiring.done()
            await session.commit()
        finally:
            await session.close()
        out = (await retiring).json()
        # The retirement found nothing claimable: the payout has it, left for an admin.
        assert "rewards_claimable" not in out["moved"]
        assert len(out["payouts_requested"]) == 1
        assert (await provider_balances(s, heir.provider_id))["rewards_claimable"] == 0
        assert (await provider_balances(s, p))["withdrawn"] == 7
        await books_balance(app_state)

        # The other way round: the retirement holds the accounts, a withdrawal signed with the
        # key waits, then finds nothing (and the key refused from then on).
        await earn(s, app_state, (w2 := await s.add_worker(stake=1000)))
        assert await release_now(app_state, clock) == 1
        heir2 = await registered_provider(s)
        async with retirement_held(app_state, w2.contributor.provider_id, heir2.provider_id, "retire-race-2"):
            withdrawing = asyncio.create_task(
                w2.client.post(
                    "/v1/providers/me/withdrawals",
                    json={"amount": 7},
                    headers={"Idempotency-Key": "thief-0002"},
                    auth=w2.contributor.provider_auth,
                )
            )
            await until_waiting(app_state, 1, withdrawing, on="row")
            assert not withdrawing.done()
        r = await withdrawing
        assert r.status_code in (403, 409), r.text
        assert (await provider_balances(s, heir2.provider_id))["rewards_claimable"] == 7
        assert (await provider_balances(s, w2.contributor.provider_id))["withdrawn"] == 0
        await books_balance(app_state)


async def test_a_provider_row_records_a_retirement_whole_or_not_at_all(app_state: Any) -> None:
    from sqlalchemy.exc import IntegrityError

    async with app_state.sessionmaker() as session:
        a, b = key_id_of(generate_key()), key_id_of(generate_key())
        async with session.begin():
            session.add_all([Provider(id=a), Provider(id=b)])
        with pytest.raises(IntegrityError):
            async with session.begin():
                await session.execute(
                    Provider.__table__.update().where(Provider.id == a).values(successor_id=b)
                )
        with pytest.raises(IntegrityError):
            async with session.begin():
                await session.execute(
                    Provider.__table__.update()
                    .where(Provider.id == a)
                    .values(
                        successor_id=a,
                        retired_at=Provider.created_at,
                        retirement_reason="r",
                        retirement_key="k",
                        retired_by="tok_x",
                    )
                )
        assert (
            await session.execute(select(Provider.retired_at).where(Provider.id == a))
        ).scalar_one() is None


async def test_two_retirements_at_once_with_one_key_move_the_money_once(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1500) as s:
        [lost] = s.workers
        heir = await registered_provider(s)
        p = lost.contributor.provider_id
        answers = await asyncio.gather(
            *(retire(s, p, heir.provider_id, key="retire-twice") for _ in range(2))
        )
        assert sorted(r.status_code for r in answers) == [200, 201], [r.text for r in answers]
        assert answers[0].json() == answers[1].json()
        assert (await provider_balances(s, heir.provider_id))["stake_free"] == 500
        assert len(await audit(s, "provider.retire")) == 1
        await books_balance(app_state)


@postgres_only
async def test_a_reward_release_racing_the_retirement_of_its_provider_pays_the_successor_a_tick_later(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """The release read the provider as not retired, then waited for the retirement's locks on
    its accounts: it leaves the hold for the next tick (the successor's account is not among
    its locks), which pays it to the successor. Neither strands it on the retired provider."""
    from orchestrator.admin.tokens import Principal, Role
    from orchestrator.identity import retirement

    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        [lost] = s.workers
        await earn(s, app_state, lost)
        heir = await registered_provider(s)
        p = lost.contributor.provider_id
        async with app_state.sessionmaker() as session, session.begin():
            await session.execute(
                update(RewardHold).where(RewardHold.status == "held").values(release_at=clock.utcnow())
            )
        clock.advance(31)
        session = app_state.sessionmaker()
        await session.begin()
        try:
            admin = Principal(token_id="tok_test_admin", name="admin", role=Role.admin)
            await retirement.retire(
                session, app_state, p, heir.provider_id, "stolen", key="retire-race-3", principal=admin
            )
            releasing = asyncio.create_task(release_once(app_state))
            await until_waiting(app_state, 1, releasing, on="row")
            assert not releasing.done()
            await session.commit()
        finally:
            await session.close()
        assert await releasing == 0
        assert (await provider_balances(s, p))["rewards_pending"] == 7
        clock.advance(31)
        assert await release_once(app_state) == 1
        assert (await provider_balances(s, p))["rewards_claimable"] == 0
        assert (await provider_balances(s, heir.provider_id))["rewards_claimable"] == 7
        await books_balance(app_state)


@postgres_only
async def test_a_node_registration_racing_the_retirement_of_its_provider_waits_and_is_refused(
    app: Any, app_state: Any
) -> None:
    """A node registered while the retirement ran would be a node it never revoked: the
    registration waits for the provider's row, then finds it retired."""
    from orchestrator.identity.models import Node

    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        [lost] = s.workers
        heir = await registered_provider(s)
        thief = Contributor(provider_key=lost.contributor.provider_key, node_key=generate_key())
        async with retirement_held(
            app_state, lost.contributor.provider_id, heir.provider_id, "retire-race-4"
        ):
            registering = asyncio.create_task(
                lost.client.post("/v1/nodes", json=thief.node_body(), auth=thief.node_auth)
            )
            await until_waiting(app_state, 1, registering, on="row")
            assert not registering.done()
        problem(await registering, 403, "provider_retired")
        async with app_state.sessionmaker() as check:
            assert await check.get(Node, thief.node_id) is None


async def test_an_appeal_after_the_retirement_pays_and_gives_back_to_the_successor(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A right result of the retired provider's node rejected as fraud: its appeal after the
    retirement gives the slashed stake back and pays the reward the result was due, both to the
    retired provider first, and they reach the successor (the stake at the next release tick,
    the reward when its hold ends); the pool counts what the appeal paid as spent, in its view
    as in its stats."""
    from tests.test_appeals import rejected_right, reverse

    econ = {**ECON, "reward_budget": 1000}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        [lost] = s.workers
        await earn(s, app_state, lost)
        assert await release_now(app_state, clock) == 1  # 7 claimable
        v = await rejected_right(s, lost, app_state, "fraud")  # 200 slashed, 14 due
        heir = await registered_provider(s)
        p, h = lost.contributor.provider_id, heir.provider_id
        assert (await retire(s, p, h)).status_code == 201
        assert (await provider_balances(s, h))["rewards_claimable"] == 7

        r = await reverse(s, v["id"])
        assert r.status_code == 200 and r.json()["reward_paid_on_appeal"] == 14, r.text
        view = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}", headers=s.headers)).json()
        stats = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/stats", headers=s.headers)).json()
        assert view["rewards_credited"] == stats["rewards_credited"] == 7 + 14
        await books_balance(app_state)

        assert await release_now(app_state, clock) == 1
        assert await provider_balances(s, p) == {
            "stake_free": 0,
            "stake_locked": 0,
            "stake_unbonding": 800,
            "rewards_pending": 0,
            "rewards_claimable": 0,
            "withdrawn": 0,
        }
        heirs = await provider_balances(s, h)
        assert (heirs["stake_free"], heirs["rewards_claimable"]) == (200, 7 + 14)
        await books_balance(app_state)


@pytest.mark.parametrize("released", ["before_the_retirement", "after_the_retirement"])
async def test_an_appeal_takes_a_released_reward_back_from_the_successor_that_received_it(
    app: Any, app_state: Any, clock: FakeClock, released: str
) -> None:
    """A reward of the retired provider's node, released and moved on to the successor (by the
    retirement, or by the release after it), is reversed on appeal as the provider's own would
    be: taken back from the claimable rewards the successor received it into, 200, the books
    balanced; a retirement is no way out of a reversal, as it is none out of a blacklist, and the
    appeal's outcome no longer depends on whether the release tick ran before it. One the
    successor no longer holds (withdrawn) cannot be taken back: 409 reversal_impossible, nothing
    changes, as for a provider's own withdrawn reward. Before, every such appeal was 409: the
    retired provider's claimable, which it reversed, holds nothing at rest."""
    from tests.test_appeals import reverse

    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        [lost] = s.workers
        await earn(s, app_state, lost)
        await earn(s, app_state, lost)
        heir = await registered_provider(s)
        p, h = lost.contributor.provider_id, heir.provider_id
        if released == "before_the_retirement":
            assert await release_now(app_state, clock) == 2
        assert (await retire(s, p, h)).status_code == 201
        if released == "after_the_retirement":
            assert await release_now(app_state, clock) == 2
        assert (await provider_balances(s, h))["rewards_claimable"] == 14
        first, second = [x for x in await verdicts(s.admin, s.headers, s.pool_id) if x["category"] == "valid"]

        r = await reverse(s, first["id"])
        assert r.status_code == 200, r.text
        assert (await provider_balances(s, h))["rewards_claimable"] == 7
        assert (await provider_balances(s, p))["rewards_claimable"] == 0
        await books_balance(app_state)

        async with app_state.sessionmaker() as session, session.begin():
            await request_withdrawal(session, h, 7, "heir-withdraws", now=clock.utcnow())
        problem(await reverse(s, second["id"]), 409, "reversal_impossible")
        assert (await provider_balances(s, h))["withdrawn"] == 7
        listed = {x["id"]: x for x in await verdicts(s.admin, s.headers, s.pool_id)}
        assert listed[second["id"]]["reversed_at"] is None
        await books_balance(app_state)


#: A pool that ejects a node and bans its provider at their second fraud strike.
TWO_STRIKES = {**ECON, "strikes_before_ejection": 2, "strikes_before_provider_ban": 2}


async def one_strike_from_a_ban(s: PoolSetup, app_state: Any) -> tuple[Worker, Worker, Worker]:
    """In a ``TWO_STRIKES`` pool of one worker (``lost``): a second node of its provider
    (``sibling``) and another provider's node (``heir``) join; the sibling's forged result is
    judged fraud (the provider's first strike), and ``lost`` submits a forged one, whose verdict
    will be the provider's second strike (one for each node: no ejection), which bans it."""
    from tests.test_appeals import forged

    [lost] = s.workers
    sibling = await s.add_worker(provider_key=lost.contributor.provider_key, stake=2000)
    heir = await s.add_worker(stake=1000)
    await forged(s, sibling)
    await verify_all(app_state)  # the provider's first strike
    await forged(s, lost)
    return lost, sibling, heir


@postgres_only
async def test_a_provider_ban_the_verifier_commits_while_the_retirement_waits_reaches_the_successor(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verifier's fraud verdict on a result of a node that has left the pool since blacklists
    its provider (the second strike of its two nodes, one each: no ejection) and holds its
    transaction open; the retirement started meanwhile waits for it, and then copies that
    blacklisting to the successor as well. Before, it read the blacklists before its locks and
    the successor was left out: the retirement was a way out of the verifier's ban."""
    from orchestrator.pools import service as pools_service

    async with pool_setup(app, app_state, workers=1, economics=TWO_STRIKES, stake=2000) as s:
        lost, sibling, heir = await one_strike_from_a_ban(s, app_state)
        p, h = lost.contributor.provider_id, heir.contributor.provider_id
        for w in (lost, sibling):  # the blacklisting ends no membership then, and locks no node
            assert (await leave(w.client, w.contributor, s.pool_id)).status_code == 200
        banned, go = asyncio.Event(), asyncio.Event()
        real = pools_service.blacklist_for_fraud

        async def held(*args: Any, **kwargs: Any) -> bool:
            created = await real(*args, **kwargs)
            banned.set()
            await go.wait()  # the verdict's transaction stays open, its locks held
            return created

        monkeypatch.setattr(pools_service, "blacklist_for_fraud", held)
        verifying = asyncio.create_task(verify_all(app_state))
        await asyncio.wait_for(banned.wait(), 60)
        retiring = asyncio.create_task(retire(s, p, h, key="retire-race-5"))
        await until_waiting(app_state, 1, retiring, on="row")
        assert not retiring.done()
        go.set()
        await verifying
        r = await retiring
        assert r.status_code == 201, r.text
        assert r.json()["blacklists_copied"] == [s.pool_id]
        assert (await statuses(s, s.pool_id))[heir.node_id] == "left"
        assert await blacklisted_in(app_state, s.pool_id) == sorted([p, h])
        assert (await join(heir.client, heir.contributor, s.pool_id)).status_code == 403
        await books_balance(app_state)


async def test_a_provider_ban_decided_after_the_retirement_reaches_the_successor(
    app: Any, app_state: Any
) -> None:
    """A result the retired provider's node sent before the retirement is found fraud after it,
    and its strike reaches the pool's provider limit: the verifier blacklists the retired
    provider and its successor with it (an entry no appeal lifts, as a retirement's copies; an
    operator removes it), ending the successor's membership there. Before, only the retired
    provider was blacklisted, whose nodes are revoked anyway: the successor went on."""
    from tests.test_appeals import forged

    econ = {**ECON, "strikes_before_ejection": 1, "strikes_before_provider_ban": 1}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        [lost] = s.workers
        heir = await s.add_worker(stake=1000)
        p, h = lost.contributor.provider_id, heir.contributor.provider_id
        await forged(s, lost)
        r = await retire(s, p, h)
        assert r.status_code == 201 and r.json()["blacklists_copied"] == [], r.text
        assert (await statuses(s, s.pool_id))[heir.node_id] == "active"
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["node_id"], v["category"]) == (lost.node_id, "fraud")
        assert await blacklisted_in(app_state, s.pool_id) == sorted([p, h])
        assert (await statuses(s, s.pool_id))[heir.node_id] == "left"
        problem(await join(heir.client, heir.contributor, s.pool_id), 403, "provider_blacklisted")
        assert (await provider_balances(s, h))["stake_unbonding"] == 1000
        await books_balance(app_state)


async def blacklist(s: PoolSetup, pool_id: str, provider_id: str, reason: str = "cheating") -> httpx.Response:
    return await s.admin.post(
        f"/v1/admin/pools/{pool_id}/blacklist",
        json={"provider_id": provider_id, "reason": reason},
        headers=s.headers,
    )


@asynccontextmanager
async def blacklisting_held(app_state: Any, pool_id: str, provider_id: str) -> AsyncIterator[None]:
    """An operator's blacklisting of ``provider_id`` in ``pool_id`` done in a transaction that
    stays open, holding its locks, until the block ends; then committed."""
    from orchestrator.pools import service as pools_service
    from tests.test_node_revocation import ADMIN

    session = app_state.sessionmaker()
    await session.begin()
    try:
        await pools_service.blacklist_provider(
            session, ADMIN, pool_id, provider_id, "cheating", now=app_state.clock.utcnow()
        )
        yield
        await session.commit()
    finally:
        await session.close()


async def test_a_blacklisting_after_the_retirement_reaches_the_heir_down_the_chain(
    app: Any, app_state: Any
) -> None:
    """An operator blacklists a provider retired for a provider retired since: its heir (the
    last successor) is blacklisted too, in a pool the retired provider never joined as in one it
    did, where the heir's membership ends. Before, only the retired provider (whose nodes are
    revoked anyway) was blacklisted, and the heir went on: a retirement was a way out of a
    blacklisting an operator decided after it."""
    from tests.pools_helpers import active_pool

    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        [lost] = s.workers
        middle = await registered_provider(s)
        heir = await s.add_worker(stake=1000)
        p, m, h = lost.contributor.provider_id, middle.provider_id, heir.contributor.provider_id
        assert (await retire(s, p, m)).status_code == 201
        assert (await retire(s, m, h, key="retire-0002")).status_code == 201
        other = (await active_pool(s.admin, s.headers, name="never-joined"))["id"]

        r = await blacklist(s, other, p)
        assert r.status_code == 201, r.text
        assert await blacklisted_in(app_state, other) == sorted([p, h])
        r = await blacklist(s, s.pool_id, p)
        assert r.status_code == 201, r.text
        assert await blacklisted_in(app_state, s.pool_id) == sorted([p, h])
        assert (await statuses(s, s.pool_id))[heir.node_id] == "left"
        problem(await join(heir.client, heir.contributor, s.pool_id), 403, "provider_blacklisted")
        copies = [e for e in await audit(s, "pool.blacklist_provider") if e["target_id"] == h]
        assert sorted(e["pool_id"] for e in copies) == sorted([other, s.pool_id])
        assert {e["actor"] for e in copies} == {"succession"}
        await books_balance(app_state)


@postgres_only
async def test_a_blacklisting_committed_while_the_retirement_runs_reaches_the_successor(
    app: Any, app_state: Any
) -> None:
    """An operator blacklists the provider in a pool it never joined while its retirement holds
    its transaction open: the blacklisting waits for the retirement and then blacklists the
    successor too."""
    from tests.pools_helpers import active_pool

    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        [lost] = s.workers
        heir = await registered_provider(s)
        p, h = lost.contributor.provider_id, heir.provider_id
        other = (await active_pool(s.admin, s.headers, name="never-joined"))["id"]
        async with retirement_held(app_state, p, h, "retire-race-6"):
            blacklisting = asyncio.create_task(blacklist(s, other, p))
            await until_waiting(app_state, 1, blacklisting, on="row")
            assert not blacklisting.done()
        assert (await blacklisting).status_code == 201
        assert await blacklisted_in(app_state, other) == sorted([p, h])


@postgres_only
async def test_a_blacklisting_committed_after_the_retirement_began_reaches_the_successor(
    app: Any, app_state: Any
) -> None:
    """An operator's blacklisting of the provider in a pool it never joined holds its
    transaction open; the retirement started meanwhile waits for it, and then copies it to the
    successor. Before, the retirement did not wait: it read the blacklists without this one,
    which committed after it, and the successor was left out."""
    from tests.pools_helpers import active_pool

    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        [lost] = s.workers
        heir = await registered_provider(s)
        p, h = lost.contributor.provider_id, heir.provider_id
        other = (await active_pool(s.admin, s.headers, name="never-joined"))["id"]
        async with blacklisting_held(app_state, other, p):
            retiring = asyncio.create_task(retire(s, p, h, key="retire-race-7"))
            await until_waiting(app_state, 1, retiring, on="row")
            waited = not retiring.done()
        r = await retiring
        assert r.status_code == 201, r.text
        assert await blacklisted_in(app_state, other) == sorted([p, h])
        assert r.json()["blacklists_copied"] == [other]
        assert waited


@postgres_only
async def test_a_retirement_racing_a_verifier_ban_that_ends_live_memberships_does_not_deadlock(
    app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verifier's batch holds the pool (shared), the provider's memberships and accounts,
    and is about to blacklist the provider (the second strike of its two nodes, one each: no
    ejection), whose nodes are still live members; the retirement
    starts and waits for the pool; then the ban ends the membership, which locks the nodes.
    Before, the retirement took the provider's nodes before the pools, so it held the nodes the
    ban waited for while it waited for the pool the batch held: PostgreSQL broke the deadlock by
    aborting one of them (the retirement's 503 transient_conflict). Now the retirement takes the
    pools, memberships and accounts before the nodes (the global order), waits for the batch,
    and then copies its ban to the successor."""
    from orchestrator.pools import service as pools_service

    async with pool_setup(app, app_state, workers=1, economics=TWO_STRIKES, stake=2000) as s:
        lost, sibling, heir = await one_strike_from_a_ban(s, app_state)
        p, h = lost.contributor.provider_id, heir.contributor.provider_id
        deciding, go = asyncio.Event(), asyncio.Event()
        real = pools_service.blacklist_for_fraud

        async def held(*args: Any, **kwargs: Any) -> bool:
            deciding.set()
            await go.wait()  # the batch holds its locks: the pool, memberships and accounts
            return await real(*args, **kwargs)

        monkeypatch.setattr(pools_service, "blacklist_for_fraud", held)
        verifying = asyncio.create_task(verify_all(app_state))
        await asyncio.wait_for(deciding.wait(), 60)
        retiring = asyncio.create_task(retire(s, p, h, key="retire-race-8"))
        await until_waiting(app_state, 1, retiring, on="row")
        assert not retiring.done()
        go.set()
        with structlog.testing.capture_logs() as logs:
            await verifying
            r = await retiring
        assert r.status_code == 201, r.text
        assert [e for e in logs if e["log_level"] in ("error", "critical")] == []
        assert r.json()["blacklists_copied"] == [s.pool_id]
        assert {(v["node_id"], v["category"]) for v in await verdicts(s.admin, s.headers, s.pool_id)} == {
            (lost.node_id, "fraud"),
            (sibling.node_id, "fraud"),
        }
        assert await blacklisted_in(app_state, s.pool_id) == sorted([p, h])
        assert await statuses(s, s.pool_id) == {
            lost.node_id: "left",
            sibling.node_id: "left",
            heir.node_id: "left",
        }
        await books_balance(app_state)


@postgres_only
async def test_a_join_sent_while_the_retirement_waits_for_the_pools_waits_for_it_and_is_refused(
    app: Any, app_state: Any
) -> None:
    """The retirement read the provider's pools and waits for one of them (an operator's
    blacklisting of another provider there holds it); meanwhile the provider's node asks to join
    another pool. The join waits for the retirement at the provider's row (before it takes the
    node), and is then refused: the node is banned, and no membership is left behind."""
    from tests.pools_helpers import active_pool

    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        [lost] = s.workers
        heir = await registered_provider(s)
        bystander = await registered_provider(s)
        p, h = lost.contributor.provider_id, heir.provider_id
        other = (await active_pool(s.admin, s.headers, name="joined-meanwhile"))["id"]
        async with blacklisting_held(app_state, s.pool_id, bystander.provider_id):
            retiring = asyncio.create_task(retire(s, p, h, key="retire-race-9"))
            await until_waiting(app_state, 1, retiring, on="row")
            joining = asyncio.create_task(join(lost.client, lost.contributor, other))
            await until_waiting(app_state, 2, retiring, joining, on="row")
            assert not retiring.done() and not joining.done()
        r = await retiring
        assert r.status_code == 201, r.text
        assert r.json()["revoked_nodes"] == {lost.node_id: [s.pool_id]}
        problem(await joining, 403, "node_banned")
        assert lost.node_id not in await statuses(s, other)
        await books_balance(app_state)


@postgres_only
async def test_an_heirs_blacklisting_committed_while_the_retirement_waits_is_copied_on(
    app: Any, app_state: Any
) -> None:
    """The retirement of M (the heir of Q, retired before) read M's pools and waits for one of
    them; meanwhile the verifier bans Q in another pool, which blacklists M there as Q's heir.
    The retirement finds that pool once it holds its locks, gives them back (its savepoint) and
    takes them again with the new pool, and copies both blacklistings to M's successor."""
    from tests.pools_helpers import active_pool
    from tests.test_appeals import forged

    econ = {**ECON, "strikes_before_ejection": 1, "strikes_before_provider_ban": 1}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        [lost] = s.workers
        middle = await registered_provider(s)
        heir = await registered_provider(s)
        bystander = await registered_provider(s)
        q, m, h = lost.contributor.provider_id, middle.provider_id, heir.provider_id
        z = (await active_pool(s.admin, s.headers, name="blacklists-middle"))["id"]
        assert (await blacklist(s, z, m)).status_code == 201
        await forged(s, lost)
        assert (await retire(s, q, m)).status_code == 201
        async with blacklisting_held(app_state, z, bystander.provider_id):
            retiring = asyncio.create_task(retire(s, m, h, key="retire-race-13"))
            await until_waiting(app_state, 1, retiring, on="row")
            await verify_all(app_state)  # Q's fraud bans it in the pool, and M with it
            assert await blacklisted_in(app_state, s.pool_id) == sorted([q, m])
            assert not retiring.done()
        r = await retiring
        assert r.status_code == 201, r.text
        assert sorted(r.json()["blacklists_copied"]) == sorted([s.pool_id, z])
        assert await blacklisted_in(app_state, s.pool_id) == sorted([q, m, h])
        assert await blacklisted_in(app_state, z) == sorted([bystander.provider_id, m, h])
        await books_balance(app_state)


async def _node_request(s: PoolSetup, node: Worker, action: str) -> httpx.Response:
    """A request that locks the node's row, then its pools: its join, an admin's ban of it, or
    its provider's revocation of it."""
    if action == "join":
        return await join(node.client, node.contributor, s.pool_id)
    if action == "ban":
        return await s.admin.post(
            f"/v1/admin/nodes/{node.node_id}/ban", json={"reason": "stolen"}, headers=s.admin_headers
        )
    from tests.test_node_revocation import revoke

    return await revoke(node.client, node.contributor, node.node_id)


@postgres_only
@pytest.mark.parametrize("action", ["join", "ban", "revoke"])
async def test_a_retirement_racing_a_join_ban_or_revocation_of_the_providers_node_does_not_deadlock(
    app: Any, app_state: Any, action: str
) -> None:
    """The retirement waits for the provider's pool (an operator's blacklisting of another
    provider there holds it); meanwhile the provider's node sends a join to that pool, an admin
    bans the node or the provider revokes it, each of which locks the node's row, then its
    pools. Before, when the pool was free the retirement took it and then waited for the node
    the other held, while the other waited for the pool the retirement held: PostgreSQL aborted
    one of them (503 transient_conflict; bbd9169 had moved the retirement's nodes after its
    pools). The other now waits for the retirement at the provider's row, holding nothing, and
    then finds the node revoked: a join is refused (node_banned), a ban or a revocation answers
    the node as it is."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        [lost] = s.workers
        heir = await registered_provider(s)
        bystander = await registered_provider(s)
        p, h = lost.contributor.provider_id, heir.provider_id
        async with blacklisting_held(app_state, s.pool_id, bystander.provider_id):
            retiring = asyncio.create_task(retire(s, p, h, key=f"retire-race-{action}"))
            await until_waiting(app_state, 1, retiring, on="row")
            other = asyncio.create_task(_node_request(s, lost, action))
            await until_waiting(app_state, 2, retiring, other, on="row")
            assert not retiring.done() and not other.done()
        r = await retiring
        o = await other
        assert r.status_code == 201, r.text
        if action == "join":
            problem(o, 403, "node_banned")
        else:
            assert o.status_code == 200, o.text
            assert action != "ban" or o.json()["status"] == "banned"
        await books_balance(app_state)


@postgres_only
async def test_a_retirement_racing_a_join_of_the_successors_node_does_not_deadlock(
    app: Any, app_state: Any
) -> None:
    """The provider is blacklisted where its successor's node is a member, so the retirement
    copies the blacklisting to the successor and ends that membership, which locks the node.
    A join of that node sent while the retirement waited for the pool held the node and waited
    for the pool: PostgreSQL aborted one of them. The retirement now holds the successor's row
    so that the join waits for it there, holding nothing, and is then refused."""
    async with pool_setup(app, app_state, workers=1, economics=ECON, stake=1000) as s:
        [lost] = s.workers
        heir = await s.add_worker(stake=1000)
        bystander = await registered_provider(s)
        p, h = lost.contributor.provider_id, heir.contributor.provider_id
        assert (await blacklist(s, s.pool_id, p)).status_code == 201
        async with blacklisting_held(app_state, s.pool_id, bystander.provider_id):
            retiring = asyncio.create_task(retire(s, p, h, key="retire-race-14"))
            await until_waiting(app_state, 1, retiring, on="row")
            joining = asyncio.create_task(join(heir.client, heir.contributor, s.pool_id))
            await until_waiting(app_state, 2, retiring, joining, on="row")
            assert not retiring.done() and not joining.done()
        r = await retiring
        assert r.status_code == 201, r.text
        problem(await joining, 403, "provider_blacklisted")
        assert (await statuses(s, s.pool_id))[heir.node_id] == "left"
        await books_balance(app_state)


async def test_an_appeal_takes_from_the_successor_only_what_the_retired_providers_claimable_lacks(
    app: Any, app_state: Any, clock: FakeClock
) -> None:
    """A reward of 7 of the retired provider's node, 5 of it taken by a soft penalty: 2 released
    and moved on to the successor. The penalty's appeal gives its 5 back to the retired
    provider's claimable rewards (the sweep of the next release tick moves them on). The
    reward's appeal before that tick takes the reward back from where it is: 2 from the
    successor, 5 from the retired provider's claimable. Before, it took all 7 from the
    successor, who held 2: 409 reversal_impossible, for a reward whose every part was there."""
    from tests.test_appeals import rejected_right, reverse

    econ = {**ECON, "soft_invalid_penalty": 5}
    async with pool_setup(app, app_state, workers=1, economics=econ, stake=1000) as s:
        [lost] = s.workers
        await earn(s, app_state, lost)
        i = await rejected_right(s, lost, app_state, "invalid")
        assert i["slashed_amount"] == 5
        heir = await registered_provider(s)
        p, h = lost.contributor.provider_id, heir.provider_id
        assert (await retire(s, p, h)).status_code == 201
        assert await release_now(app_state, clock) == 1
        assert (await provider_balances(s, h))["rewards_claimable"] == 2
        assert (await reverse(s, i["id"])).status_code == 200
        assert (await provider_balances(s, p))["rewards_claimable"] == 5
        [accepted] = [x for x in await verdicts(s.admin, s.headers, s.pool_id) if x["category"] == "valid"]

        r = await reverse(s, accepted["id"])
        assert r.status_code == 200, r.text
        assert (await provider_balances(s, h))["rewards_claimable"] == 0
        assert (await provider_balances(s, p))["rewards_claimable"] == 0
        await books_balance(app_state)
