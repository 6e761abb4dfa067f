"""The command line, `status` and the Prometheus metrics, against the emulator and Redis."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from merchant_tasks.accounts import AccountClients
from merchant_tasks.ops.cli import EXIT_CONFIGURATION, EXIT_FAILED, EXIT_STORE_UNAVAILABLE, main
from merchant_tasks.ops.metrics import FleetCollector
from merchant_tasks.ops.status import AccountStatus, account_status, format_status
from merchant_tasks.sandbox.fixtures import MerchantSandbox
from support.account import TEST_SECRET

pytestmark = pytest.mark.integration


def _run(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), env={"MERCHANT_API_SECRET": None, **env})
    return result.exit_code, result.stdout, result.stderr


def _succeeds(env: dict[str, str], *args: str) -> str:
    """The command's output, once it exited 0."""
    code, out, _ = _run(env, *args)
    assert code == 0
    return out


def _statuses(env: dict[str, str]) -> dict[str, AccountStatus]:
    clients = AccountClients.from_env(env)
    return {
        name: account_status(name, settings, clients.get(name).manager.store)
        for name, settings in clients.accounts.items()
    }


def test_call_prints_the_json_response_and_renew_reports_the_new_generation(
    merchant_env: dict[str, str], merchant_sandbox: MerchantSandbox
) -> None:
    out = _succeeds(merchant_env, "call", "POST", "/open-api/v1/echo", "--json", '{"amount": 5}')
    assert json.loads(out) == {"echo": {"amount": 5}}
    out = _succeeds(merchant_env, "renew", "--force")
    assert out.startswith("exchanged: generation 2, fingerprint ")
    assert merchant_sandbox.exchanges()["ok"] == 2


def test_status_json_reports_token_renewals_breaker_and_counters_but_no_token(
    merchant_env: dict[str, str], merchant_sandbox: MerchantSandbox
) -> None:
    _run(merchant_env, "call", "GET", "/open-api/v1/ping")
    merchant_sandbox.app.revoke_all()
    _run(merchant_env, "call", "GET", "/open-api/v1/ping")  # 401, forced renewal
    out = _succeeds(merchant_env, "status", "--json")
    [account] = json.loads(out)["accounts"]
    assert account["account"] == "default"
    assert account["state"] == "fresh"
    assert account["generation"] == 2
    assert account["last_renewal_reason"] == "forced"
    assert account["exchanges_last_hour"] == account["exchanges_last_day"] == 2
    assert account["breaker"] is None
    assert account["lock_holder"] is None
    assert account["counters"]["renewals:forced:ok"] == 1
    assert account["counters"]["unauthorized"] == 1
    for token in merchant_sandbox.app.issued_tokens():
        assert token not in out
    assert TEST_SECRET not in out


def test_status_shows_an_open_breaker_and_exits_1(
    merchant_env: dict[str, str], merchant_sandbox: MerchantSandbox
) -> None:
    merchant_sandbox.app.reset_secret("rotated-away-91c2")
    code, _, err = _run(merchant_env, "call", "GET", "/open-api/v1/ping")
    assert code == EXIT_FAILED
    assert "CredentialsRejected" in err
    code, out, _ = _run(merchant_env, "status")
    assert code == EXIT_FAILED
    assert "breaker     OPEN (rejected" in out
    assert "rotated-away-91c2" not in out


def test_exit_codes_tell_configuration_redis_and_api_failures_apart(
    merchant_env: dict[str, str],
) -> None:
    assert (
        _run({**merchant_env, "MERCHANT_ENVIRONMENT": "staging"}, "status")[0] == EXIT_CONFIGURATION
    )
    down = {**merchant_env, "MERCHANT_REDIS_URL": "redis://127.0.0.1:1/0"}
    assert _run(down, "renew")[0] == EXIT_STORE_UNAVAILABLE
    assert _run(merchant_env, "call", "GET", "/open-api/v1/missing")[0] == EXIT_FAILED
    assert _run(merchant_env, "call", "GET", "/elsewhere")[0] == 2  # click's usage error
    assert _run(merchant_env, "call", "POST", "/open-api/v1/echo", "--json", "{nope")[0] == 2


def test_the_sandbox_refuses_a_network_address_unless_allowed(merchant_env: dict[str, str]) -> None:
    code, _, err = _run(merchant_env, "sandbox", "--host", "0.0.0.0")  # noqa: S104
    assert code == 2
    assert "loopback only" in err


