"""Rich consoles for the commands' tables."""

from __future__ import annotations

import os
import sys
from typing import TextIO

from rich.console import Console


def wide_console(file: TextIO | None = None) -> Console:
    """A console for a table: written to a file or a pipe, rich would assume 80 columns and
    cut or fold every cell, so it gets 160 there unless ``COLUMNS`` says otherwise."""
    out = file or sys.stdout
    sized = out.isatty() or "COLUMNS" in os.environ
    return Console(file=file, width=None if sized else 160)
