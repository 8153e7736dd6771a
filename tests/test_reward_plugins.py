"""Reward functions from plugins: an installed package's entry point in ``orchestrator.rewards``."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from orchestrator.verification import rewards, scoring


@dataclass(frozen=True)
class ShortAnswer:
    """A toy plugin: full reward for answers of at most ``spec['max_chars']`` characters."""

    name: str = "short_answer"

    def canonical(self, completion: str) -> str:
        return completion.strip()

    def reward(self, completion: str, spec: Mapping[str, Any]) -> float | None:
        if "max_chars" not in spec:
            return None
        return 1.0 if len(completion.strip()) <= int(spec["max_chars"]) else 0.0


@dataclass(frozen=True)
class Broken:
    """A faulty plugin: returns the spec's ``value`` as its reward (a string such as "nan" made
    a float, anything else as it is), whatever the completion."""

    name: str = "broken"

    def canonical(self, completion: str) -> str:
        return completion.strip()

    def reward(self, completion: str, spec: Mapping[str, Any]) -> Any:
        value = spec["value"]
        return (
            float(value[len("float:") :]) if isinstance(value, str) and value.startswith("float:") else value
        )


@dataclass(frozen=True)
class Dies:
    """A plugin whose scoring process dies (as if the OOM killer took it) the first
    ``spec['deaths']`` times it scores, counted in the file ``spec['marker']``; then full reward."""

    name: str = "dies"

    def canonical(self, completion: str) -> str:
        return completion.strip()

    def reward(self, completion: str, spec: Mapping[str, Any]) -> float | None:
        marker = Path(spec["marker"])
        died = len(marker.read_text()) if marker.exists() else 0
        if died < int(spec["deaths"]):
            marker.write_text("x" * (died + 1))
            os._exit(9)
        return 1.0


@dataclass(frozen=True)
class Raises:
    """A plugin with a bug: it raises on a completion it does not expect (one with no digit)."""

    name: str = "raises"

    def canonical(self, completion: str) -> str:
        return completion.strip()

    def reward(self, completion: str, spec: Mapping[str, Any]) -> float | None:
        digits = [c for c in completion if c.isdigit()]
        return 1.0 if digits[-1] == str(spec["answer"]) else 0.0  # IndexError without a digit


@dataclass(frozen=True)
class Sandbox:
    """A plugin that needs a service (a code sandbox): down while the file ``spec['down']``
    exists, when it raises ``RewardUnavailable``; then full reward for the spec's answer on
    the last line."""

    name: str = "sandbox"

    def canonical(self, completion: str) -> str:
        return completion.strip().splitlines()[-1]

    def reward(self, completion: str, spec: Mapping[str, Any]) -> float | None:
        if "calls" in spec:  # counted in that file, one character a call
            with Path(spec["calls"]).open("a") as calls:
                calls.write("x")
        if Path(spec["down"]).exists():
            raise rewards.RewardUnavailable("sandbox: connection refused")
        return 1.0 if self.canonical(completion) == str(spec["answer"]) else 0.0


@dataclass(frozen=True)
class Partial:
    """A plugin that checks some samples only: nothing to check for a completion whose last line
    begins with "?", else full reward for the spec's answer on the last line."""

    name: str = "partial"

    def canonical(self, completion: str) -> str:
        return completion.strip().splitlines()[-1]

    def reward(self, completion: str, spec: Mapping[str, Any]) -> float | None:
        answer = self.canonical(completion)
        if answer.startswith("?"):
            return None
        return 1.0 if answer == str(spec["answer"]) else 0.0


