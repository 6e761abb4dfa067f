"""The Grafana dashboard of deploy/grafana against a real Prometheus scraping
`merchant-tasks metrics`: every expression (panels and variables) is answered and names
only the series that exporter exports."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import requests

from merchant_tasks import FleetClient
from support.prometheus_harness import (
    dashboard_expressions,
    exported_names,
    exporter,
    metric_names,
    prometheus,
    wait_for_scrapes,
)

pytestmark = pytest.mark.integration


# Grafana's variables, as a query with every account would have them
VARIABLES = {
    "$__rate_interval": "1m",
    "$account": ".*",
    "$environment": ".*",
}


def _as_queried(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


def test_every_dashboard_expression_is_answered_by_prometheus_and_names_exported_series(
    merchant_env: dict[str, str], merchant_client: FleetClient, tmp_path: Path
) -> None:
    merchant_client.request("GET", "/open-api/v1/ping")  # an exchange: every family has data
    with exporter(dict(os.environ), tmp_path) as target, prometheus(tmp_path, target) as server:
        exported = exported_names(requests.get(f"http://{target}/metrics", timeout=30).text)
        wait_for_scrapes(server)
        for where, expr in dashboard_expressions():
            named = metric_names(expr)
            assert named or 'up{job="merchant-tasks"}' in expr, where  # Prometheus's own
            assert named <= exported, (where, named - exported)
            result = server.query(_as_queried(expr))  # fails unless status is success
            assert result, f"{where}: no series for {expr}"
