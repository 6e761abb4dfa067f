"""The Celery app's configuration: built from the validated settings (one door), per broker
(Redis-only transport options, Sentinel's master name), and clear errors."""

from __future__ import annotations

import importlib
import os
import re
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from celery import Celery

from merchant_tasks import accounts
from merchant_tasks.sandbox.processes import RedisServer, redis_answers, spawn
from merchant_tasks.sandbox.pytest_plugin import MerchantSandbox
from merchant_tasks.settings import Settings, child_env
from merchant_tasks.worker import app as celery_app
from merchant_tasks.worker import install as hosting
from merchant_tasks.worker.app import (
    PUBLISH_RETRY_POLICY,
    REDIS_ONLY_TRANSPORT_OPTIONS,
    VISIBILITY_TIMEOUT,
    load_config,
    package_defaults,
    write_config_module,
)

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
SENTINELS = "sentinel://:master-pw@127.0.0.1:26379/0;sentinel://:master-pw@127.0.0.1:26380/0"


@pytest.fixture(autouse=True)
def empty_celeryconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An empty celeryconfig.py first on the path (not the repo's), unless a test writes one."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    write_celeryconfig(tmp_path, "")
    yield
    sys.modules.pop("celeryconfig", None)


def write_celeryconfig(directory: Path, text: str) -> None:
    (directory / "celeryconfig.py").write_text(text)
    sys.modules.pop("celeryconfig", None)
    importlib.invalidate_caches()  # the directory was listed before the file existed


def test_a_redis_broker_gets_the_visibility_timeout() -> None:
    config = load_config({"MERCHANT_REDIS_URL": "redis://127.0.0.1:6379/0"})
    assert config["broker_transport_options"] == {"visibility_timeout": VISIBILITY_TIMEOUT}
    assert config["result_backend_transport_options"] == {"visibility_timeout": VISIBILITY_TIMEOUT}


def test_an_amqp_broker_gets_no_redis_only_transport_option(tmp_path: Path) -> None:
    write_celeryconfig(
        tmp_path,
        "broker_transport_options = {'visibility_timeout': 60, 'unacked_restore_interval': 1,"
        " 'confirm_publish': True}\n",
    )
    config = load_config({"CELERY_BROKER_URL": AMQP_URL})
    assert config["broker_url"] == AMQP_URL
    assert config["broker_transport_options"] == {"confirm_publish": True}
    assert not REDIS_ONLY_TRANSPORT_OPTIONS & set(config["broker_transport_options"])
    # the result backend stays on the token store's Redis, with its options
    assert config["result_backend_transport_options"] == {"visibility_timeout": VISIBILITY_TIMEOUT}


def test_a_sentinel_url_gives_broker_and_backend_the_master_name_and_sentinel_password() -> None:
    config = load_config(
        {
            "MERCHANT_REDIS_URL": SENTINELS,
            "MERCHANT_REDIS_SENTINEL_MASTER": "payments",
            "MERCHANT_REDIS_SENTINEL_PASSWORD": "sentinel-pw",
        }
    )
    assert config["broker_url"] == config["result_backend"] == SENTINELS
    for name in ("broker_transport_options", "result_backend_transport_options"):
        assert config[name] == {
            "visibility_timeout": VISIBILITY_TIMEOUT,
            "master_name": "payments",
            "sentinel_kwargs": {"password": "sentinel-pw"},
        }


def test_the_sentinel_master_name_defaults_to_mymaster_and_celeryconfig_wins(
    tmp_path: Path,
) -> None:
    assert load_config({"MERCHANT_REDIS_URL": SENTINELS})["broker_transport_options"] == {
        "visibility_timeout": VISIBILITY_TIMEOUT,
        "master_name": "mymaster",
    }
    write_celeryconfig(tmp_path, "broker_transport_options = {'master_name': 'other'}\n")
    options = load_config({"MERCHANT_REDIS_URL": SENTINELS})["broker_transport_options"]
    assert options["master_name"] == "other"


def test_publishing_waits_out_a_broker_away_for_about_a_minute() -> None:
    policy = load_config({})["task_publish_retry_policy"]
    assert policy == PUBLISH_RETRY_POLICY
    waits, wait = [], float(policy["interval_start"])
    for _ in range(policy["max_retries"]):
        waits.append(wait)
        wait = min(wait + policy["interval_step"], policy["interval_max"])
    assert 50 <= sum(waits) <= 70  # Celery's default gives up after 0.6 s


# -- built from the validated settings; configuration errors -------------------------------

START_TIMEOUT = 120.0  # seconds for a celery command on a busy machine


def _clean_env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MERCHANT_", "CELERY_"))}
    return {**env, **variables}


def _celery(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "merchant_tasks", *args],
        env=env,
        cwd=tmp_path,  # no celeryconfig.py here
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        check=False,
    )