def test_format_status_names_everything_an_operator_needs(
    merchant_env: dict[str, str], merchant_sandbox: MerchantSandbox
) -> None:
    _run(merchant_env, "call", "GET", "/open-api/v1/ping")
    text = format_status(_statuses(merchant_env)["default"])
    for expected in (
        "default (sandbox, key test-app-id): fresh",
        "generation 1",
        "breaker     closed",
    ):
        assert expected in text


def test_one_scrape_sees_the_exchanges_of_every_process(
    merchant_env: dict[str, str], merchant_sandbox: MerchantSandbox
) -> None:
    """Counters live in Redis, so a scrape in one process counts what others did."""
    child_env = {k: v for k, v in os.environ.items() if k != "MERCHANT_API_SECRET"} | merchant_env
    for _ in range(2):
        subprocess.run(
            [sys.executable, "-m", "merchant_tasks.ops.cli", "renew", "--force"],
            env=child_env,
            check=True,
            capture_output=True,
        )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(lambda: _statuses(merchant_env)))
    text = generate_latest(registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    labels = (("account", "default"), ("environment", "sandbox"))
    manual = (*labels, ("outcome", "ok"), ("reason", "manual"))
    assert samples[("merchant_tasks_renewals_total", tuple(sorted(manual)))] == 2
    assert samples[("merchant_tasks_token_generation", labels)] == 2
    assert samples[("merchant_tasks_token_time_left_seconds", labels)] > 0
    assert samples[("merchant_tasks_breaker_open", (*labels, ("kind", "rejected")))] == 0
    assert merchant_sandbox.exchanges()["ok"] == 2


# -- what the command line says ------------------------------------------------------------


def test_renew_without_force_says_not_due_and_makes_no_exchange_when_the_token_is_fresh(
    merchant_env: dict[str, str], merchant_sandbox: MerchantSandbox
) -> None:
    assert _run(merchant_env, "renew")[0] == 0  # no token yet: due
    out = _succeeds(merchant_env, "renew")
    assert out.startswith("not due: generation 1, fingerprint ")
    assert merchant_sandbox.exchanges()["ok"] == 1


def test_renew_force_with_a_wrong_secret_prints_the_error_once_with_its_fields(
    merchant_env: dict[str, str], merchant_sandbox: MerchantSandbox
) -> None:
    merchant_sandbox.app.reset_secret("rotated-away-5d1e")
    code, out, err = _run(merchant_env, "renew", "--force")
    assert code == EXIT_FAILED
    assert out == ""
    assert err.count("refused the credentials") == 1
    assert err.splitlines()[0].startswith("error: CredentialsRejected: ")
    assert err.splitlines()[1] == "  status 401, code 'invalid_client'"


@pytest.fixture
def web_page_server() -> Iterator[str]:
    """A loopback server that answers every request with a 404 web page: a base URL
    pointing at some other site."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = b"<html><body>Not Found</body></html>"
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_a_base_url_with_the_apis_path_works_and_any_other_path_exits_2_naming_it(
    merchant_env: dict[str, str], merchant_sandbox: MerchantSandbox
) -> None:
    printed = {**merchant_env, "MERCHANT_BASE_URL": merchant_sandbox.url + "/open-api/v1"}
    code, out, err = _run(printed, "renew", "--force")
    assert (code, err) == (0, "")
    assert out.startswith("exchanged: generation 1, ")  # renew --force says it exchanged
    code, out, err = _run(
        {**merchant_env, "MERCHANT_BASE_URL": merchant_sandbox.url + "/v2"}, "renew"
    )
    assert code == EXIT_CONFIGURATION
    [line] = err.splitlines()
    assert line.startswith("error: ConfigurationError: MERCHANT_BASE_URL must be")


def test_a_wrong_base_url_is_named_as_such_and_the_renew_after_the_fix_succeeds_at_once(
    merchant_env: dict[str, str], merchant_sandbox: MerchantSandbox, web_page_server: str
) -> None:
    code, _, err = _run({**merchant_env, "MERCHANT_BASE_URL": web_page_server}, "renew")
    assert code == EXIT_CONFIGURATION
    assert err.splitlines()[0].startswith(
        f"error: WrongBaseUrl: {web_page_server}/open-api/v1/auth/access_token answered "
        "HTTP 404 with an HTML page: MERCHANT_BASE_URL does not point at the API"
    )
    assert "MERCHANT_API_SECRET" not in err
    assert "OPEN" not in _run(merchant_env, "status")[1]  # no pause to wait out
    code, out, err = _run(merchant_env, "renew", "--force")  # the URL fixed
    assert (code, err) == (0, "")
    assert out.startswith("exchanged: generation 1, ")  # renew --force says it exchanged
    assert merchant_sandbox.exchanges()["ok"] == 1


def test_call_prints_the_apis_status_error_code_and_excerpt(merchant_env: dict[str, str]) -> None:
    code, _, err = _run(merchant_env, "call", "GET", "/open-api/v1/payments/pay_missing")
    assert code == EXIT_FAILED
    first, fields = err.splitlines()
    assert (
        first
        == "error: ApiError: GET /open-api/v1/payments/pay_missing failed with HTTP 404 (not_found)"
    )
    assert fields.startswith("  status 404, code 'not_found', excerpt '")
    assert "no such payment" in fields


def test_status_json_prints_an_error_as_json_naming_the_redis_host_never_its_password(
    merchant_env: dict[str, str],
) -> None:
    down = {**merchant_env, "MERCHANT_REDIS_URL": "redis://ops:hunter2-pw@127.0.0.1:1/0"}
    code, out, err = _run(down, "status", "--json")
    assert code == EXIT_STORE_UNAVAILABLE
    error = json.loads(out)["error"]
    assert error["type"] == "StoreUnavailable"
    assert "127.0.0.1:1" in error["message"]
    assert "hunter2-pw" not in out + err


def test_status_json_prints_a_configuration_error_as_json(merchant_env: dict[str, str]) -> None:
    code, out, _ = _run({**merchant_env, "MERCHANT_ENVIRONMENT": "staging"}, "status", "--json")
    assert code == EXIT_CONFIGURATION
    assert "MERCHANT_ENVIRONMENT" in json.loads(out)["error"]["message"]


def test_the_sandbox_on_a_busy_port_fails_without_printing_its_banner(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "merchant_tasks.ops.cli", "sandbox", "--port", str(port)],
            env={**os.environ, "MERCHANT_API_KEY": "k", "MERCHANT_API_SECRET": "s"},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode != 0
    assert "merchant API sandbox" not in done.stdout
    assert "in use" in done.stderr


def test_status_reads_redis_without_the_secret_which_exchanging_commands_still_need(
    merchant_env: dict[str, str], tmp_path: Path
) -> None:
    """As in the compose file: the exporter's container has no secret mounted."""
    _run(merchant_env, "call", "GET", "/open-api/v1/ping")  # a token in Redis
    unmounted = {k: v for k, v in merchant_env.items() if k != "MERCHANT_API_SECRET"}
    unmounted["MERCHANT_API_SECRET_FILE"] = str(tmp_path / "not-mounted")
    code, out, err = _run(unmounted, "status", "--json")
    assert code == 0, err
    [account] = json.loads(out)["accounts"]
    assert account["state"] == "fresh"
    code, _, err = _run(unmounted, "renew", "--force")
    assert code == EXIT_CONFIGURATION
    assert "MERCHANT_API_SECRET_FILE: cannot read" in err


@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["status", "--json"],
        ["renew"],
        ["call", "GET", "/open-api/v1/ping"],
        ["sandbox", "--port", "1"],
    ],
)
def test_an_unknown_variable_stops_a_command_naming_the_closest_known_one(
    merchant_env: dict[str, str], args: list[str]
) -> None:
    code, out, err = _run({**merchant_env, "MERCHANT_RENEW_INTERVALL": "30"}, *args)
    assert code == EXIT_CONFIGURATION
    assert "unknown variable MERCHANT_RENEW_INTERVALL (did you mean MERCHANT_RENEW_INTERVAL?)" in (
        out + err
    )
    assert "Traceback" not in out + err


@pytest.mark.parametrize(
    "args", [["status"], ["status", "--json"], ["renew"], ["call", "GET", "/open-api/v1/ping"]]
)
def test_a_base_url_with_a_password_is_refused_and_the_password_shown_nowhere(
    merchant_env: dict[str, str], args: list[str]
) -> None:
    gateway = {**merchant_env, "MERCHANT_BASE_URL": "http://apiuser:BasicPw99@127.0.0.1:1"}
    code, out, err = _run(gateway, *args)
    assert code == EXIT_CONFIGURATION
    assert "MERCHANT_BASE_URL must not hold a user or password" in out + err
    assert "BasicPw99" not in out + err
