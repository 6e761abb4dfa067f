"""One account's records in the token store: the breaker, the forced-renewal budget, the
half-open probe, the fleet-wide counters and histograms, and the completion records.

Reached as ``TokenStore.records``; the same ``redis_commands.AccountRedis`` types every
error and reads every corrupt value as absent (docs/design.md, "Keys").
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from merchant_tasks import telemetry
from merchant_tasks.exceptions import StoreUnavailable
from merchant_tasks.renewal.policy import BreakerKind, Outcome
from merchant_tasks.store import scripts
from merchant_tasks.store.keys import AccountRedis, milliseconds
from merchant_tasks.token import RenewalReason

log = logging.getLogger(__name__)

EXCHANGE_LOG_SPAN = 86400.0  # exchange times kept for `status` (last hour, last day)
# upper bounds (seconds) of the fleet-wide histograms: an exchange takes ~0.1-1 s, a wait
# for another process's exchange as long, up to the read timeout (10 s) and its retries
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
OVERFLOW = "+Inf"  # the bucket of durations above every bound (Prometheus's name for it)
_BOUNDS = [(bound, f"{bound:g}") for bound in DURATION_BUCKETS]  # seconds, and as fields say
BREAKER_MEMORY = 600.0  # a breaker record is kept this long past its pause, so that
# failures in a row are counted and the back-off grows; a success deletes it


def renewal_counter(reason: RenewalReason, outcome: Outcome) -> str:
    """The counter of renewals for ``reason`` that ended with ``outcome`` (one a renewal,
    however many HTTP attempts it made)."""
    return f"renewals:{reason}:{outcome}"


def attempt_counter(reason: RenewalReason, outcome: Outcome) -> str:
    """The counter of HTTP attempts at the token endpoint, made for a renewal for
    ``reason``, that ended with ``outcome``."""
    return f"exchange_attempts:{reason}:{outcome}"


def opening_counter(kind: BreakerKind) -> str:
    """The counter of breaker openings of ``kind``."""
    return f"breaker_openings:{kind}"


@dataclass(frozen=True)
class Histogram:
    """A fleet-wide duration histogram's fields in the account's ``histograms`` hash.

    ``<name>:le:<bound>`` counts the durations of that bucket (not cumulative; ``+Inf`` for
    longer ones; their total is the count) and ``<name>:sum_us`` adds them up in
    microseconds (integers only). The field names are made here only: the store's scripts
    get them as arguments (``script_args``) and only pick the bucket.
    """

    name: str

    def field(self, bound: str) -> str:
        """The field counting the durations of the bucket whose upper bound is ``bound``."""
        return f"{self.name}:le:{bound}"

    @property
    def sum_field(self) -> str:
        return f"{self.name}:sum_us"

    def script_args(self) -> list[str | int]:
        """ARGV for the scripts' ``observe``: the sum's field, the overflow bucket's field,
        then pairs of (upper bound in microseconds, field), bounds ascending."""
        args: list[str | int] = [self.sum_field, self.field(OVERFLOW)]
        for bound, label in _BOUNDS:
            args += [round(bound * 1e6), self.field(label)]
        return args

    def cumulative(self, raw: Mapping[str, int]) -> tuple[list[tuple[str, float]], float]:
        """Prometheus buckets (cumulative, ending with +Inf) and the sum in seconds, from
        the hash's fields ``raw``."""
        buckets: list[tuple[str, float]] = []
        running = 0
        for label in [*(label for _, label in _BOUNDS), OVERFLOW]:
            running += raw.get(self.field(label), 0)
            buckets.append((label, running))
        return buckets, raw.get(self.sum_field, 0) / 1e6


@dataclass(frozen=True)
class BreakerRecord:
    """Why token exchanges are paused fleet-wide, and until when (Redis time)."""

    kind: BreakerKind
    until: float
    failures: int = 1
    secret_fingerprint: str = ""  # "rejected", "refused": the secret in use; a new one ends it
    detail: str = ""  # the error's message, free of secrets by construction
    generation: int = 0  # for "refused": the refused token's generation

    @classmethod
    def from_json(cls, raw: bytes) -> BreakerRecord:
        data = json.loads(raw)
        record = cls(**{**data, "kind": BreakerKind(data["kind"])})
        if not math.isfinite(float(record.until)) or not isinstance(record.failures, int):
            raise ValueError("not a breaker record")
        return record


