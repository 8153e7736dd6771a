"""py-spy profiles of the server during a phase, and a summary of their top frames.

``py-spy record -f raw`` writes collapsed stacks: one line per distinct stack,
``frame;frame;...;frame count``, each frame ``function (file:line)``. The summary gives, per
function (lines merged), its *self* share (the leaf of the stack) and its *inclusive* share
(anywhere in the stack), over all samples.
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def py_spy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def start(
    pid: int, seconds: float, out: Path, *, subprocesses: bool, rate: int = 200
) -> subprocess.Popen[bytes] | None:
    exe = py_spy()
    if exe is None:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        exe,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(max(1, int(seconds))),
        "--rate",
        str(rate),
        "--format",
        "raw",
        "--output",
        str(out),
        "--nonblocking",
    ]
    if subprocesses:
        cmd.append("--subprocesses")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _short(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = m.group("file")
    for marker in ("site-packages/", "/work/main/", "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{m.group('func')} ({path})"


def summarise(path: Path, top: int = 15) -> dict[str, Any]:
    """Top frames of a raw py-spy profile.

    ``self_pct``: leaf frames (where the CPU was spent). ``inclusive_pct``: frames anywhere in the
    stack, leaving out the wrappers present in nearly every sample (the event loop, uvicorn,
    the middleware chain), which say nothing about where a request's time goes. SQLAlchemy's
    async bridge runs statements in greenlets, whose stacks py-spy shows without the request
    frames above them: ORM work appears under ``Session.execute`` / ``Session.flush`` roots."""
    self_counts: collections.Counter[str] = collections.Counter()
    incl_counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        count = int(count_s)
        frames = [_short(f) for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += count
        self_counts[frames[-1]] += count
        for frame in set(frames):
            incl_counts[frame] += count

    def share(counter: collections.Counter[str]) -> list[tuple[str, float]]:
        if not total:
            return []
        return [(name, round(100 * n / total, 1)) for name, n in counter.most_common(top)]

    wrapper_paths = ("uvicorn/", "starlette/", "asyncio/", "typer/", "<frozen runpy>", "orchestrator/cli.py")
    wrapper_names = (
        "FastAPI.__call__",
        "APIRoute",
        "APIRouter",
        "_IncludedRouter",
        "request_response",
        "get_request_handler",
        "Middleware.__call__",
        "AsyncExitStack",
        "wrap_app_handling",
    )

    def is_wrapper(name: str) -> bool:
        # Present in (almost) every sample; says nothing about where a request's time goes.
        return any(p in name for p in wrapper_paths) or any(
            name.startswith(n) or n in name for n in wrapper_names
        )

    def share_inclusive() -> list[tuple[str, float]]:
        if not total:
            return []
        ranked = [
            (name, round(100 * n / total, 1)) for name, n in incl_counts.most_common() if not is_wrapper(name)
        ]
        return ranked[:top]

    return {"samples": total, "self_pct": share(self_counts), "inclusive_pct": share_inclusive()}


def render(name: str, summary: dict[str, Any]) -> str:
    lines = [f"profile {name}: {summary['samples']} samples"]
    lines.append("  self %  function")
    lines += [f"  {pct:6.1f}  {fn}" for fn, pct in summary["self_pct"]]
    lines.append("  incl %  function")
    lines += [f"  {pct:6.1f}  {fn}" for fn, pct in summary["inclusive_pct"]]
    return "\n".join(lines)
