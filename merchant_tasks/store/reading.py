"""What `status` and the exporter read of an account: one account through its ``TokenStore``,
or thousands at once in a few round trips.

One account's reading is eight commands (TIME, the token, the breaker, the exchange log
twice, the lock, the counters and the histograms). `status` and every scrape read all the
configured accounts, so ``read_many`` sends the same commands pipelined instead:
STATUS_BATCH accounts a pipeline, the accounts of one Redis client sharing its pipelines,
after one TIME. 10,000 accounts on one server then cost 11 round trips, not 80,000, and
need no client (HTTP session, manager) built: their stores only. The replies are parsed
by the same code as one account's reads, so a corrupt or wrong-typed value reads as
absent (logged once) here too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.client import Pipeline
from redis.cluster import ClusterPipeline

from merchant_tasks.store.keys import AccountKeys, unavailable_as_error
from merchant_tasks.store.token_store import BreakerRecord, TokenStore
from merchant_tasks.token import Token

STATUS_BATCH = 1000  # accounts per pipeline (7,000 commands): the round trips stay few
# (11 for 10,000 accounts) while one batch's replies stay a few MB


@dataclass(frozen=True)
class AccountReading:
    """One account's records at one moment (Redis time), as `status` shows them."""

    now: float
    token: Token | None
    breaker: BreakerRecord | None  # as stored: possibly past its pause (``ops.status``)
    exchanges: tuple[int, ...]  # exchange attempts in each of the windows before ``now``
    lock_holder: str | None
    counters: dict[str, int]
    histograms: dict[str, int]


def read_one(store: TokenStore, windows: Sequence[float]) -> AccountReading:
    """One account's reading, a command at a time, from a ``TokenStore``."""
    now = store.time()
    return AccountReading(
        now=now,
        token=store.load(),
        breaker=store.records.load_breaker(),
        exchanges=tuple(store.records.exchanges_since(now - window) for window in windows),
        lock_holder=store.lock_holder(),
        counters=store.records.counters(),
        histograms=store.records.histograms(),
    )


def read_many(
    stores: Mapping[str, TokenStore], windows: Sequence[float]
) -> dict[str, AccountReading]:
    """Every account's reading by name: one TIME and one pipeline per STATUS_BATCH
    accounts for each Redis client the stores use. Raises StoreUnavailable if one cannot
    be read."""
    by_client: dict[int, list[str]] = {}
    for name, store in stores.items():
        by_client.setdefault(id(store.redis), []).append(name)
    readings: dict[str, AccountReading] = {}
    for names in by_client.values():
        readings.update(_read_on_server({name: stores[name] for name in names}, windows))
    return {name: readings[name] for name in stores}


def _read_on_server(
    stores: Mapping[str, TokenStore], windows: Sequence[float]
) -> dict[str, AccountReading]:
    first = next(iter(stores.values()))
    client = first.redis
    now = first.time()  # one clock for all: every account's windows end at the same moment
    names = list(stores)
    readings: dict[str, AccountReading] = {}
    for start in range(0, len(names), STATUS_BATCH):
        batch = names[start : start + STATUS_BATCH]
        pipe = client.pipeline(transaction=False)
        for name in batch:
            _queue(pipe, stores[name].keys, now, windows)
        with unavailable_as_error(first.commands.address):
            replies = pipe.execute(raise_on_error=False)
        per_account = len(replies) // len(batch)
        for i, name in enumerate(batch):
            mine = replies[i * per_account : (i + 1) * per_account]
            readings[name] = _reading(stores[name], now, mine)
    return readings


def _queue(
    pipe: Pipeline | ClusterPipeline, keys: AccountKeys, now: float, windows: Sequence[float]
) -> None:
    """One account's commands, in the order ``_reading`` takes their replies."""
    pipe.get(keys.token)
    pipe.get(keys.breaker)
    pipe.get(keys.lock)
    pipe.hgetall(keys.counters)
    pipe.hgetall(keys.histograms)
    for window in windows:
        pipe.zcount(keys.exchange_log, now - window, "+inf")


def _reading(store: TokenStore, now: float, replies: list[Any]) -> AccountReading:
    token, breaker, lock, counters, histograms, *exchanges = replies
    keys, reply = store.keys, store.commands.reply
    return AccountReading(
        now=now,
        token=store.parse_token(reply(keys.token, token, bytes, None)),
        breaker=reply(keys.breaker, breaker, BreakerRecord.from_json, None),
        exchanges=tuple(reply(keys.exchange_log, count, int, 0) for count in exchanges),
        lock_holder=reply(keys.lock, lock, bytes.decode, None),
        counters=store.records.numbers(keys.counters, reply(keys.counters, counters, dict, {})),
        histograms=store.records.numbers(
            keys.histograms, reply(keys.histograms, histograms, dict, {})
        ),
    )
