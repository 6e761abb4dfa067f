"""The Celery app at start, as the `celery` command and a fresh interpreter load it: a bad
setting stops worker and beat in one line naming it (never a password), the top-level
celeryconfig is read from the repository root, and a worker on a unix socket serves."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from celery import Celery

from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.sandbox.processes import RedisServer, redis_answers, spawn
from merchant_tasks.settings import Settings, child_env
from merchant_tasks.worker.app import load_config
from support.paths import ROOT
from support.programs import run_python

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("empty_celeryconfig")]


START_TIMEOUT = 120.0  # seconds for a celery command on a busy machine


def _clean_env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MERCHANT_", "CELERY_"))}
    return {**env, **variables}


ACCOUNT = {"MERCHANT_API_KEY": "k", "MERCHANT_API_SECRET": "s"}  # one that never gets to call


@pytest.fixture
def redis_env(merchant_redis_url: str) -> Callable[..., dict[str, str]]:
    """``_clean_env`` with this test's Redis."""
    return functools.partial(_clean_env, MERCHANT_REDIS_URL=merchant_redis_url)


def _celery(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_python(
        "-m",
        "celery",
        "-A",
        "merchant_tasks",
        *args,
        env=env,
        cwd=tmp_path,  # no celeryconfig.py here
        timeout=START_TIMEOUT,
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [("abc", "must be a number of seconds"), ("-5", "must be a positive, finite number")],
)
def test_a_bad_renew_interval_stops_the_celery_command_with_one_line_naming_it(
    tmp_path: Path, raw: str, message: str
) -> None:
    done = _celery(tmp_path, _clean_env(MERCHANT_RENEW_INTERVAL=raw), "report")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr + done.stdout
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"error: ConfigurationError: MERCHANT_RENEW_INTERVAL {message}")


