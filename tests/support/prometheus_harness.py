"""A real Prometheus and a real `merchant-tasks metrics` on loopback, and the rules and the
dashboard they serve read as files, for the alert and dashboard tests (integration/ops/,
unit/ops/).

``promtool`` and ``prometheus`` come from Debian's ``prometheus`` package. Without them the
tests that need them are skipped, saying so, except where ``MERCHANT_TEST_REQUIRE_PROMETHEUS``
is set (``.ci/run`` installs the package and sets it): there a missing binary fails them.
Everything here starts its own processes on free loopback ports and stops them on exit.
"""

from __future__ import annotations

import calendar
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from support.paths import ROOT

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "alerts.yml"
RULE_TESTS = PROMETHEUS_DIR / "alerts_test.yml"
CONFIG = PROMETHEUS_DIR / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "merchant-tasks.json"
OPERATIONS = ROOT / "docs" / "operations.md"

START_TIMEOUT = 60.0  # a process answering on a busy machine
INTERVAL = "1s"  # the test Prometheus's scrape and evaluation interval
POLL = 0.2  # seconds between two looks while waiting for an event
METRIC_NAME = re.compile(r"\bmerchant_tasks_[a-z0-9_]+\b")


def tool(name: str) -> str:
    """The path of ``promtool`` or ``prometheus``; skips (or, in CI, fails) without it."""
    path = shutil.which(name)
    if path is None:
        reason = f"{name} is not on PATH (Debian package 'prometheus'; .ci/run installs it)"
        if os.environ.get("MERCHANT_TEST_REQUIRE_PROMETHEUS"):
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def free_port() -> int:
    """A loopback TCP port nobody listened on a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_for(what: str, ready: Callable[[], bool], timeout: float = START_TIMEOUT) -> None:
    """Polls ``ready`` until it holds; fails naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(POLL)


def _answers(url: str) -> bool:
    try:
        status: int = requests.get(url, timeout=5).status_code
    except requests.ConnectionError:
        return False
    return status == HTTPStatus.OK


@contextlib.contextmanager
def serving(
    name: str, argv: list[str], log: Path, ready_url: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` in a session of its own until ``ready_url`` answers 200; killed on exit."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:

        def ready() -> bool:
            if process.poll() is not None:
                pytest.fail(f"{name} exited with {process.returncode}: {log.read_text()[-2000:]}")
            return _answers(ready_url)

        wait_for(f"{name} to answer {ready_url}", ready)
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def merchant_tasks_command() -> str:
    """The ``merchant-tasks`` command installed beside this Python."""
    beside = Path(sys.executable).with_name("merchant-tasks")
    return str(beside) if beside.exists() else shutil.which("merchant-tasks") or "merchant-tasks"


@contextlib.contextmanager
def exporter(env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    """`merchant-tasks metrics` on a free loopback port with ``env``; its host:port."""
    port = free_port()
    argv = [merchant_tasks_command(), "metrics", "--host", "127.0.0.1", "--port", str(port)]
    address = f"127.0.0.1:{port}"
    with serving("the exporter", argv, tmp_path / "exporter.log", f"http://{address}/metrics", env):
        yield address


def exported_names(exposition: str) -> set[str]:
    """The series names an exposition offers: every sample's name, and the name of each
    gauge family even when it has no sample now (``merchant_tasks_scrape_error``)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names |= {sample.name for sample in family.samples}
        if family.type == "gauge":
            names.add(family.name)
    return names


def label_values(exposition: str, family: str, label: str) -> set[str]:
    """The values of ``label`` on the samples of ``family``."""
    return {
        sample.labels[label]
        for parsed in text_string_to_metric_families(exposition)
        if parsed.name == family
        for sample in parsed.samples
    }


def metric_names(expr: str) -> set[str]:
    """The merchant_tasks_* series an expression names."""
    return set(METRIC_NAME.findall(expr))


def rules() -> list[dict[str, Any]]:
    """The alerting rules of deploy/prometheus/alerts.yml."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


LABEL_VALUES = re.compile(r"label_values\((.+),\s*\w+\)")


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard of deploy/grafana."""
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return board


def dashboard_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable of the dashboard."""
    board = dashboard()
    found = [
        (f"{panel['title']} {target['refId']}", target["expr"])
        for panel in board["panels"]
        for target in panel["targets"]
    ]
    for variable in board["templating"]["list"]:
        match = LABEL_VALUES.fullmatch(variable["query"]["query"])
        assert match, variable["name"]
        found.append((f"variable {variable['name']}", match[1]))
    return found


@dataclass
class Prometheus:
    """A running Prometheus: its base URL and its HTTP API."""

    url: str

    def api(self, path: str, **params: str) -> Any:
        response = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = response.json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        return result

    def alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = self.api("alerts")["alerts"]
        return alerts

    def last_evaluation(self) -> float:
        """When the rule groups were last evaluated, all of them (Unix time)."""
        groups = self.api("rules")["groups"]
        return min(_unix_time(group["lastEvaluation"]) for group in groups)


def _unix_time(rfc3339: str) -> float:
    """A Prometheus timestamp (nanoseconds, Z) as Unix time."""
    match = re.fullmatch(r"(.+?)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", rfc3339)
    assert match, rfc3339
    base, fraction, zone = match.groups()
    seconds = float(calendar.timegm(time.strptime(base, "%Y-%m-%dT%H:%M:%S")))
    if zone != "Z":
        sign = 1 if zone[0] == "+" else -1
        seconds -= sign * (int(zone[1:3]) * 3600 + int(zone[4:6]) * 60)
    return seconds + (float(f"0.{fraction}") if fraction else 0.0)


def rules_with_for(tmp_path: Path, for_: str) -> Path:
    """A copy of the shipped rules whose every ``for:`` is ``for_``, nothing else changed."""
    document = yaml.safe_load(RULES.read_text())
    for group in document["groups"]:
        for rule in group["rules"]:
            rule["for"] = for_
    path = tmp_path / "alerts.yml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


@contextlib.contextmanager
def prometheus(tmp_path: Path, target: str, rules_file: Path = RULES) -> Iterator[Prometheus]:
    """Prometheus on a free loopback port with the shipped prometheus.yml, except: scrape and
    evaluate every INTERVAL, scrape ``target`` as the merchant-tasks job, load
    ``rules_file``."""
    config = yaml.safe_load(CONFIG.read_text())
    config["global"] = {
        "scrape_interval": INTERVAL,
        "scrape_timeout": INTERVAL,
        "evaluation_interval": INTERVAL,
    }
    config["rule_files"] = [str(rules_file)]
    [job] = config["scrape_configs"]
    job["static_configs"] = [{"targets": [target]}]
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        tool("prometheus"),
        f"--config.file={config_file}",
        f"--storage.tsdb.path={tmp_path / 'prometheus-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with serving("prometheus", argv, tmp_path / "prometheus.log", f"{url}/-/ready"):
        yield Prometheus(url)


def wait_for_scrapes(server: Prometheus, count: int = 3) -> None:
    """Until Prometheus holds ``count`` scrapes of the exporter with the store readable, and
    its rules were evaluated after that."""

    def scraped() -> bool:
        result = server.query(f"count_over_time(merchant_tasks_up[1m]) >= {count}")
        return bool(result) and server.query("merchant_tasks_up == 1") != []

    wait_for(f"{count} scrapes of the exporter", scraped)
    seen = time.time()
    wait_for("an evaluation of the rules", lambda: server.last_evaluation() > seen)
