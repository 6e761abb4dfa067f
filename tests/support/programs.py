"""Running a Python program to its end, as a user would from a shell, to read what it
printed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def run_python(
    *args: str,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python *args`` with this interpreter, run to its end: its exit status and its
    output as text (a nonzero exit is the caller's to judge)."""
    argv = [sys.executable, *args]  # a failure is an exit status to read, not an error
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
