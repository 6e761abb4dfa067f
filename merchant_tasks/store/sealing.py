"""Tokens sealed at rest: the stored token value encrypted with AES-GCM (optional).

Redis snapshots, AOF files and replicas would otherwise hold the live token in clear. With
MERCHANT_TOKEN_KEY_FILE set (a file only its owner may read, holding 32 random bytes as
base64, e.g. ``(umask 077; python -c "import base64, os;
print(base64.urlsafe_b64encode(os.urandom(32)).decode())" > token.key)``)
the token store keeps only the value sealed, as ``sealed:v1:<base64 of nonce and
ciphertext>``, with the account's namespace as associated data: a sealed value copied to
another account's key does not open. The token's times stay readable, so beat's due
check and ``status`` need no key. MERCHANT_TOKEN_KEY_PREVIOUS_FILE names the key being
rotated out: values sealed with it still open, new ones are sealed with the current key.

A process that cannot open the stored value (no key, or another key) raises
``TokenUnreadable`` naming MERCHANT_TOKEN_KEY_FILE before any exchange: renewing over the
token would make hosts with different keys overwrite each other's tokens in a loop. A value
stored in clear where a key is configured (before sealing was turned on, or written by
someone else) is not trusted: it reads as absent (``ValueError``, see
``store.token_store``), and the next renewal stores a sealed token over it.

AES-GCM comes from the ``cryptography`` package, the ``encryption`` extra:
``pip install 'merchant-tasks[encryption]'``.
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
import warnings
from typing import Any, Protocol

from merchant_tasks.exceptions import ConfigurationError, TokenUnreadable
from merchant_tasks.variable_files import permission_bits, read_file

SEALED_PREFIX = "sealed:v1:"  # marks a sealed value; v1 = AES-256-GCM, 12-byte random nonce
KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12  # GCM's standard nonce; random, far below the 2**32 seals a key allows
KEY_VARIABLE = "MERCHANT_TOKEN_KEY_FILE"
PREVIOUS_KEY_VARIABLE = "MERCHANT_TOKEN_KEY_PREVIOUS_FILE"
KEY_FILE_PRIVATE = 0o077  # permission bits of group and others: a key file has none


class TokenCodec(Protocol):
    """How the token value is kept in the store: ``seal`` before writing, ``open`` after
    reading, both for one account's namespace."""

    def seal(self, value: str, namespace: str) -> str: ...

    def open(self, stored: str, namespace: str) -> str: ...


class PlainText:
    """No key: values are stored as they are; a sealed value is an error, never renewed over."""

    def seal(self, value: str, namespace: str) -> str:
        return value

    def open(self, stored: str, namespace: str) -> str:
        if stored.startswith(SEALED_PREFIX):
            raise TokenUnreadable(
                f"the stored token of {namespace} is sealed, and this process has no key: "
                f"set {KEY_VARIABLE} to the fleet's token key"
            )
        return stored

    def __repr__(self) -> str:
        return "PlainText()"


PLAIN_TEXT = PlainText()


class Sealer:
    """AES-GCM with the current key (and, while rotating, the previous one for opening)."""

    def __init__(self, key: bytes, previous: bytes | None = None) -> None:
        aead, self._invalid = _aesgcm()
        self._current = aead(key)
        self._openers = [self._current] + ([aead(previous)] if previous is not None else [])

    @classmethod
    def from_files(cls, key_file: str, previous_file: str | None = None) -> Sealer:
        previous = read_key(PREVIOUS_KEY_VARIABLE, previous_file) if previous_file else None
        return cls(read_key(KEY_VARIABLE, key_file), previous)

    def seal(self, value: str, namespace: str) -> str:
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._current.encrypt(nonce, value.encode(), namespace.encode())
        return SEALED_PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode()

    def open(self, stored: str, namespace: str) -> str:
        if not stored.startswith(SEALED_PREFIX):
            raise ValueError("a token stored in clear where tokens are sealed")
        try:
            blob = base64.urlsafe_b64decode(stored[len(SEALED_PREFIX) :])
        except (binascii.Error, ValueError):
            blob = b""
        nonce, sealed = blob[:NONCE_BYTES], blob[NONCE_BYTES:]
        for opener in self._openers:
            try:
                return str(opener.decrypt(nonce, sealed, namespace.encode()).decode())
            except (self._invalid, ValueError):  # another key, or a malformed value
                continue
        raise TokenUnreadable(
            f"the stored token of {namespace} was sealed with another key: set "
            f"{KEY_VARIABLE} (or {PREVIOUS_KEY_VARIABLE} while rotating) to the key the "
            "rest of the fleet uses"
        )

    def __repr__(self) -> str:
        return "Sealer(<keys hidden>)"

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("a Sealer is not serialisable: its key must not leave the process")


def codec_for(key_file: str | None, previous_file: str | None = None) -> TokenCodec:
    """The codec the settings ask for: a Sealer with a key file, else PLAIN_TEXT."""
    if key_file:
        return Sealer.from_files(key_file, previous_file)
    if previous_file:
        raise ConfigurationError(
            f"{PREVIOUS_KEY_VARIABLE} is set without {KEY_VARIABLE}: the previous key only "
            "opens tokens while the current one seals them"
        )
    return PLAIN_TEXT


def read_key(variable: str, path: str) -> bytes:
    """The 32-byte key in ``path`` (base64, strictly: nothing else in the file); the
    message never shows the file's content. A file others may read is warned about."""
    data = read_file(variable, path).strip()
    mode = permission_bits(variable, path)
    try:
        key = base64.b64decode(data, altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise ConfigurationError(
            f"{variable}: {path} must hold {KEY_BYTES} random bytes as base64, and nothing else"
        )
    if mode & KEY_FILE_PRIVATE:
        _warn_open_key_file(variable, path, mode)
    return key


class KeyFileReadableByOthers(UserWarning):
    """A token key file whose mode lets group or others read it."""


@functools.cache
def _warn_open_key_file(variable: str, path: str, mode: int) -> None:
    """Once per file and mode in a process, at start: a warning reaches stderr whatever
    the logging set-up (the package logs to a NullHandler unless the application says)."""
    warnings.warn(
        f"{variable}: {path} may be read by group or others (mode {mode:03o}): "
        f"run chmod 600 {path}",
        KeyFileReadableByOthers,
        stacklevel=2,
    )


def _aesgcm() -> tuple[Any, type[Exception]]:
    """cryptography's AESGCM and the error it raises for a value it cannot open."""
    try:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise ConfigurationError(
            f"{KEY_VARIABLE} needs the 'cryptography' package: "
            "pip install 'merchant-tasks[encryption]'"
        ) from None
    return AESGCM, InvalidTag
