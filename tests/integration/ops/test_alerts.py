"""The alerting rules of deploy/prometheus, run: promtool accepts them and their unit tests
pass; the rules name only what the exporter exports, and each pause this release opens has
one alert; and against a real Prometheus scraping `merchant-tasks metrics`, a secret reset
in the emulator makes the credentials alert pending, and the new secret in the fleet's file
clears it."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from merchant_tasks.token import BreakerKind
from support.account import TEST_SECRET
from support.prometheus_harness import (
    CONFIG,
    PROMETHEUS_DIR,
    RULE_TESTS,
    RULES,
    Prometheus,
    exported_names,
    exporter,
    label_values,
    metric_names,
    prometheus,
    rules,
    rules_with_for,
    tool,
    wait_for,
    wait_for_scrapes,
)
from support.routes import PING

pytestmark = pytest.mark.integration


CREDENTIALS_ALERT = "MerchantTasksCredentialsRejected"
REVOKED_ALERT = "MerchantTasksTokensRevokedRepeatedly"
FORCED_RENEWALS = "merchant_tasks_forced_renewals_total"
# the pauses this release opens, one alert each. Not `revoked`: it stood for the budget of
# forced renewals, which is gone (forced renewals are spaced instead, and calls wait for
# them); the kind is kept only so that a record written by an older release still reads,
# and its alert would never fire. Tokens revoked over and over show in the forced
# renewals (REVOKED_ALERT).
OPENED_KINDS = {str(kind) for kind in BreakerKind if kind != BreakerKind.REVOKED}
RESULT_TIMEOUT = 60.0  # a call's result from the test's worker on a busy machine
ALERT_TIMEOUT = 120.0  # an alert's change seen through Prometheus on a busy machine


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("promtool"), *args],
        cwd=PROMETHEUS_DIR,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_promtool_accepts_the_rules_and_the_scrape_config() -> None:
    checked = _promtool("check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout
    config = _promtool("check", "config", CONFIG.name)
    assert config.returncode == 0, config.stdout + config.stderr


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    tested = _promtool("test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_the_rules_name_only_exported_series_and_each_pause_this_release_opens_has_an_alert(
    merchant_env: dict[str, str], tmp_path: Path
) -> None:
    with exporter(dict(os.environ), tmp_path) as address:
        exposition = requests.get(f"http://{address}/metrics", timeout=30).text
    exported = exported_names(exposition)
    for rule in rules():
        named = metric_names(rule["expr"])
        assert named <= exported, (rule["alert"], named - exported)
        assert named or rule["expr"].startswith('up{job="merchant-tasks"}'), rule["alert"]
    kinds = label_values(exposition, "merchant_tasks_breaker_open", "kind")
    # the exporter gives every kind a sample from the first scrape, `revoked` included
    assert kinds == {str(kind) for kind in BreakerKind}
    for kind in kinds:
        selector = f'merchant_tasks_breaker_open{{kind="{kind}"}}'
        paused = [rule["alert"] for rule in rules() if selector in rule["expr"]]
        assert len(paused) == (1 if kind in OPENED_KINDS else 0), (kind, paused)
    # repeated revocations no longer open a pause: their alert is on the forced renewals
    revoked = [rule["alert"] for rule in rules() if FORCED_RENEWALS in rule["expr"]]
    assert revoked == [REVOKED_ALERT]


def _credentials_alert(server: Prometheus) -> dict[str, Any] | None:
    found = [a for a in server.alerts() if a["labels"]["alertname"] == CREDENTIALS_ALERT]
    return found[0] if found else None


def _credentials_alert_cleared(server: Prometheus) -> bool:
    """The breaker shows closed in fresh data, and the alert is gone."""
    closed = server.query('merchant_tasks_breaker_open{kind="rejected"} == 0')
    return bool(closed) and _credentials_alert(server) is None


@pytest.mark.long
def test_a_secret_reset_makes_the_credentials_alert_pending_and_the_new_secret_clears_it(
    merchant_sandbox: Any, merchant_env: dict[str, str], merchant_worker: Any, tmp_path: Path
) -> None:
    """The shipped rules with every ``for:`` at 1 s (expressions untouched), a Prometheus
    scraping and evaluating every second, the exporter over the test's worker and emulator."""
    assert merchant_worker.call("GET", PING).get(timeout=RESULT_TIMEOUT) == {"ok": True}
    rules_file = rules_with_for(tmp_path, "1s")
    shipped = {rule["alert"]: rule["expr"] for rule in rules()}
    tested = yaml.safe_load(rules_file.read_text())["groups"][0]["rules"]
    assert {rule["alert"]: rule["expr"] for rule in tested} == shipped
    new_secret = secrets.token_urlsafe(24)
    with (
        exporter(dict(os.environ), tmp_path) as target,
        prometheus(tmp_path, target, rules_file) as server,
    ):
        wait_for_scrapes(server)
        # a healthy fleet: none of the shipped alerts (a scrape that timed out on a loaded
        # machine may have made the exporter's own alert pending a moment)
        wait_for("no alert while the fleet is healthy", lambda: server.alerts() == [])

        merchant_sandbox.app.reset_secret(new_secret)  # as in the dashboard: tokens revoked
        merchant_worker.call("GET", PING)  # a 401, then the old secret refused (it retries)
        wait_for(
            f"{CREDENTIALS_ALERT} pending or firing",
            lambda: _credentials_alert(server) is not None,
            timeout=ALERT_TIMEOUT,
        )
        alert = _credentials_alert(server)
        assert alert is not None
        assert alert["state"] in {"pending", "firing"}
        assert alert["labels"] == {
            "alertname": CREDENTIALS_ALERT,
            "account": "default",
            "environment": "sandbox",
            "kind": "rejected",
            "severity": "critical",
        }
        assert "MERCHANT_API_SECRET_FILE" in alert["annotations"]["summary"]

        # the runbook's fix: the new secret in the fleet's file, no restart
        merchant_sandbox.secret_file.write_text(new_secret, encoding="utf-8")
        assert merchant_worker.call("GET", PING).get(timeout=RESULT_TIMEOUT) == {"ok": True}
        wait_for(
            f"{CREDENTIALS_ALERT} to clear",
            lambda: _credentials_alert_cleared(server),
            timeout=ALERT_TIMEOUT,
        )
        seen = json.dumps([server.api("alerts"), server.api("rules")])
    assert TEST_SECRET not in seen
    assert new_secret not in seen
