"""Prometheus metrics for the whole fleet, read from Redis at scrape time.

The counters live in Redis, not in any process, so one scrape of one exporter
(`merchant-tasks metrics`) sees the numbers of every worker and every prefork child; there
is no per-process registry to merge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .policy import CounterName
from .status import AccountStatus

PREFIX = "merchant_tasks"
# counters kept in Redis (TokenStore.count) that are not per-exchange: name -> help
_SIMPLE_COUNTERS: dict[str, str] = {
    CounterName.UNAUTHORIZED: "Calls answered 401 that asked the store for a newer token.",
    CounterName.FORCED_RENEWALS: "Forced renewals after a 401 that went on to an exchange.",
    CounterName.LOCK_WAITS: "Renewals that waited for another process holding the lock.",
    CounterName.NEVER_ACCEPTED: "401s on a token the API never accepted (no renewal made).",
    "redelivered_completed_calls": "Redelivered calls that had already succeeded: answered "
    "from their completion record, the API not called again.",
}


class FleetCollector(Collector):
    """Turns each account's status into metric families at every scrape."""

    def __init__(self, statuses: Callable[[], Mapping[str, AccountStatus]]) -> None:
        self._statuses = statuses

    def collect(self) -> Iterable[Metric]:
        statuses = self._statuses()
        labels = ["account", "environment"]
        exchanges = CounterMetricFamily(
            f"{PREFIX}_exchanges",
            "Token exchange attempts by reason and outcome.",
            labels=[*labels, "reason", "outcome"],
        )
        breaker_openings = CounterMetricFamily(
            f"{PREFIX}_breaker_openings", "Times exchanges were paused.", labels=[*labels, "kind"]
        )
        simple = {
            name: CounterMetricFamily(f"{PREFIX}_{name}", text, labels=labels)
            for name, text in _SIMPLE_COUNTERS.items()
        }
        time_left = GaugeMetricFamily(
            f"{PREFIX}_token_time_left_seconds",
            "Seconds before the stored token expires (0 when none).",
            labels=labels,
        )
        generation = GaugeMetricFamily(
            f"{PREFIX}_token_generation", "Generation of the stored token.", labels=labels
        )
        breaker_open = GaugeMetricFamily(
            f"{PREFIX}_breaker_open",
            "1 while token exchanges are paused, by reason.",
            labels=[*labels, "kind"],
        )
        last_hour = GaugeMetricFamily(
            f"{PREFIX}_exchanges_last_hour", "Exchange attempts in the last hour.", labels=labels
        )
        for name, status in sorted(statuses.items()):
            account = [name, status.environment]
            for key, value in status.counters.items():
                parts = key.split(":")
                if parts[0] == "exchanges" and len(parts) == 3:
                    exchanges.add_metric([*account, parts[1], parts[2]], value)
                elif parts[0] == "breaker_openings" and len(parts) == 2:
                    breaker_openings.add_metric([*account, parts[1]], value)
                elif key in simple:
                    simple[key].add_metric(account, value)
            time_left.add_metric(account, status.time_left or 0.0)
            generation.add_metric(account, status.generation or 0)
            last_hour.add_metric(account, status.exchanges_last_hour)
            for kind in ("rejected", "rate_limited", "unavailable"):
                is_open = status.breaker is not None and status.breaker["kind"] == kind
                breaker_open.add_metric([*account, kind], 1 if is_open else 0)
        yield from (exchanges, breaker_openings, *simple.values())
        yield from (time_left, generation, breaker_open, last_hour)
