"""Tokens sealed at rest: AES-GCM with the namespace as associated data, key rotation, and a
process with another key that fails clearly instead of renewing over the fleet's token."""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import stat
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from conftest import make_manager, shows
from merchant_tasks.accounts import client_for
from merchant_tasks.exceptions import ConfigurationError, TokenUnreadable
from merchant_tasks.renewal.lock import LOCAL_COPY_TTL
from merchant_tasks.sandbox.pytest_plugin import MerchantSandbox
from merchant_tasks.settings import Settings
from merchant_tasks.store.sealing import (
    PLAIN_TEXT,
    SEALED_PREFIX,
    KeyFileReadableByOthers,
    Sealer,
    codec_for,
)
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.token import IssuedToken, RenewalReason, Token

PING = "/open-api/v1/ping"
NAMESPACE = "mt-test:sandbox:app"


def _key_file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_text(base64.urlsafe_b64encode(os.urandom(32)).decode() + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    return _key_file(tmp_path, "token-key")


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
    other = Sealer.from_files(str(_key_file(tmp_path, "other")))
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
    new_key = _key_file(tmp_path, "new")
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


def test_the_key_file_warning_reaches_the_stderr_of_a_command(key_file: Path) -> None:
    key_file.chmod(0o644)
    done = subprocess.run(
        [sys.executable, "-m", "merchant_tasks.ops.cli", "status"],
        env={
            "PATH": os.environ.get("PATH", ""),
            "MERCHANT_API_KEY": "k",
            "MERCHANT_API_SECRET": "s",
            "MERCHANT_REDIS_URL": "redis://127.0.0.1:1/0",
            "MERCHANT_TOKEN_KEY_FILE": str(key_file),
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert f"may be read by group or others (mode 644): run chmod 600 {key_file}" in done.stderr


def test_the_documented_key_command_makes_a_valid_key_only_its_owner_reads(tmp_path: Path) -> None:
    page = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text(encoding="utf-8")
    [command] = re.findall(r"^ *(\(umask 077; python -c .*? > token\.key\))$", page, re.M)
    command = command.replace("python -c", f"{shlex.quote(sys.executable)} -c")
    subprocess.run(["bash", "-c", command], cwd=tmp_path, check=True, env={"PATH": "/usr/bin:/bin"})
    key_file = tmp_path / "token.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert isinstance(codec_for(str(key_file)), Sealer)


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


def test_the_store_keeps_the_value_sealed_and_the_times_readable(
    redis_client: redis.Redis, merchant_key_prefix: str, key_file: Path
) -> None:
    namespace = f"{merchant_key_prefix}:sandbox:app"
    store = TokenStore(redis_client, namespace, Sealer.from_files(str(key_file)))
    token = Token("live-token-value", 1000.0, 2e10, 1, "me", RenewalReason.MANUAL)
    assert store.save(token) == (True, 1)
    raw = redis_client.get(store.keys.token)
    assert isinstance(raw, bytes)
    assert not shows("live-token-value", raw)
    assert json.loads(raw)["expires_at"] == 2e10  # beat's due check needs no key
    assert store.load() == token
    with pytest.raises(TokenUnreadable):
        TokenStore(redis_client, namespace).load()


def test_a_clear_token_where_tokens_are_sealed_reads_as_absent_and_is_renewed_sealed(
    redis_client: redis.Redis,
    merchant_key_prefix: str,
    key_file: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Someone wrote a token in clear into a sealed fleet's key: it is not trusted (it
    could be anyone's), it is renewed over, and the new value is sealed."""
    namespace = f"{merchant_key_prefix}:sandbox:app"
    store = TokenStore(redis_client, namespace, Sealer.from_files(str(key_file)))
    planted = Token("planted-clear-token", 1000.0, 2e10, 1, "someone", RenewalReason.MANUAL)
    assert TokenStore(redis_client, namespace).save(planted) == (True, 1)
    assert store.load() is None
    assert store.load() is None
    assert caplog.text.count(f"{namespace}:token holds what merchant-tasks never writes") == 1
    successor = IssuedToken("sealed-successor", 3600.0)
    manager = make_manager(
        store, lambda: successor, exchange_timeout=1.0, local_copy_ttl=LOCAL_COPY_TTL
    )
    assert manager.token().value == "sealed-successor"
    raw = redis_client.get(store.keys.token)
    assert isinstance(raw, bytes)
    assert not shows("sealed-successor", raw)


# -- two processes, two keys ---------------------------------------------------------------

_OTHER_PROCESS = """
import json
from merchant_tasks.accounts import client_for, client_from_env
from merchant_tasks.exceptions import MerchantError
client = client_from_env()
outcomes = []
for attempt in (lambda: client.request("GET", "/open-api/v1/ping"), client.manager.renew,
                lambda: client.manager.renew(force=True)):
    try:
        attempt()
        outcomes.append(["ok", ""])
    except MerchantError as exc:
        outcomes.append([type(exc).__name__, str(exc)])
print(json.dumps(outcomes))
"""


def _run_other_process(settings: Settings, secret_file: Path, key_file: Path | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERCHANT_")}
    env.update(
        MERCHANT_API_KEY=settings.api_key,
        MERCHANT_API_SECRET_FILE=str(secret_file),
        MERCHANT_BASE_URL=settings.base_url,
        MERCHANT_REDIS_URL=settings.fleet.redis_url,
        MERCHANT_KEY_PREFIX=settings.fleet.key_prefix,
    )
    if key_file is not None:
        env["MERCHANT_TOKEN_KEY_FILE"] = str(key_file)
    done = subprocess.run(
        [sys.executable, "-c", _OTHER_PROCESS],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    outcomes: list[list[str]] = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(outcomes) == 3
    for name, message in outcomes:
        assert name == "TokenUnreadable", outcomes
        assert "MERCHANT_TOKEN_KEY_FILE" in message
    return [message for _, message in outcomes]


@pytest.mark.integration
def test_a_process_with_another_key_or_none_fails_clearly_and_never_renews_over_the_token(
    merchant_settings: Settings,
    merchant_sandbox: MerchantSandbox,
    redis_client: redis.Redis,
    merchant_secret_file: Path,
    key_file: Path,
    tmp_path: Path,
) -> None:
    sealed_settings = replace(
        merchant_settings, fleet=replace(merchant_settings.fleet, token_key_file=str(key_file))
    )
    ours = client_for(sealed_settings, redis_client=redis_client)
    assert ours.request("GET", PING) == {"ok": True}
    stored = redis_client.get(ours.manager.store.keys.token)
    assert merchant_sandbox.exchanges()["ok"] == 1

    _run_other_process(merchant_settings, merchant_secret_file, _key_file(tmp_path, "another-key"))
    _run_other_process(merchant_settings, merchant_secret_file, None)

    assert merchant_sandbox.exchanges()["ok"] == 1  # neither made an exchange
    assert redis_client.get(ours.manager.store.keys.token) == stored
    ours.manager.copy.forget()  # read Redis again: the fleet's token is still ours
    assert ours.request("GET", PING) == {"ok": True}
    assert merchant_sandbox.exchanges()["ok"] == 1


@pytest.mark.integration
def test_a_sealed_fleet_renews_once_and_calls_with_the_opened_token(
    merchant_settings: Settings,
    merchant_sandbox: MerchantSandbox,
    redis_client: redis.Redis,
    key_file: Path,
) -> None:
    sealed = replace(
        merchant_settings, fleet=replace(merchant_settings.fleet, token_key_file=str(key_file))
    )
    first = client_for(sealed, redis_client=redis_client)
    second = client_for(sealed, redis_client=redis_client)
    assert first.request("GET", PING) == {"ok": True}
    assert second.request("GET", PING) == {"ok": True}
    first.manager.renew(force=True)
    second.manager.copy.forget()
    assert second.request("GET", PING) == {"ok": True}
    assert merchant_sandbox.exchanges()["ok"] == 2
    assert merchant_sandbox.calls()["unauthorized"] == 0
