"""``orchestrator demo``: the swarm with a live rich table and a closing summary."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table

from orchestrator.core.console import wide_console
from orchestrator.demo.behaviours import KINDS
from orchestrator.demo.swarm import DemoConfig, run_demo

console = wide_console()


def _table(summary: dict[str, Any]) -> Group:
    head = Table.grid(padding=(0, 2))
    tasks = summary["tasks"]
    head.add_row(
        f"[b]{summary['elapsed_s']:.0f} s[/b]",
        f"tasks {tasks.get('completed', 0)}/{tasks['total']} done",
        f"verdicts {summary['verdicts']} (accepted {summary['accepted']})",
        f"rewards paid {summary['rewards_paid']}",
        f"stake slashed {summary['stake_slashed']}",
    )
    t = Table(title="workers by kind", expand=False)
    for col in (
        "kind",
        "nodes",
        "submitted",
        "accepted",
        "rejected",
        "refused",
        "earned",
        "slashed",
        "ejected",
        "caught",
    ):
        t.add_column(col, justify="left" if col in {"kind", "rejected", "refused"} else "right")
    for kind, k in summary["kinds"].items():
        caught = {None: "-", True: "[green]yes[/green]", False: "[red]no[/red]"}[k["caught"]]
        t.add_row(
            kind,
            str(k["nodes"]),
            str(k["submitted"]),
            str(k["accepted"]),
            ", ".join(f"{r} {n}" for r, n in k["rejected"].items()) or "-",
            ", ".join(f"{r} {n}" for r, n in k["refused"].items()) or "-",
            str(k["rewards"]),
            str(k["slashed"]),
            str(k["ejected"]),
            caught,
        )
    return Group(head, t)


def _verdict_lines(summary: dict[str, Any]) -> list[str]:
    kinds = summary["kinds"]
    ejections = [
        f"{kind} at its fraud strike {n} ({k['fraud_verdicts']} fraud verdicts in all)"
        for kind, k in kinds.items()
        for n in k["frauds_before_ejection"]
    ]
    return [
        f"tasks done: {summary['tasks'].get('completed', 0)} of {summary['tasks']['total']}",
        f"accepted: {summary['accepted']}; rejected by reason: {summary['rejected_by_reason']}",
        f"rewards paid: {summary['rewards_paid']}; stake slashed: {summary['stake_slashed']}",
        f"cheaters ejected: {summary['cheaters_ejected']} ({', '.join(ejections) or 'none'})",
        f"honest nodes slashed: {summary['honest_nodes_slashed']} (must be 0)",
        f"fraudulent submissions paid: {summary['fraudulent_submissions_paid']} (must be 0)",
        f"dishonest kinds caught: {sum(bool(k['caught']) for n, k in kinds.items() if n != 'honest')} "
        f"of {sum(1 for n in kinds if n != 'honest')}",
        f"ledger sum: {summary['ledger_sum']} (always 0)",
        f"trainer feed: {summary['trainer_feed']['rollouts']} rollouts, only accepted ones: "
        f"{summary['trainer_feed']['only_accepted']}",
    ]


def demo(
    duration: Annotated[float, typer.Option(help="Seconds to run at most")] = 45.0,
    honest: Annotated[int, typer.Option(help="Honest workers")] = 6,
    dishonest: Annotated[
        int, typer.Option(help=f"Dishonest workers, cycling through: {', '.join(KINDS)}")
    ] = len(KINDS),
    seed: Annotated[int, typer.Option(help="Seed of the problems and the workers' choices")] = 7,
    tasks: Annotated[int, typer.Option(help="Arithmetic problems to enqueue")] = 150,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write the summary here as JSON")
    ] = None,
) -> None:
    """Run a coordinator with honest workers and cheaters on the embedded default, and show
    what is caught. Needs no setup: the database is a temporary SQLite file."""
    config = DemoConfig(duration_s=duration, honest=honest, dishonest=dishonest, seed=seed, tasks=tasks)
    with Live(console=console, refresh_per_second=2) as live:
        summary = asyncio.run(run_demo(config, on_update=lambda s: live.update(_table(s))))
        live.update(_table(summary))
    console.print("\n[b]Summary[/b]")
    for line in _verdict_lines(summary):
        console.print(f"  {line}")
    if json_path is not None:
        json_path.write_text(json.dumps(summary, indent=2, default=str))
        console.print(f"summary written to {json_path}")
