"""Prometheus metrics for the whole fleet, read from Redis at scrape time.

The counters live in Redis, not in any process, so one scrape of one exporter
(`merchant-tasks metrics`) sees the numbers of every worker and every prefork child; there
is no per-process registry to merge.

Every counter has a sample for every account from the first scrape (0 until the first
event), so an ``increase()`` alert fires on the first event too. When Redis cannot be read
the scrape still answers (HTTP 200): ``merchant_tasks_up`` is 0 and
``merchant_tasks_scrape_error{type}`` names the error, instead of a 500 that reads like
the exporter itself were broken.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from merchant_tasks.exceptions import MerchantError
from merchant_tasks.ops.status import AccountStatus
from merchant_tasks.store.token_store import (
    HISTOGRAMS,
    Histogram,
    attempt_counter,
    opening_counter,
    renewal_counter,
)
from merchant_tasks.token import BreakerKind, CounterName, Outcome, RenewalReason

PREFIX = "merchant_tasks"
# counters kept in Redis (TokenStore.records.count) that are not per-exchange: name -> help
_SIMPLE_COUNTERS: dict[CounterName, str] = {
    CounterName.UNAUTHORIZED: "Calls answered 401 that asked the store for a newer token.",
    CounterName.FORCED_RENEWALS: "Forced renewals after a 401 that went on to an exchange.",
    CounterName.LOCK_WAITS: "Renewals that waited for another process holding the lock.",
    CounterName.NEVER_ACCEPTED: "Back-offs opened over tokens refused on their first use in a row.",
    CounterName.REDELIVERED: "Redelivered calls that had already succeeded: answered "
    "from their completion record, the API not called again.",
}
_LABELS = ["account", "environment"]


class FleetCollector(Collector):
    """Turns each account's status into metric families at every scrape."""

    def __init__(self, statuses: Callable[[], Mapping[str, AccountStatus]]) -> None:
        self._statuses = statuses

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily(f"{PREFIX}_up", "1 when the fleet's Redis could be read.")
        error = GaugeMetricFamily(
            f"{PREFIX}_scrape_error",
            "1 for the error that kept this scrape from reading Redis.",
            labels=["type"],
        )
        try:
            statuses = self._statuses()
        except MerchantError as exc:  # StoreUnavailable, ConfigurationError of an account
            up.add_metric([], 0)
            error.add_metric([type(exc).__name__], 1)
            yield from (up, error)
            return
        up.add_metric([], 1)
        yield from (up, error)
        yield from _families(statuses)


def _families(statuses: Mapping[str, AccountStatus]) -> Iterable[Metric]:
    renewals = CounterMetricFamily(
        f"{PREFIX}_renewals",
        "Renewals by reason and outcome: one each, however many HTTP attempts it made.",
        labels=[*_LABELS, "reason", "outcome"],
    )
    attempts = CounterMetricFamily(
        f"{PREFIX}_exchange_attempts",
        "HTTP requests to the token endpoint, by the renewal's reason and their outcome.",
        labels=[*_LABELS, "reason", "outcome"],
    )
    breaker_openings = CounterMetricFamily(
        f"{PREFIX}_breaker_openings", "Times exchanges were paused.", labels=[*_LABELS, "kind"]
    )
    simple = {
        name: CounterMetricFamily(f"{PREFIX}_{name}", text, labels=_LABELS)
        for name, text in _SIMPLE_COUNTERS.items()
    }
    histograms = {
        name: HistogramMetricFamily(f"{PREFIX}_{name}", text, labels=_LABELS)
        for name, text in HISTOGRAMS.items()
    }
    time_left = GaugeMetricFamily(
        f"{PREFIX}_token_time_left_seconds",
        "Seconds before the stored token expires (0 when none).",
        labels=_LABELS,
    )
    generation = GaugeMetricFamily(
        f"{PREFIX}_token_generation", "Generation of the stored token.", labels=_LABELS
    )
    breaker_open = GaugeMetricFamily(
        f"{PREFIX}_breaker_open",
        "1 while token exchanges are paused, by reason.",
        labels=[*_LABELS, "kind"],
    )
    for name, status in sorted(statuses.items()):
        account = [name, status.environment]
        counts = status.counters
        for reason in RenewalReason:
            for outcome in Outcome:
                labels = [*account, reason, outcome]
                renewals.add_metric(labels, counts.get(renewal_counter(reason, outcome), 0))
                attempts.add_metric(labels, counts.get(attempt_counter(reason, outcome), 0))
        for kind in BreakerKind:
            breaker_openings.add_metric([*account, kind], counts.get(opening_counter(kind), 0))
            is_open = status.breaker is not None and status.breaker["kind"] == kind
            breaker_open.add_metric([*account, kind], 1 if is_open else 0)
        for counter, family in simple.items():
            family.add_metric(account, counts.get(counter, 0))
        for histogram, histogram_family in histograms.items():
            buckets, total = Histogram(histogram).cumulative(status.histograms)
            histogram_family.add_metric(account, buckets, total)
        time_left.add_metric(account, status.time_left or 0.0)
        generation.add_metric(account, status.generation or 0)
    yield from (renewals, attempts, breaker_openings, *simple.values(), *histograms.values())
    yield from (time_left, generation, breaker_open)
    yield from _rate_families(statuses)


_RATE_COUNTERS = {
    "waited": ("exchange_permits_waited", "Exchange permits given after a wait, per host."),
    "gave_up": (
        "exchange_permits_refused",
        "Exchanges refused a permit within the wait (ExchangesThrottled), per host.",
    ),
    "cuts": ("exchange_rate_halvings", "Times a 429 halved the host's exchange rate."),
}


def _rate_families(statuses: Mapping[str, AccountStatus]) -> Iterable[Metric]:
    """The token endpoint hosts' exchange rates, once per host (accounts share them)."""
    rates = {s.exchange_rate["host"]: s.exchange_rate for s in statuses.values() if s.exchange_rate}
    rate = GaugeMetricFamily(
        f"{PREFIX}_exchange_rate",
        "Token exchanges a second the fleet may send to the host now (the cap, or less "
        "after a 429).",
        labels=["host"],
    )
    cap = GaugeMetricFamily(
        f"{PREFIX}_exchange_rate_cap", "MERCHANT_MAX_EXCHANGES_PER_SECOND.", labels=["host"]
    )
    counters = {
        field: CounterMetricFamily(f"{PREFIX}_{name}", text, labels=["host"])
        for field, (name, text) in _RATE_COUNTERS.items()
    }
    for host, state in sorted(rates.items()):
        rate.add_metric([host], state["rate"])
        cap.add_metric([host], state["cap"])
        for field, family in counters.items():
            family.add_metric([host], state["counts"].get(field, 0))
    yield from (rate, cap, *counters.values())
