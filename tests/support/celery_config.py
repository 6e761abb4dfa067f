"""A ``celeryconfig.py`` of the test's own, first on the path: what the Celery app reads."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path


def write_celeryconfig(directory: Path, text: str) -> None:
    (directory / "celeryconfig.py").write_text(text)
    sys.modules.pop("celeryconfig", None)
    importlib.invalidate_caches()  # the directory was listed before the file existed
