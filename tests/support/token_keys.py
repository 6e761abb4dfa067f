"""Token key files (tokens sealed at rest, MERCHANT_TOKEN_KEY_FILE) as an operator makes them."""

from __future__ import annotations

import base64
import os
from pathlib import Path


def token_key_file(path: Path) -> Path:
    """A token key file as an operator makes one: 32 random bytes, URL-safe base64, 0600."""
    path.write_text(base64.urlsafe_b64encode(os.urandom(32)).decode() + "\n")
    path.chmod(0o600)
    return path
