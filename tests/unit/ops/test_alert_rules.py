"""The alerting rules of deploy/prometheus, read: each alert fires in a case of the rules'
unit tests and a healthy fleet fires none; every alert has ``for:``, a severity, a summary
and a runbook entry; alert templates show only the series' labels."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from support.prometheus_harness import OPERATIONS, RULE_TESTS, RULES, rules

# what alert templates may show: labels of the exporter's series and of the scrape target
TEMPLATE_LABELS = {"account", "environment", "kind", "host", "type", "instance", "job"}


def test_every_alert_has_a_case_where_it_fires_and_a_healthy_fleet_fires_none() -> None:
    alerts = {rule["alert"] for rule in rules()}
    fired: set[str] = set()
    quiet_in_healthy: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        checks = case["alert_rule_test"]
        fired |= {check["alertname"] for check in checks if check["exp_alerts"]}
        if case["name"].startswith("healthy") and not any(c["exp_alerts"] for c in checks):
            quiet_in_healthy |= {check["alertname"] for check in checks}
    assert fired == alerts
    assert quiet_in_healthy == alerts


def _runbook_anchors() -> set[str]:
    """The anchors of operations.md's headings, made the way GitHub makes them."""
    headings = re.findall(r"^#+ (.+)$", OPERATIONS.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("rule", rules(), ids=lambda rule: str(rule["alert"]))
def test_every_alert_has_for_a_severity_a_summary_and_a_runbook_entry(rule: dict[str, Any]) -> None:
    assert re.fullmatch(r"\d+[smh]", rule["for"])
    assert rule["labels"] == {"severity": rule["labels"]["severity"]}
    assert rule["labels"]["severity"] in {"critical", "warning"}
    annotations = rule["annotations"]
    assert set(annotations) == {"summary", "description", "runbook"}
    assert ": " in annotations["summary"]  # what happened: what to do
    page, _, anchor = annotations["runbook"].partition("#")
    assert page == "docs/operations.md"
    assert anchor == rule["alert"].lower()
    assert anchor in _runbook_anchors()


def test_alert_templates_show_only_the_series_labels_never_a_secret_or_token() -> None:
    text = RULES.read_text()
    shown = set(re.findall(r"\$labels\.(\w+)", text))
    assert shown <= TEMPLATE_LABELS
    templates = re.findall(r"\{\{(.*?)\}\}", text)
    assert all(re.search(r"secret|token|password", t, re.I) is None for t in templates)
