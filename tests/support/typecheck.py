"""mypy as an application's CI runs it, for the tests of what a user's mypy sees.

Every such test shares one incremental cache per virtualenv (in the venv, so that another
Python's site-packages never meet it), kept between runs: without a cache each run reads
celery, redis and kombu again, 20 s of CPU. mypy checks each cached module against its
source (hashes), so an edit of the package is seen, and it writes each cache file whole
(temporary file, then rename), so tests on two xdist workers may share it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MYPY_CACHE = Path(sys.prefix) / "mypy-test-cache"
MYPY_TIMEOUT = 300.0  # seconds: mypy with a cold cache on a busy machine


def mypy_strict(target: Path) -> subprocess.CompletedProcess[str]:
    """``mypy --strict`` of ``target``, run from its folder (no project configuration)."""
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(MYPY_CACHE), target.name],
        cwd=target.parent,
        capture_output=True,
        text=True,
        timeout=MYPY_TIMEOUT,
        check=False,
    )
