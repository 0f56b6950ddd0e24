"""Which source tree a bench line came from: the commit, marked when the tracked files differ from it.

A copy of the working tree may travel without the git folder that matches it (the folder there
names an older commit); the mark says so, so that a line is never credited to a commit whose code
did not run.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The short commit of HEAD, with "+changes" when tracked files differ from it; "unknown"
    outside a git checkout."""
    try:
        head = _git("rev-parse", "--short", "HEAD")
        changed = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+changes" if changed else head


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