def test_broker_and_backend_follow_the_redis_url_file(tmp_path: Path) -> None:
    path = tmp_path / "redis-url"
    path.write_text("redis://:pw@cache.example.test:6380/4\n", encoding="utf-8")
    config = package_defaults({"MERCHANT_REDIS_URL_FILE": str(path)})
    assert (
        config["broker_url"] == config["result_backend"] == "redis://:pw@cache.example.test:6380/4"
    )


def test_celery_urls_from_the_environment_override_the_defaults() -> None:
    config = load_config(
        {"CELERY_BROKER_URL": "amqp://rabbit//", "CELERY_RESULT_BACKEND": "redis://r/1"}
    )
    assert (config["broker_url"], config["result_backend"]) == ("amqp://rabbit//", "redis://r/1")


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
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=_clean_env(MERCHANT_RENEW_INTERVAL="abc"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("raised: MERCHANT_RENEW_INTERVAL must be a number")


def test_the_celery_command_loads_the_app_without_any_account(tmp_path: Path) -> None:
    done = _celery(tmp_path, _clean_env(), "report")
    assert done.returncode == 0, done.stderr
    assert "merchant_tasks.worker.app" in done.stdout or "merchant_tasks" in done.stdout


def test_a_worker_without_any_account_stops_at_start_with_the_configuration_message(
    tmp_path: Path, merchant_redis_url: str
) -> None:
    done = _celery(
        tmp_path,
        _clean_env(MERCHANT_REDIS_URL=merchant_redis_url),
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


ROOT = Path(__file__).resolve().parents[1]


def test_started_from_the_repository_root_the_app_reads_the_top_level_celeryconfig() -> None:
    code = "import sys, merchant_tasks.worker.app; print(sys.modules['celeryconfig'].__file__)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=_clean_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == ROOT / "celeryconfig.py"


def test_the_top_level_celeryconfig_sets_nothing_and_comments_only_real_settings() -> None:
    from celery.app.defaults import NAMESPACES, flatten

    text = (ROOT / "celeryconfig.py").read_text()
    namespace: dict[str, object] = {}
    exec(compile(text, "celeryconfig.py", "exec"), namespace)  # noqa: S102 - our own file
    assert [k for k in namespace if not k.startswith("__")] == []  # package defaults apply
    commented = re.findall(r"^# ([a-z_]+) = ", text, re.MULTILINE)
    assert commented  # it shows what may be overridden
    assert set(commented) <= {name for name, _ in flatten(NAMESPACES)}


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
    tmp_path: Path, merchant_redis_url: str
) -> None:
    env = _clean_env(MERCHANT_REDIS_URL=merchant_redis_url, MERCHANT_RENEW_INTERVALL="30")
    for command in (WORKER, _beat(tmp_path)):
        line = _one_error_line(_celery(tmp_path, env, *command))
        assert line == (
            "error: ConfigurationError: unknown variable MERCHANT_RENEW_INTERVALL "
            "(did you mean MERCHANT_RENEW_INTERVAL?)"
        )


def test_beat_stops_at_start_when_an_accounts_variable_is_wrong(
    tmp_path: Path, merchant_redis_url: str
) -> None:
    env = _clean_env(
        MERCHANT_REDIS_URL=merchant_redis_url,
        MERCHANT_API_KEY_FILE="/nope/key",
        MERCHANT_API_SECRET_FILE="/run/secrets/beat-holds-none",
    )
    line = _one_error_line(_celery(tmp_path, env, *_beat(tmp_path)))
    assert line == "error: ConfigurationError: MERCHANT_API_KEY_FILE: cannot read /nope/key " + (
        "(No such file or directory)"
    )


def test_worker_and_beat_stop_at_start_on_a_key_file_that_is_not_utf8(
    tmp_path: Path, merchant_redis_url: str
) -> None:
    key_file = tmp_path / "token.key"
    key_file.write_bytes(b"\xff" + os.urandom(31))  # the raw key instead of its base64
    key_file.chmod(0o600)
    env = _clean_env(
        MERCHANT_REDIS_URL=merchant_redis_url,
        MERCHANT_API_KEY="k",
        MERCHANT_API_SECRET="s",
        MERCHANT_TOKEN_KEY_FILE=str(key_file),
    )
    for command in (WORKER, _beat(tmp_path)):
        line = _one_error_line(_celery(tmp_path, env, *command))
        assert line.startswith(f"error: ConfigurationError: MERCHANT_TOKEN_KEY_FILE: {key_file}")


def test_a_worker_given_a_base_url_with_a_password_stops_and_never_shows_it(
    tmp_path: Path, merchant_redis_url: str
) -> None:
    env = _clean_env(
        MERCHANT_REDIS_URL=merchant_redis_url,
        MERCHANT_API_KEY="k",
        MERCHANT_API_SECRET="s",
        MERCHANT_BASE_URL="http://apiuser:BasicPw99@127.0.0.1:1",
    )
    done = _celery(tmp_path, env, *WORKER)
    assert "must not hold a user or password" in _one_error_line(done)
    assert "BasicPw99" not in done.stdout + done.stderr


def test_any_exception_loading_the_accounts_at_start_stops_with_its_type_only(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    def fails(**_: object) -> None:
        raise UnicodeDecodeError("utf-8", b"\xffsecret-bytes", 0, 1, "invalid start byte")

    monkeypatch.setattr(accounts, "load_accounts", fails)
    for check in (hosting._check_accounts, hosting._check_beat_accounts):
        with pytest.raises(SystemExit) as stopped:
            check(sender=SimpleNamespace(app=celery_app.app))
        assert stopped.value.code == 2
        out, err = capfd.readouterr()
        assert (out, err) == ("", "error: loading the configuration raised UnicodeDecodeError\n")


def test_beat_starts_without_the_secret_file_a_worker_needs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in [n for n in os.environ if n.startswith("MERCHANT_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MERCHANT_API_KEY", "k")
    monkeypatch.setenv("MERCHANT_API_SECRET_FILE", str(tmp_path / "mounted-for-workers-only"))
    hosting._check_beat_accounts(sender=SimpleNamespace(app=celery_app.app))  # no SystemExit
    with pytest.raises(SystemExit):
        hosting._check_accounts(sender=SimpleNamespace(app=celery_app.app))


def test_a_fleet_with_its_own_key_prefix_keeps_celerys_keys_under_it() -> None:
    env = {"MERCHANT_REDIS_URL": "redis://127.0.0.1:6379/3", "MERCHANT_KEY_PREFIX": "shop-eu"}
    config = load_config(env)
    for options in ("broker_transport_options", "result_backend_transport_options"):
        assert config[options]["global_keyprefix"] == "shop-eu:celery:"
    # the default prefix keeps the key names older releases wrote (their queued calls)
    plain = load_config({"MERCHANT_REDIS_URL": "redis://127.0.0.1:6379/3"})
    assert "global_keyprefix" not in plain["broker_transport_options"]


def test_the_store_url_given_again_as_celerys_gets_the_prefix_however_it_is_spelt() -> None:
    """CELERY_BROKER_URL naming the token store's own Redis (as MERCHANT_REDIS_URL does, or
    in the form Celery reads) is the fleet's Redis: its keys stay under the prefix."""
    store = "rediss://:pw@cache.example.test:6380/0"
    for given in (store, f"{store}?ssl_cert_reqs=required"):
        env = {"MERCHANT_REDIS_URL": store, "MERCHANT_KEY_PREFIX": "shop-eu"}
        config = load_config({**env, "CELERY_BROKER_URL": given})
        for options in ("broker_transport_options", "result_backend_transport_options"):
            assert config[options]["global_keyprefix"] == "shop-eu:celery:", (given, options)


def test_a_broker_of_the_users_choosing_gets_no_key_prefix_and_celeryconfig_wins(
    tmp_path: Path,
) -> None:
    env = {
        "MERCHANT_REDIS_URL": "redis://127.0.0.1:6379/3",
        "MERCHANT_KEY_PREFIX": "shop-eu",
        "CELERY_BROKER_URL": "redis://127.0.0.1:6379/5",
    }
    config = load_config(env)
    assert "global_keyprefix" not in config["broker_transport_options"]
    assert config["result_backend_transport_options"]["global_keyprefix"] == "shop-eu:celery:"
    write_celeryconfig(tmp_path, "broker_transport_options = {'global_keyprefix': 'mine:'}\n")
    env.pop("CELERY_BROKER_URL")
    assert load_config(env)["broker_transport_options"]["global_keyprefix"] == "mine:"


def test_a_written_config_module_is_never_readable_by_others(tmp_path: Path) -> None:
    """It may hold a Redis password: created with its owner-only mode whatever the umask,
    also over an older file others could read."""
    path = tmp_path / "celeryconfig.py"
    path.write_text("old = 1\n")
    path.chmod(0o644)
    old_umask = os.umask(0)
    try:
        write_config_module(path, {"broker_url": "redis://:pw@127.0.0.1:6379/0"})
    finally:
        os.umask(old_umask)
    assert path.stat().st_mode & 0o777 == 0o600
    assert "broker_url = 'redis://:pw@127.0.0.1:6379/0'" in path.read_text()
    assert "old" not in path.read_text()


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
    env = _clean_env(MERCHANT_REDIS_URL=url, MERCHANT_API_KEY="k", MERCHANT_API_SECRET="s")
    done = _celery(tmp_path, env, *WORKER)
    line = _one_error_line(done)
    assert "MERCHANT_REDIS_URL" in line
    assert named in line
    assert "RedisPw42" not in done.stdout + done.stderr


def test_a_unix_socket_or_tls_redis_url_is_given_to_celery_in_the_form_it_reads() -> None:
    """redis-py's ``unix://`` is no transport of kombu's nor a backend of Celery's, and
    Celery's result backend refuses ``rediss://`` without ``ssl_cert_reqs``."""
    unix = package_defaults({"MERCHANT_REDIS_URL": "unix:///run/redis.sock?db=3"})
    assert (
        unix["broker_url"]
        == unix["result_backend"]
        == "redis+socket:///run/redis.sock?virtual_host=3"
    )
    assert unix["broker_transport_options"]["visibility_timeout"] == VISIBILITY_TIMEOUT
    tls = package_defaults({"MERCHANT_REDIS_URL": "rediss://cache.example.test:6380/2"})
    assert tls["result_backend"] == "rediss://cache.example.test:6380/2?ssl_cert_reqs=required"
    app = Celery("tls-check", broker=tls["broker_url"], backend=tls["result_backend"])
    try:
        assert app.backend.connparams["ssl_cert_reqs"] == ssl.CERT_REQUIRED  # accepted
    finally:
        app.close()
    chosen = {"MERCHANT_REDIS_URL": "rediss://cache.example.test:6380/2?ssl_cert_reqs=optional"}
    assert package_defaults(chosen)["broker_url"].endswith("?ssl_cert_reqs=optional")  # kept


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