@pytest.fixture
def plugin_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A package that declares ``short_answer`` in ``orchestrator.rewards``, installed on the
    path (a ``.dist-info`` with its entry points), where the scoring processes find it too."""
    info = tmp_path / "short_answer_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: short-answer-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{rewards.ENTRY_POINT_GROUP}]\nshort_answer = {__name__}:ShortAnswer\nbroken = {__name__}:Broken\n"
        f"dies = {__name__}:Dies\nraises = {__name__}:Raises\npartial = {__name__}:Partial\n"
        f"sandbox = {__name__}:Sandbox\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards._plugins.cache_clear()
    scoring.close_pools()  # the next scoring processes start with the plugin on their path
    yield
    scoring.close_pools()
    rewards._plugins.cache_clear()


def test_a_plugin_reward_function_is_found_and_used(plugin_installed: None) -> None:
    assert "short_answer" in rewards.available()
    fn = rewards.get("short_answer")
    assert fn.reward("ok", {"max_chars": 3}) == 1.0
    assert fn.reward("far too long", {"max_chars": 3}) == 0.0
    assert fn.reward("anything", {}) is None


def test_unknown_reward_functions_name_the_available_ones() -> None:
    rewards._plugins.cache_clear()
    with pytest.raises(KeyError, match="exact_match"):
        rewards.get("no_such_function")


async def test_a_pool_can_use_a_plugin_reward_function(
    plugin_installed: None, app: Any, app_state: Any
) -> None:
    from tests.tasks_helpers import pool_setup
    from tests.verification_helpers import FixedDraw, submit, verdicts, verify_all

    app_state.rng = FixedDraw(1.0)
    async with pool_setup(app, app_state, workers=1, reward_function="short_answer") as s:
        await s.enqueue(
            [{"prompt": "Say hi briefly.", "sampling": {"max_tokens": 8}, "verification": {"max_chars": 20}}]
        )
        lease = (await s.workers[0].claim(s.pool_id)).json()["leases"][0]
        await submit(s.workers[0], lease, ["hi"])
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert v["category"] == "valid" and v["server_reward"] == 1.0


@pytest.mark.parametrize("value", ["float:nan", "float:inf", 1.5, -1, "yes", [1]])
async def test_a_reward_outside_zero_to_one_is_inconclusive_and_pays_nothing(
    plugin_installed: None, app: Any, app_state: Any, value: Any
) -> None:
    """A reward function returns a number in [0, 1] or None. A plugin that returns anything
    else (NaN, infinity, a number out of range, a string) is the operator's bug, not the
    worker's: the result is inconclusive (``reward_invalid``: no reward, no penalty). Before,
    any truthy value (NaN, -1, "yes") counted the sample correct and paid it, and a NaN made
    the verdict's JSON unstorable on PostgreSQL, so the job failed at every tick."""
    from tests.tasks_helpers import pool_setup
    from tests.verification_helpers import FixedDraw, submit, verdicts, verify_all

    app_state.rng = FixedDraw(1.0)
    async with pool_setup(
        app, app_state, workers=1, reward_function="broken", economics={"reward_per_sample": 7}
    ) as s:
        spec = {"value": value}
        await s.enqueue([{"prompt": "Anything.", "sampling": {"max_tokens": 8}, "verification": spec}])
        lease = (await s.workers[0].claim(s.pool_id)).json()["leases"][0]
        await submit(s.workers[0], lease, ["hi"], claimed_reward=None)
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["category"], v["reason"], v["reward_amount"]) == ("inconclusive", "reward_invalid", 0)
        assert "broken" in v["details"]["findings"][0]["detail"]


