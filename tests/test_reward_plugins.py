"""Reward functions from plugins: an installed package's entry point in ``orchestrator.rewards``."""

from __future__ import annotations

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


@pytest.fixture
def plugin_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A package that declares ``short_answer`` in ``orchestrator.rewards``, installed on the
    path (a ``.dist-info`` with its entry points), where the scoring processes find it too."""
    info = tmp_path / "short_answer_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: short-answer-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{rewards.ENTRY_POINT_GROUP}]\nshort_answer = {__name__}:ShortAnswer\n"
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