class AccountRecords:
    """Breaker, budget, probe, counters, histograms and completion records of one account."""

    def __init__(self, commands: AccountRedis, account: str = "") -> None:
        self.commands = commands
        self.account = account  # its name in this process's meters (telemetry)
        self.keys = commands.keys

    def __repr__(self) -> str:
        return f"AccountRecords(namespace={self.keys.namespace!r})"

    # -- breaker, budget, probe ------------------------------------------------------------

    def load_breaker(self) -> BreakerRecord | None:
        key = self.keys.breaker
        return self.commands.get(key, BreakerRecord.from_json, None)

    def open_breaker(self, record: BreakerRecord, now: float) -> None:
        """Store the breaker; it outlives ``record.until`` by BREAKER_MEMORY."""
        ttl_ms = milliseconds(record.until - now + BREAKER_MEMORY)
        self.commands.command(
            lambda: self.commands.client.set(
                self.keys.breaker, json.dumps(asdict(record)), px=ttl_ms
            )
        )

    def close_breaker(self) -> None:
        self.commands.command(lambda: self.commands.client.delete(self.keys.breaker))

    def forced_in_period(self, now: float, period: float) -> int:
        """Forced renewals logged in the ``period`` seconds before ``now``."""
        return int(
            self.commands.run(scripts.COUNT_RECENT, [self.keys.forced], [repr(now - period), ""])
        )

    def log_forced(self, now: float) -> None:
        """Log one forced renewal at ``now``, for the budget."""
        horizon = repr(now - EXCHANGE_LOG_SPAN)
        self.commands.run(scripts.COUNT_RECENT, [self.keys.forced], [horizon, f"{now:.6f}"])

    def take_probe(self, interval: float) -> bool:
        """The half-open probe slot, at most once per ``interval`` seconds fleet-wide."""
        args = [milliseconds(interval)]
        return bool(self.commands.run(scripts.TAKE_SLOT, keys=[self.keys.probe], args=args))

    # -- counters and histograms ---------------------------------------------------------

    def count(self, *events: str) -> None:
        """Add one to each named fleet-wide counter."""
        self._add(self.keys.counters, [(event, 1) for event in events])

    def _add(
        self,
        hash_key: str,
        increments: list[tuple[str, int]],
        logged: tuple[str, float] | None = None,
    ) -> None:
        """Add to fields of ``hash_key``; with ``logged`` (entry, time), also log the entry
        in the exchange log, which keeps the last EXCHANGE_LOG_SPAN seconds."""
        entry, at = logged if logged is not None else ("", 0.0)
        args: list[Any] = [entry, repr(at), repr(at - EXCHANGE_LOG_SPAN)]
        args += [x for increment in increments for x in increment]
        self.commands.run(scripts.COUNT, [hash_key, self.keys.exchange_log], args)

    def record_attempt(self, reason: RenewalReason, outcome: Outcome, now: float) -> None:
        """Count one HTTP attempt at the token endpoint, and log its time for rates."""
        telemetry.count_exchange_attempt(self.account, reason, outcome)
        counter = attempt_counter(reason, outcome)
        self._add(self.keys.counters, [(counter, 1)], logged=(f"{now:.6f}:{counter}", now))

    def record_renewal(self, reason: RenewalReason, outcome: Outcome) -> None:
        """Count one renewal (however many attempts it made) by reason and outcome."""
        telemetry.count_renewal(self.account, reason, outcome)
        self.count(renewal_counter(reason, outcome))

    def exchanges_since(self, since: float) -> int:
        """Exchange attempts (any outcome) since ``since``, within the last day."""
        key = self.keys.exchange_log
        return self.commands.read(
            key, lambda: self.commands.client.zcount(key, since, "+inf"), int, 0
        )

    def counters(self) -> dict[str, int]:
        return self._numbers(self.keys.counters)

    def _numbers(self, key: str) -> dict[str, int]:
        raw: dict[bytes, bytes] = self.commands.read(
            key, lambda: self.commands.client.hgetall(key), dict, {}
        )
        return self.numbers(key, raw)

    def numbers(self, key: str, raw: Mapping[bytes, bytes]) -> dict[str, int]:
        """The fields of hash ``key`` as read (``raw``), as integers; a field that is not
        one is left out (logged once)."""
        numbers = {}
        for field, value in raw.items():
            try:
                numbers[field.decode()] = int(value)
            except ValueError:
                self.commands.corrupt(key, f"field {field.decode(errors='replace')[:64]!r}")
        return numbers

    def observe(self, name: str, seconds: float) -> None:
        """Add one duration to the fleet-wide histogram ``name`` (see ``Histogram``).

        Best effort: a failure is logged, never raised, so it cannot fail what it measures.
        """
        micros = round(max(0.0, seconds) * 1e6)
        args = [micros, *Histogram(name).script_args()]
        try:
            self.commands.run(scripts.OBSERVE, [self.keys.histograms], args)
        except StoreUnavailable as exc:
            log.warning("could not record %s in Redis: %s", name, exc)

    def histograms(self) -> dict[str, int]:
        """The raw fields of every histogram (``Histogram``)."""
        return self._numbers(self.keys.histograms)

    # -- completion records ----------------------------------------------------------------

    def load_completion(self, task_id: str) -> dict[str, Any] | None:
        """The completion record of ``task_id`` (``{"result": ...}``), or None."""
        key = self.keys.completed(task_id)
        return self.commands.get(key, _completion, None)

    def save_completion(self, task_id: str, result: Any, ttl: float) -> None:
        payload = json.dumps({"result": result})
        key = self.keys.completed(task_id)
        self.commands.command(lambda: self.commands.client.set(key, payload, px=milliseconds(ttl)))


def _completion(raw: bytes) -> dict[str, Any]:
    record = json.loads(raw)
    return {"result": record["result"]}
