"""Flower's configuration in the container image: basic auth from a secret file.

``celery -A merchant_tasks flower --conf=/app/flowerconfig.py`` executes this file. Each
non-empty line of FLOWER_BASIC_AUTH_FILE (default /run/secrets/flower_basic_auth) is one
``user:password``; with basic auth set, Flower's pages and its HTTP API both ask for it.
A missing, empty or malformed file stops Flower with one line: it never starts open.
"""

import os
import sys
from pathlib import Path

_path = Path(os.environ.get("FLOWER_BASIC_AUTH_FILE", "/run/secrets/flower_basic_auth"))
try:
    _lines = _path.read_text(encoding="utf-8").splitlines()
except OSError as _exc:
    sys.exit(f"error: FLOWER_BASIC_AUTH_FILE: cannot read {_path} ({_exc.strerror})")
basic_auth = [line.strip() for line in _lines if line.strip()]
if not basic_auth or not all(":" in pair and pair.split(":", 1)[1] for pair in basic_auth):
    sys.exit(f"error: FLOWER_BASIC_AUTH_FILE: {_path} must hold user:password lines")
