"""The Grafana dashboard of deploy/grafana, read: a panel for each thing on-call looks at."""

from __future__ import annotations

import json

from support.prometheus_harness import dashboard, dashboard_expressions


def test_the_dashboard_has_a_panel_for_each_thing_on_call_looks_at() -> None:
    board = dashboard()
    exprs = " ".join(expr for _, expr in dashboard_expressions())
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
    by_account = [p for p in board["panels"] if "account" in json.dumps(p["targets"])]
    assert len(by_account) >= 8
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["environment", "account"]
    ids = [panel["id"] for panel in board["panels"]]
    assert len(set(ids)) == len(ids)
