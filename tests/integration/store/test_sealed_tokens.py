"""Tokens sealed at rest, for real: the commands that make and warn about key files, the
store on real Redis keeping the value sealed, and a process with another key that fails
clearly instead of renewing over the fleet's token."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from merchant_tasks.accounts import client_for
from merchant_tasks.exceptions import TokenUnreadable
from merchant_tasks.renewal.life import LOCAL_COPY_TTL
from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.settings import Settings
from merchant_tasks.store.sealing import Sealer, codec_for
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.token import IssuedToken, RenewalReason, Token
from support.leaks import shows
from support.paths import ROOT
from support.renewal import make_manager
from support.routes import PING
from support.token_keys import token_key_file

pytestmark = pytest.mark.integration


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
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    [command] = re.findall(r"^ *(\(umask 077; python -c .*? > token\.key\))$", page, re.M)
    command = command.replace("python -c", f"{shlex.quote(sys.executable)} -c")
    subprocess.run(["bash", "-c", command], cwd=tmp_path, check=True, env={"PATH": "/usr/bin:/bin"})
    key_file = tmp_path / "token.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert isinstance(codec_for(str(key_file)), Sealer)


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

    _run_other_process(
        merchant_settings, merchant_secret_file, token_key_file(tmp_path / "another-key")
    )
    _run_other_process(merchant_settings, merchant_secret_file, None)

    assert merchant_sandbox.exchanges()["ok"] == 1  # neither made an exchange
    assert redis_client.get(ours.manager.store.keys.token) == stored
    ours.manager.life.forget()  # read Redis again: the fleet's token is still ours
    assert ours.request("GET", PING) == {"ok": True}
    assert merchant_sandbox.exchanges()["ok"] == 1


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
    second.manager.life.forget()
    assert second.request("GET", PING) == {"ok": True}
    assert merchant_sandbox.exchanges()["ok"] == 2
    assert merchant_sandbox.calls()["unauthorized"] == 0


def test_status_without_the_key_shows_a_sealed_token_by_its_record(
    merchant_settings: Settings,
    merchant_sandbox: MerchantSandbox,
    redis_client: redis.Redis,
    key_file: Path,
) -> None:
    """`status` and the exporter need no key: a token sealed with one they lack (an
    account mid key rotation) shows its generation and state, and the other accounts are
    read as ever (it failed the reading of every account: TokenUnreadable)."""
    from merchant_tasks.accounts import AccountClients
    from merchant_tasks.ops.status import account_statuses

    sealed = replace(
        merchant_settings, fleet=replace(merchant_settings.fleet, token_key_file=str(key_file))
    )
    assert client_for(sealed, redis_client=redis_client).request("GET", PING) == {"ok": True}
    other = replace(merchant_settings, api_key=merchant_settings.api_key + "-other")
    statuses = account_statuses(AccountClients({"sealed": merchant_settings, "other": other}))
    assert statuses["sealed"].generation == 1
    assert statuses["sealed"].state == "fresh"
    assert statuses["other"].state == "missing"