def test_a_library_import_with_a_bad_setting_raises_the_configuration_error(
    tmp_path: Path,
) -> None:
    code = (
        "from merchant_tasks.exceptions import ConfigurationError\n"
        "try:\n    import merchant_tasks.worker.app\n"
        "except ConfigurationError as exc:\n    print('raised:', exc)\n"
    )
    done = run_python(
        "-c",
        code,
        env=_clean_env(MERCHANT_RENEW_INTERVAL="abc"),
        cwd=tmp_path,
        timeout=START_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("raised: MERCHANT_RENEW_INTERVAL must be a number")


def test_the_celery_command_loads_the_app_without_any_account(tmp_path: Path) -> None:
    done = _celery(tmp_path, _clean_env(), "report")
    assert done.returncode == 0, done.stderr
    assert "merchant_tasks.worker.app" in done.stdout or "merchant_tasks" in done.stdout


def test_a_worker_without_any_account_stops_at_start_with_the_configuration_message(
    tmp_path: Path, redis_env: Callable[..., dict[str, str]]
) -> None:
    done = _celery(
        tmp_path,
        redis_env(),
        "worker",
        "--pool=solo",
        "--without-gossip",
        "--without-mingle",
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr + done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ConfigurationError: no account configured: set MERCHANT_API_KEY")
    assert "ready" not in done.stdout + done.stderr


def test_started_from_the_repository_root_the_app_reads_the_top_level_celeryconfig() -> None:
    code = "import sys, merchant_tasks.worker.app; print(sys.modules['celeryconfig'].__file__)"
    done = run_python("-c", code, env=_clean_env(), cwd=ROOT, timeout=START_TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == ROOT / "celeryconfig.py"


def _one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The process stopped with exit 2 and one error line, last on stderr, no traceback
    (Celery may warn before it, e.g. about running as root)."""
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("error")] == lines[-1:]
    return lines[-1]


WORKER = ("worker", "--pool=solo", "--without-gossip", "--without-mingle")


def _beat(tmp_path: Path) -> tuple[str, ...]:
    return ("beat", "-s", str(tmp_path / "beat-schedule"))


def test_an_unknown_variable_stops_worker_and_beat_naming_the_closest_known_one(
    tmp_path: Path, redis_env: Callable[..., dict[str, str]]
) -> None:
    env = redis_env(MERCHANT_RENEW_INTERVALL="30")
    for command in (WORKER, _beat(tmp_path)):
        line = _one_error_line(_celery(tmp_path, env, *command))
        assert line == (
            "error: ConfigurationError: unknown variable MERCHANT_RENEW_INTERVALL "
            "(did you mean MERCHANT_RENEW_INTERVAL?)"
        )


def test_beat_stops_at_start_when_an_accounts_variable_is_wrong(
    tmp_path: Path, redis_env: Callable[..., dict[str, str]]
) -> None:
    env = redis_env(
        MERCHANT_API_KEY_FILE="/nope/key",
        MERCHANT_API_SECRET_FILE="/run/secrets/beat-holds-none",
    )
    line = _one_error_line(_celery(tmp_path, env, *_beat(tmp_path)))
    assert line == "error: ConfigurationError: MERCHANT_API_KEY_FILE: cannot read /nope/key " + (
        "(No such file or directory)"
    )


def test_worker_and_beat_stop_at_start_on_a_key_file_that_is_not_utf8(
    tmp_path: Path, redis_env: Callable[..., dict[str, str]]
) -> None:
    key_file = tmp_path / "token.key"
    key_file.write_bytes(b"\xff" + os.urandom(31))  # the raw key instead of its base64
    key_file.chmod(0o600)
    env = redis_env(
        **ACCOUNT,
        MERCHANT_TOKEN_KEY_FILE=str(key_file),
    )
    for command in (WORKER, _beat(tmp_path)):
        line = _one_error_line(_celery(tmp_path, env, *command))
        assert line.startswith(f"error: ConfigurationError: MERCHANT_TOKEN_KEY_FILE: {key_file}")


def test_a_worker_given_a_base_url_with_a_password_stops_and_never_shows_it(
    tmp_path: Path, redis_env: Callable[..., dict[str, str]]
) -> None:
    env = redis_env(
        **ACCOUNT,
        MERCHANT_BASE_URL="http://apiuser:BasicPw99@127.0.0.1:1",
    )
    done = _celery(tmp_path, env, *WORKER)
    assert "must not hold a user or password" in _one_error_line(done)
    assert "BasicPw99" not in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("redis://:RedisPw42@127.0.0.1:6379/abc", "path must be a database number"),
        ("redis://:RedisPw42@127.0.0.1:6379/0?socket_timeout=abc", "'socket_timeout'"),
        ("unix://:RedisPw42@/tmp/redis.sock?db=abc", "'db'"),
    ],
    ids=["path", "query", "unix-db"],
)
def test_a_redis_url_celery_or_redis_py_cannot_read_stops_the_worker_in_one_line(
    tmp_path: Path, url: str, named: str
) -> None:
    """They passed the scheme and port checks; the worker then died in a traceback."""
    env = _clean_env(MERCHANT_REDIS_URL=url, **ACCOUNT)
    done = _celery(tmp_path, env, *WORKER)
    line = _one_error_line(done)
    assert "MERCHANT_REDIS_URL" in line
    assert named in line
    assert "RedisPw42" not in done.stdout + done.stderr


def test_a_worker_on_a_unix_socket_redis_serves_calls(
    tmp_path: Path, merchant_settings: Settings, merchant_sandbox: MerchantSandbox
) -> None:
    """MERCHANT_REDIS_URL=unix://... for the token store, the broker and the results, with
    a password and one of redis-py's options (it died at start: "No such transport: unix";
    then kombu was handed the option as a string, and never the password in the query)."""
    socket_path = tmp_path / "redis.sock"
    password = "sock-pw-77"
    server = RedisServer(tmp_path / "redis", "--unixsocket", str(socket_path))
    server.argv += ["--requirepass", password]
    server.start(ready=lambda: redis_answers(server.port, password))
    query = f"db=2&password={password}&socket_timeout=5"
    fleet = replace(merchant_settings.fleet, redis_url=f"unix://{socket_path}?{query}")
    settings = replace(merchant_settings, fleet=fleet)
    workdir = tmp_path / "worker"
    workdir.mkdir()
    argv = [sys.executable, "-m", "celery", "-A", "merchant_tasks", *WORKER, "-c", "1"]
    worker = spawn("worker", argv, tmp_path / "worker.log", env=child_env(settings), cwd=workdir)
    app = Celery("unix-client", set_as_current=False)
    app.conf.update({**load_config(settings.to_env()), "imports": ()})
    try:
        worker.wait_ready(lambda: bool(app.control.ping(timeout=0.5)), timeout=START_TIMEOUT)
        result = app.send_task("merchant_tasks.call_api", ("GET", "/open-api/v1/ping"))
        assert result.get(timeout=60) == {"ok": True}
        assert merchant_sandbox.exchanges()["ok"] == 1
    finally:
        worker.stop()
        app.close()
        server.stop()
    assert password not in worker.log_text()
