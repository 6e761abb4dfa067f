"""Tokens sealed at rest (store/sealing.py): AES-GCM with the namespace as associated data,
key rotation, key files checked and warned about, the extra named when it is missing."""

from __future__ import annotations

import base64
import os
import re
import sys
import warnings
from pathlib import Path

import pytest

from merchant_tasks.exceptions import ConfigurationError, TokenUnreadable
from merchant_tasks.settings import Settings
from merchant_tasks.store.sealing import (
    PLAIN_TEXT,
    SEALED_PREFIX,
    KeyFileReadableByOthers,
    Sealer,
    codec_for,
)
from support.leaks import shows
from support.token_keys import token_key_file

NAMESPACE = "mt-test:sandbox:app"


def test_a_sealed_value_opens_with_its_key_and_namespace_only(
    tmp_path: Path, key_file: Path
) -> None:
    sealer = Sealer.from_files(str(key_file))
    sealed = sealer.seal("live-token", NAMESPACE)
    assert sealed.startswith(SEALED_PREFIX)
    assert not shows("live-token", sealed.encode())
    assert sealer.seal("live-token", NAMESPACE) != sealed  # a fresh nonce every time
    assert sealer.open(sealed, NAMESPACE) == "live-token"
    with pytest.raises(TokenUnreadable, match="MERCHANT_TOKEN_KEY_FILE"):
        sealer.open(sealed, "mt-test:sandbox:another-app")  # copied to another account
    other = Sealer.from_files(str(token_key_file(tmp_path / "other")))
    with pytest.raises(TokenUnreadable, match="MERCHANT_TOKEN_KEY_FILE") as caught:
        other.open(sealed, NAMESPACE)
    assert "live-token" not in str(caught.value)
    with pytest.raises(TokenUnreadable):
        sealer.open(SEALED_PREFIX + "not base64!", NAMESPACE)


def test_during_a_rotation_the_previous_key_still_opens_and_the_new_one_seals(
    tmp_path: Path, key_file: Path
) -> None:
    old = Sealer.from_files(str(key_file))
    sealed_before = old.seal("old-token", NAMESPACE)
    new_key = token_key_file(tmp_path / "new")
    rotating = Sealer.from_files(str(new_key), str(key_file))
    assert rotating.open(sealed_before, NAMESPACE) == "old-token"
    sealed_after = rotating.seal("new-token", NAMESPACE)
    assert Sealer.from_files(str(new_key)).open(sealed_after, NAMESPACE) == "new-token"
    with pytest.raises(TokenUnreadable):
        old.open(sealed_after, NAMESPACE)


def test_a_value_stored_in_clear_is_refused_by_a_sealer_and_a_sealed_one_without_key(
    key_file: Path,
) -> None:
    sealer = Sealer.from_files(str(key_file))
    with pytest.raises(ValueError, match="in clear"):  # the store reads it as absent
        sealer.open("clear-token", NAMESPACE)
    with pytest.raises(TokenUnreadable, match="set MERCHANT_TOKEN_KEY_FILE"):
        PLAIN_TEXT.open(sealer.seal("t", NAMESPACE), NAMESPACE)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("too-short", "32 random bytes as base64"),
        (base64.urlsafe_b64encode(b"x" * 16).decode(), "32 random bytes"),
        ("", "32 random bytes"),
    ],
)
def test_a_bad_key_file_is_a_configuration_error_naming_the_variable(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "key"
    path.write_text(content)
    with pytest.raises(ConfigurationError, match=f"MERCHANT_TOKEN_KEY_FILE: .*{message}"):
        codec_for(str(path))
    with pytest.raises(ConfigurationError, match="MERCHANT_TOKEN_KEY_FILE: cannot read"):
        codec_for(str(tmp_path / "missing"))
    with pytest.raises(ConfigurationError, match="MERCHANT_TOKEN_KEY_PREVIOUS_FILE"):
        codec_for(None, str(path))


@pytest.mark.parametrize(
    "content",
    [
        os.urandom(32),  # the raw key, not base64: not even UTF-8
        base64.urlsafe_b64encode(os.urandom(32)) + b"\njunk\n",  # a line after the key
        base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"="),  # padding cut off
        b"*" + base64.urlsafe_b64encode(os.urandom(32))[1:],  # a character outside base64
    ],
    ids=["raw-bytes", "trailing-line", "no-padding", "bad-character"],
)
def test_a_key_file_not_strictly_base64_of_32_bytes_is_an_error_naming_the_variable(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(ConfigurationError, match=r"MERCHANT_TOKEN_KEY_FILE: .*nothing else"):
        codec_for(str(path))


def test_a_key_in_the_standard_base64_alphabet_is_accepted_too(tmp_path: Path) -> None:
    key = os.urandom(32)
    path = tmp_path / "key"
    path.write_text(base64.b64encode(key).decode() + "\n")
    path.chmod(0o600)
    sealed = Sealer(key).seal("tok", NAMESPACE)
    assert codec_for(str(path)).open(sealed, NAMESPACE) == "tok"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_key_file_others_may_read_is_warned_about_naming_the_file_and_the_fix(
    key_file: Path, mode: int
) -> None:
    key_file.chmod(mode)
    expected = (
        f"MERCHANT_TOKEN_KEY_FILE: {key_file} may be read by group or others "
        f"(mode {mode:03o}): run chmod 600 {key_file}"
    )
    with pytest.warns(KeyFileReadableByOthers, match=re.escape(expected)):
        Settings.from_env(
            {
                "MERCHANT_API_KEY": "k",
                "MERCHANT_API_SECRET": "s",
                "MERCHANT_TOKEN_KEY_FILE": str(key_file),
            }
        )


def test_a_key_file_only_its_owner_reads_raises_no_warning(key_file: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        codec_for(str(key_file))


def test_without_the_cryptography_package_the_error_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, key_file: Path
) -> None:
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    with pytest.raises(ConfigurationError, match=r"merchant-tasks\[encryption\]"):
        codec_for(str(key_file))


def test_settings_take_the_key_files_and_check_them_at_start_up(
    merchant_secret_file: Path, key_file: Path, tmp_path: Path
) -> None:
    env = {
        "MERCHANT_API_KEY": "k",
        "MERCHANT_API_SECRET_FILE": str(merchant_secret_file),
        "MERCHANT_TOKEN_KEY_FILE": str(key_file),
    }
    settings = Settings.from_env(env)
    assert settings.fleet.token_key_file == str(key_file)
    assert settings.fleet.token_key_previous_file is None
    assert key_file.read_text().strip() not in repr(settings)
    assert Settings.from_env({**env, "MERCHANT_TOKEN_KEY_FILE": ""}).fleet.token_key_file is None
    bad = tmp_path / "bad-key"
    bad.write_text("nope")
    with pytest.raises(ConfigurationError, match="MERCHANT_TOKEN_KEY_FILE"):
        Settings.from_env({**env, "MERCHANT_TOKEN_KEY_FILE": str(bad)})
