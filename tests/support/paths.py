"""Where things are, for tests that read the repository or start a program by path."""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # this folder: the programs tests start by path
ROOT = SUPPORT.parents[1]  # the repository
README = ROOT / "README.md"
