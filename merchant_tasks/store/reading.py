"""What `status` and the exporter read of an account: one account through its ``TokenStore``,
or thousands at once in a few round trips.

One account's reading is eight commands (TIME, the token, the breaker, the exchange log
twice, the lock, the counters and the histograms). `status` and every scrape read all the
configured accounts, so ``read_stored`` reads them per Redis client in 1 + ⌈N / PIPELINE_ACCOUNTS⌉
round trips: TIME and each token endpoint host's exchange rate first, then one pipeline per
PIPELINE_ACCOUNTS accounts, one script (``scripts.READ_ACCOUNTS``) per READ_BATCH of them
answering one JSON string. 10,000 accounts on one server cost 6 round trips, not 80,000,
and need no ``TokenStore`` built: a ``StoredAccount`` each (namespace, client, codec, and
the ``Replies`` that report its corrupt values once). Every reply reads as the account's
own store reads it (``token_store.stored_token``, ``stored_numbers``, ``Replies.reply``):
a corrupt or wrong-typed value as absent, logged once.

The reading is a flow (``_reading_flow``): it yields each round trip's commands and takes
their replies, so the blocking driver (``read_stored``) and the asyncio one
(``async_read_stored``) send the same commands and read them with the same code.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import redis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

from merchant_tasks.exceptions import TokenUnreadable
from merchant_tasks.flows import drive, drive_async
from merchant_tasks.store import scripts
from merchant_tasks.store.exchange_rate import ExchangeRate, RateState
from merchant_tasks.store.keys import Command, Replies, redis_address, unavailable_as_error
from merchant_tasks.store.sealing import TokenCodec
from merchant_tasks.store.token_store import (
    BreakerRecord,
    TokenStore,
    redis_seconds,
    stored_numbers,
    stored_token,
)
from merchant_tasks.store.topology import AsyncStoreClient, StoreClient
from merchant_tasks.token import Token

READ_BATCH = 100  # accounts one script reads (600 keys): its JSON is a few tens of kB,
# and a script holds the server only for about a millisecond
PIPELINE_ACCOUNTS = 2000  # accounts a pipeline reads (20 scripts): 10,000 accounts in
# 1 + 5 round trips, one pipeline's replies about 1 MB

Client = TypeVar("Client", StoreClient, AsyncStoreClient)
T = TypeVar("T")
Trip = list[Command[Any]]  # the commands of one round trip
Readings = tuple[dict[str, "AccountReading"], dict[str, RateState]]


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


@dataclass(frozen=True)
class StoredAccount(Generic[Client]):
    """What reading one account needs, without its ``TokenStore``: where its keys are
    (``replies.keys``), its Redis client, how its token is kept at rest, and its host's
    exchange rate (one object per host, shared by its accounts)."""

    name: str
    client: Client
    codec: TokenCodec
    replies: Replies  # reads its replies as its store does: corrupt values logged once
    rate: ExchangeRate


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


def read_stored(
    accounts: Iterable[StoredAccount[StoreClient]], windows: Sequence[float]
) -> Readings:
    """Every account's reading and its host's rate state, by name, blocking. Raises
    StoreUnavailable if a Redis cannot be read."""
    readings: dict[str, AccountReading] = {}
    rates: dict[str, RateState] = {}
    for client, group in _by_client(accounts).items():

        def send(trip: Any, client: StoreClient = client) -> Any:
            with unavailable_as_error(redis_address(client)):
                return _send(client, trip)

        clustered = isinstance(client, RedisCluster)
        found = drive(_reading_flow(group, windows, clustered=clustered), send)
        readings.update(found[0])
        rates.update(found[1])
    return readings, rates


async def async_read_stored(
    accounts: Iterable[StoredAccount[AsyncStoreClient]], windows: Sequence[float]
) -> Readings:
    """``read_stored`` with redis.asyncio clients."""
    readings: dict[str, AccountReading] = {}
    rates: dict[str, RateState] = {}
    for client, group in _by_client(accounts).items():

        async def send(trip: Any, client: AsyncStoreClient = client) -> Any:
            with unavailable_as_error(redis_address(client)):
                return await _async_send(client, trip)

        clustered = isinstance(client, AsyncRedisCluster)
        found = await drive_async(_reading_flow(group, windows, clustered=clustered), send)
        readings.update(found[0])
        rates.update(found[1])
    return readings, rates


def _by_client(
    accounts: Iterable[StoredAccount[Client]],
) -> dict[Client, list[StoredAccount[Client]]]:
    by_client: dict[Client, list[StoredAccount[Client]]] = {}
    for account in accounts:
        by_client.setdefault(account.client, []).append(account)
    return by_client


def _reading_flow(
    accounts: Sequence[StoredAccount[Any]], windows: Sequence[float], *, clustered: bool
) -> Generator[Trip, list[Any], Readings]:
    """The accounts of one Redis client: TIME and each host's rate in the first round trip
    (one clock for all: every account's windows end at the same moment), then their records,
    PIPELINE_ACCOUNTS a round trip; on a Redis Cluster one account a script (a script's keys
    must share a slot, and an account's do)."""
    hosts = list({id(account.rate): account.rate for account in accounts}.values())
    first: Trip = [Command.plain("TIME", parse=redis_seconds)]
    for rate in hosts:
        first += [rate.peek(), rate.counts()]
    replies = yield first
    reporter = accounts[0].replies
    now = reporter.reply("", replies[0], first[0].parse, 0.0)
    states: dict[int, RateState] = {}
    for n, rate in enumerate(hosts):
        peek, counts = first[1 + 2 * n : 3 + 2 * n]
        answer = rate.commands.reply(rate.key, replies[1 + 2 * n], peek.parse, peek.absent)
        counted = rate.commands.reply(rate.key, replies[2 + 2 * n], counts.parse, counts.absent)
        states[id(rate)] = rate.state_of(answer, counted)
    starts = [repr(now - window) for window in windows]
    per_script = 1 if clustered else READ_BATCH
    readings: dict[str, AccountReading] = {}
    for start in range(0, len(accounts), PIPELINE_ACCOUNTS):
        batch = accounts[start : start + PIPELINE_ACCOUNTS]
        groups = [batch[i : i + per_script] for i in range(0, len(batch), per_script)]
        trip = [_read_accounts(group, starts) for group in groups]
        replies = yield trip
        for group, command, raw in zip(groups, trip, replies, strict=True):
            rows = group[0].replies.reply(command.key, raw, command.parse, command.absent)
            for account, row in zip(group, rows, strict=True):
                readings[account.name] = _reading(account, now, row)
    return readings, {account.name: states[id(account.rate)] for account in accounts}


def _read_accounts(group: Sequence[StoredAccount[Any]], starts: list[str]) -> Command[list[Any]]:
    keys: list[str] = []
    for account in group:
        k = account.replies.keys
        keys += (k.token, k.breaker, k.lock, k.counters, k.histograms, k.exchange_log)
    return Command.script(scripts.READ_ACCOUNTS, keys, starts, _rows)


def _rows(raw: bytes) -> list[Any]:
    # surrogateescape: a value's bytes that are not UTF-8 come back as they were stored
    rows: list[Any] = json.loads(raw.decode("utf-8", "surrogateescape"))
    return rows


def _read(replies: Replies, key: str, item: Any, parse: Callable[[Any], T], absent: T) -> T:
    """``Replies.reply`` of one command's reply as the script encoded it (most keys of most
    accounts hold nothing: they read as absent at once)."""
    if item is False or item == {}:  # nothing, or an empty hash
        return absent
    if isinstance(item, str):
        raw: Any = item.encode("utf-8", "surrogateescape")
    elif isinstance(item, list):  # a hash, flat
        fields = [part.encode("utf-8", "surrogateescape") for part in item]
        raw = dict(zip(fields[::2], fields[1::2], strict=True))
    elif isinstance(item, dict):  # an error
        raw = redis.ResponseError(item["err"])
    else:  # a count
        raw = item
    return replies.reply(key, raw, parse, absent)


def _token(raw: bytes, account: StoredAccount[Any], replies: Replies) -> Token | None:
    """The stored token; one sealed with a key this process lacks as its record says it
    (its times and generation are in clear, its fingerprint is then the sealed value's):
    `status` needs no key (store.sealing), and one account mid key rotation failed the
    reading of every account."""
    try:
        return stored_token(raw, account.codec, replies)
    except TokenUnreadable:
        return Token.from_json(raw)


def _reading(account: StoredAccount[Any], now: float, row: list[Any]) -> AccountReading:
    token, breaker, lock, counters, histograms, *exchanges = row
    replies = account.replies
    keys = replies.keys
    raw_token = _read(replies, keys.token, token, bytes, None)
    return AccountReading(
        now=now,
        token=None if raw_token is None else _token(raw_token, account, replies),
        breaker=_read(replies, keys.breaker, breaker, BreakerRecord.from_json, None),
        exchanges=tuple(_read(replies, keys.exchange_log, n, int, 0) for n in exchanges),
        lock_holder=_read(replies, keys.lock, lock, bytes.decode, None),
        counters=stored_numbers(
            keys.counters, _read(replies, keys.counters, counters, dict, {}), replies
        ),
        histograms=stored_numbers(
            keys.histograms, _read(replies, keys.histograms, histograms, dict, {}), replies
        ),
    )


def _send(client: StoreClient, trip: Trip) -> list[Any]:
    """One round trip (a Cluster answers TIME apart: its pipelines refuse it)."""
    clustered = isinstance(client, RedisCluster)
    pipe = client.pipeline(transaction=False)
    sent = [command for command in trip if not (clustered and command.args[0] == "TIME")]
    for command in sent:
        pipe.execute_command(*command.args)
    clock = [client.time()] if len(sent) < len(trip) else []
    return [*clock, *pipe.execute(raise_on_error=False)]


async def _async_send(client: AsyncStoreClient, trip: Trip) -> list[Any]:
    clustered = isinstance(client, AsyncRedisCluster)
    pipe = client.pipeline(transaction=False)
    sent = [command for command in trip if not (clustered and command.args[0] == "TIME")]
    for command in sent:
        pipe.execute_command(*command.args)
    clock = [await client.time()] if len(sent) < len(trip) else []
    return [*clock, *await pipe.execute(raise_on_error=False)]
