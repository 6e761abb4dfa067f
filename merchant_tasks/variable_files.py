"""Files named by ``*_FILE`` variables (the secret, token keys, URLs, accounts): read here
only, so every failure names the variable and the path, never the file's content."""

from __future__ import annotations

import stat
from pathlib import Path

from merchant_tasks.exceptions import ConfigurationError


def read_file(variable: str, path: Path | str) -> bytes:
    """The bytes of the file ``variable`` names; an unreadable one is a ConfigurationError."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise _unreadable(variable, path, exc) from None


def read_text_file(variable: str, path: Path | str) -> str:
    """The stripped text of the file ``variable`` names; an unreadable, non-UTF-8 or empty
    file is a ConfigurationError."""
    try:
        text = read_file(variable, path).decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigurationError(f"{variable}: {path} is not UTF-8 text") from None
    if not text:
        raise ConfigurationError(f"{variable}: {path} is empty")
    return text


def permission_bits(variable: str, path: Path | str) -> int:
    """The file's permission bits, for checking who else may read it."""
    try:
        return stat.S_IMODE(Path(path).stat().st_mode)
    except OSError as exc:
        raise _unreadable(variable, path, exc) from None


def _unreadable(variable: str, path: Path | str, exc: OSError) -> ConfigurationError:
    return ConfigurationError(f"{variable}: cannot read {path} ({exc.strerror})")