async def test_a_pool_whose_plugin_was_uninstalled_is_still_listed_and_names_it_on_change(
    plugin_installed: None, app: Any, app_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Views validated the stored reward function against the installed ones: once a pool's
    plugin was uninstalled, every listing of pools, the public one included, was a 500."""
    from tests.tasks_helpers import pool_setup

    async with pool_setup(app, app_state, reward_function="short_answer") as s:
        monkeypatch.setattr(rewards, "available", lambda: ["exact_match", "math"])  # uninstalled
        public = await s.admin.get("/v1/pools")
        assert public.status_code == 200, public.text
        assert [p["policy"]["reward_function"] for p in public.json()["items"]] == ["short_answer"]
        mine = await s.admin.get(f"/v1/admin/pools/{s.pool_id}", headers=s.headers)
        assert mine.status_code == 200 and mine.json()["policy"]["reward_function"] == "short_answer"
        r = await s.admin.patch(f"/v1/admin/pools/{s.pool_id}", json={"name": "renamed"}, headers=s.headers)
        assert r.status_code == 422 and "unknown reward function 'short_answer'" in r.json()["detail"]
        fixed = {"policy": {"reward_function": "exact_match"}}
        assert (
            await s.admin.patch(f"/v1/admin/pools/{s.pool_id}", json=fixed, headers=s.headers)
        ).status_code == 200


async def test_a_result_whose_scoring_process_is_killed_once_is_scored_again(
    plugin_installed: None, tmp_path: Path
) -> None:
    """A scoring process killed from outside (the kernel's OOM killer under memory pressure)
    made the result it was scoring inconclusive for good: an honest result, never paid. It is
    scored once more in a new process; only a result whose process dies twice is unscorable."""
    scorer = scoring.Scorer(timeout_s=60, purpose="test-deaths")
    once = tmp_path / "once"
    assert await scorer.score("dies", ["42"], {"marker": str(once), "deaths": 1}) == ([1.0], ["42"])
    assert once.read_text() == "x"

    always = tmp_path / "always"
    with pytest.raises(scoring.Unscorable, match="died 2 times"):
        await scorer.score("dies", ["42"], {"marker": str(always), "deaths": 5})
    assert always.read_text() == "xx"


async def test_a_reward_function_that_raises_makes_the_result_inconclusive(
    plugin_installed: None, app: Any, app_state: Any
) -> None:
    """A plugin that raises on some completion raised the same at every tick: the result was
    never decided (its node never paid or told, the task never completed, a ReST^EM iteration
    running for ever), and was scored again at every tick. Like a reward outside the contract,
    it is the operator's bug, not the worker's: inconclusive (``reward_invalid``), no penalty."""
    from tests.tasks_helpers import pool_setup
    from tests.verification_helpers import FixedDraw, submit, verdicts, verify_all

    app_state.rng = FixedDraw(1.0)
    econ = {"reward_per_sample": 7, "soft_invalid_penalty": 5}
    async with pool_setup(app, app_state, workers=1, reward_function="raises", economics=econ) as s:
        task = {"prompt": "What is 3 + 4?", "sampling": {"max_tokens": 8}, "verification": {"answer": "7"}}
        await s.enqueue([task, {**task, "prompt": "What is 4 + 3?"}])
        leases = (await s.workers[0].claim(s.pool_id, max_tasks=2)).json()["leases"]
        await submit(s.workers[0], leases[0], ["seven"])
        await submit(s.workers[0], leases[1], ["7"])
        await verify_all(app_state)
        vs = await verdicts(s.admin, s.headers, s.pool_id)
        assert sorted((v["category"], v["reason"], v["reward_amount"], v["slashed_amount"]) for v in vs) == [
            ("inconclusive", "reward_invalid", 0, 0),
            ("valid", "verified", 7, 0),
        ]
        [odd] = [v for v in vs if v["category"] == "inconclusive"]
        assert "'raises' raised IndexError" in odd["details"]["findings"][0]["detail"]


async def test_an_appeal_of_a_rejection_its_reward_function_could_not_score_pays_nothing(
    plugin_installed: None, app: Any, app_state: Any
) -> None:
    """A result the reward function failed on (``reward_invalid``) that the checks also reject
    (a finish reason they do not take: invalid) was never scored. Its appeal pays nothing, as
    an inconclusive verdict's; before, its samples, with no reward, counted as paid, and the
    appeal paid all three of them, the wrong answer too."""
    from tests.tasks_helpers import pool_setup
    from tests.verification_helpers import FixedDraw, answer_body, books_balance, submit, verdicts, verify_all

    app_state.rng = FixedDraw(1.0)
    async with pool_setup(
        app, app_state, workers=1, reward_function="raises", economics={"reward_per_sample": 7}
    ) as s:
        task = {
            "prompt": "What is 3 + 4?",
            "sampling": {"max_tokens": 8, "n": 3},
            "verification": {"answer": "7"},
        }
        await s.enqueue([task])
        [lease] = (await s.workers[0].claim(s.pool_id)).json()["leases"]
        samples = answer_body(lease, ["seven", "7", "8"])["samples"]
        samples[1]["finish_reason"] = "length"  # with fewer tokens than max_tokens
        await submit(s.workers[0], lease, ["seven", "7", "8"], samples=samples)
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["category"], v["reason"]) == ("invalid", "finish_reason"), v
        assert [f["code"] for f in v["details"]["findings"]] == ["finish_reason", "reward_invalid"]
        r = await s.admin.post(
            f"/v1/admin/verdicts/{v['id']}/reverse", json={"reason": "appeal"}, headers=s.admin_headers
        )
        assert r.status_code == 200, r.text
        assert r.json()["reward_paid_on_appeal"] == 0
        stats = (await s.admin.get(f"/v1/admin/pools/{s.pool_id}/stats", headers=s.headers)).json()
        assert stats["rewards_credited"] == 0
        await books_balance(app_state)


async def test_a_result_whose_reward_function_is_unavailable_is_tried_again_until_reward_retry_s(
    plugin_installed: None, app: Any, app_state: Any, tmp_path: Path
) -> None:
    """A reward function whose sandbox is down raises ``RewardUnavailable``: the result waits
    for a later tick (no verdict), and is paid once the sandbox is back. Before, any exception
    made it inconclusive at once, so an honest node lost its reward to the operator's outage.
    One still unavailable ``reward_retry_s`` (3600 s by default) after it arrived is
    inconclusive (``reward_unavailable``: no reward, no penalty)."""
    from tests.tasks_helpers import pool_setup
    from tests.verification_helpers import FixedDraw, submit, verdicts, verify_all

    app_state.rng = FixedDraw(1.0)
    assert app_state.settings.verifier.reward_retry_s == 3600
    down = tmp_path / "down"
    down.write_text("")
    econ = {"reward_per_sample": 7, "soft_invalid_penalty": 5}
    async with pool_setup(app, app_state, workers=1, reward_function="sandbox", economics=econ) as s:
        task = {
            "prompt": "print(7)",
            "sampling": {"max_tokens": 8},
            "verification": {"answer": "7", "down": str(down)},
        }
        await s.enqueue([task, {**task, "prompt": "print(3 + 4)"}])
        first, second = (await s.workers[0].claim(s.pool_id, max_tasks=2)).json()["leases"]
        await submit(s.workers[0], first, ["7"])
        await verify_all(app_state)
        await verify_all(app_state)
        assert await verdicts(s.admin, s.headers, s.pool_id) == []

        down.unlink()  # the sandbox is back, and the result's next try is due
        app_state.clock.advance(1)
        await verify_all(app_state)
        [paid] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (paid["category"], paid["reward_amount"]) == ("valid", 7)

        down.write_text("")  # down again, for longer than the operator allows
        await submit(s.workers[0], second, ["7"])
        await verify_all(app_state)
        assert len(await verdicts(s.admin, s.headers, s.pool_id)) == 1
        app_state.clock.advance(3600)
        await verify_all(app_state)
        vs = await verdicts(s.admin, s.headers, s.pool_id)
        assert len(vs) == 2
        [late] = [v for v in vs if v["id"] != paid["id"]]
        assert (late["category"], late["reason"], late["reward_amount"], late["slashed_amount"]) == (
            "inconclusive",
            "reward_unavailable",
            0,
            0,
        )
        assert "sandbox: connection refused" in late["details"]["findings"][0]["detail"]


async def test_results_whose_reward_function_is_down_do_not_hold_up_the_results_after_them(
    plugin_installed: None, app: Any, app_state: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outage with a backlog: more results wait on a sandbox that is down than a tick's
    budget gets through (here each batch takes a second of a 1.5 s budget: two batches of two).
    A tick goes on from where the last one stopped, so the result after them, whose reward
    function answers, is decided within a pass over the backlog, and each waiting result is
    tried again once a pass. Before, every tick started again at the oldest result: it tried the
    same four stuck results again and again, and nothing behind them was decided, in any pool,
    until they ran out of ``reward_retry_s`` (an hour), for as long as the outage lasted."""
    from orchestrator.settings import VerifierSettings
    from orchestrator.verification import service
    from orchestrator.verification.jobs import verify_once
    from tests.tasks_helpers import pool_setup
    from tests.verification_helpers import FixedDraw, submit, verdicts

    app_state.rng = FixedDraw(1.0)
    app_state.settings.verifier = VerifierSettings(batch_size=2, tick_budget_s=1.5)
    real = service.process_pending

    async def taking_a_second(*args: Any, **kwargs: Any) -> Any:
        batch = await real(*args, **kwargs)
        app_state.clock.advance(1)  # the sandbox's connect timeout, say
        return batch

    monkeypatch.setattr(service, "process_pending", taking_a_second)
    down = tmp_path / "down"
    down.write_text("")
    async with pool_setup(app, app_state, workers=1, reward_function="sandbox", max_leases_per_node=8) as s:
        stuck = {"prompt": "print(7)", "sampling": {"max_tokens": 8}}
        await s.enqueue(
            [{**stuck, "verification": {"answer": "7", "down": str(down)}} for _ in range(6)]
            + [{**stuck, "verification": {"answer": "7", "down": str(tmp_path / "up")}}]
        )
        leases = (await s.workers[0].claim(s.pool_id, max_tasks=7)).json()["leases"]
        assert len(leases) == 7
        for lease in leases:  # in the order enqueued: the answered one is the newest result
            await submit(s.workers[0], lease, ["7"])
        for _ in range(4):
            await verify_once(app_state)
        decided = await verdicts(s.admin, s.headers, s.pool_id)
        assert [v["category"] for v in decided] == ["valid"], decided


async def test_a_result_whose_reward_function_is_unavailable_is_tried_again_less_and_less_often(
    plugin_installed: None, app: Any, app_state: Any, tmp_path: Path
) -> None:
    """While a reward function's service is down, each waiting result is tried again 1 s after
    the first try, then 2 s, 4 s ... (at most a minute) later, not at every pass of the verifier
    (every second, or back to back while the backlog lasts), which called the service for every
    waiting result as fast as the verifier went."""
    from tests.tasks_helpers import pool_setup
    from tests.verification_helpers import FixedDraw, submit, verdicts, verify_all

    app_state.rng = FixedDraw(1.0)
    down, calls = tmp_path / "down", tmp_path / "calls"
    down.write_text("")
    spec = {"answer": "7", "down": str(down), "calls": str(calls)}
    async with pool_setup(app, app_state, workers=1, reward_function="sandbox") as s:
        await s.enqueue([{"prompt": "print(7)", "sampling": {"max_tokens": 8}, "verification": spec}])
        [lease] = (await s.workers[0].claim(s.pool_id)).json()["leases"]
        await submit(s.workers[0], lease, ["7"])

        def tried() -> int:
            return len(calls.read_text()) if calls.exists() else 0

        seen = []
        for _ in range(8):  # 4 s, a pass every half second
            await verify_all(app_state)
            seen.append(tried())
            app_state.clock.advance(0.5)
        # Tries at 0 s, 1 s and 3 s (the next at 7 s): 3 in these 4 s, where a try a pass made 8.
        assert seen == [1, 1, 2, 2, 2, 2, 3, 3], seen
        assert await verdicts(s.admin, s.headers, s.pool_id) == []

        down.unlink()
        app_state.clock.advance(4)
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert v["category"] == "valid"
        assert app_state.reward_backoff == {}


async def test_a_result_scored_in_part_pays_its_right_and_unscored_samples_not_its_wrong_ones(
    plugin_installed: None, app: Any, app_state: Any
) -> None:
    """A sample is paid when its reward is above 0 or when the reward function had nothing to
    check it against (null). One null among the samples made the whole result unchecked, and
    every sample was paid, the wrong ones too."""
    from tests.tasks_helpers import pool_setup
    from tests.verification_helpers import FixedDraw, submit, verdicts, verify_all

    app_state.rng = FixedDraw(1.0)
    async with pool_setup(
        app, app_state, workers=1, reward_function="partial", economics={"reward_per_sample": 7}
    ) as s:
        task = {
            "prompt": "What is 2 + 2?",
            "sampling": {"max_tokens": 8, "n": 3},
            "verification": {"answer": 4},
        }
        await s.enqueue([task])
        lease = (await s.workers[0].claim(s.pool_id)).json()["leases"][0]
        await submit(s.workers[0], lease, ["4", "5", "? no idea"], claimed_reward=None)
        await verify_all(app_state)
        [v] = await verdicts(s.admin, s.headers, s.pool_id)
        assert (v["category"], v["reward_amount"]) == ("valid", 2 * 7), v
