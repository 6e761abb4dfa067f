"""The Grafana dashboard of deploy/grafana: the panels on-call needs, and every expression
(panels and variables) answered by a real Prometheus scraping `merchant-tasks metrics`,
naming only the series that exporter exports."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import requests

from merchant_tasks import FleetClient
from prometheus_harness import (
    DASHBOARD,
    exported_names,
    exporter,
    metric_names,
    prometheus,
    wait_for_scrapes,
)

# Grafana's variables, as a query with every account would have them
VARIABLES = {
    "$__rate_interval": "1m",
    "$account": ".*",
    "$environment": ".*",
}
LABEL_VALUES = re.compile(r"label_values\((.+),\s*\w+\)")


def _dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def _expressions() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    dashboard = _dashboard()
    found = [
        (f"{panel['title']} {target['refId']}", target["expr"])
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]
    for variable in dashboard["templating"]["list"]:
        match = LABEL_VALUES.fullmatch(variable["query"]["query"])
        assert match, variable["name"]
        found.append((f"variable {variable['name']}", match[1]))
    return found


def _as_queried(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


def test_the_dashboard_has_a_panel_for_each_thing_on_call_looks_at() -> None:
    dashboard = _dashboard()
    exprs = " ".join(expr for _, expr in _expressions())
    for family in [
        "merchant_tasks_token_time_left_seconds",
        "merchant_tasks_renewals_total",
        "merchant_tasks_unauthorized_total",
        "merchant_tasks_forced_renewals_total",  # revocations over and over: no pause now
        "merchant_tasks_breaker_open",
        "merchant_tasks_exchange_seconds_bucket",
        "merchant_tasks_exchange_rate_cap",
        "merchant_tasks_lock_waits_total",
        "merchant_tasks_redelivered_completed_calls_total",
    ]:
        assert family in exprs, family
    by_account = [p for p in dashboard["panels"] if "account" in json.dumps(p["targets"])]
    assert len(by_account) >= 8
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names == ["environment", "account"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(set(ids)) == len(ids)


@pytest.mark.integration
def test_every_dashboard_expression_is_answered_by_prometheus_and_names_exported_series(
    merchant_env: dict[str, str], merchant_client: FleetClient, tmp_path: Path
) -> None:
    merchant_client.request("GET", "/open-api/v1/ping")  # an exchange: every family has data
    with exporter(dict(os.environ), tmp_path) as target, prometheus(tmp_path, target) as server:
        exported = exported_names(requests.get(f"http://{target}/metrics", timeout=30).text)
        wait_for_scrapes(server)
        for where, expr in _expressions():
            named = metric_names(expr)
            assert named or 'up{job="merchant-tasks"}' in expr, where  # Prometheus's own
            assert named <= exported, (where, named - exported)
            result = server.query(_as_queried(expr))  # fails unless status is success
            assert result, f"{where}: no series for {expr}"
