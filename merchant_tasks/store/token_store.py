"""The token store: one account's keys in Redis, and the records kept beside its token.

``TokenStore`` holds the token, its generation, its acceptance and the renewal lock;
``AccountRecords``, reached as ``TokenStore.records``, the breaker (``BreakerRecord``,
read by ``open_breaker`` and ``paused``), the forced renewals' spacing, the half-open probe,
the fleet-wide counters and histograms, and the completion records. Both go through one
``store.keys.AccountRedis``, which types every error and reads every corrupt value as
absent. With ``store.keys`` and ``store.reading`` (many accounts' status at once) this is
the only code that speaks to Redis.

Keys, under ``<prefix>:<environment>:<api key>:`` (``<prefix>:{<environment>:<api key>}:``
on a Redis Cluster: the hash tag keeps them in one slot, as the save script and the lock
need), all named by ``store.keys.AccountKeys``:

- ``token``      the current token as JSON (value, issue and expiry times, generation, who
                 renewed and why, the renewal's trace context); its TTL is the token's
                 time left, so it expires with it; the value is sealed when a codec is
                 given (``store.sealing``)
- ``generation`` a counter that only grows; a write names the generation it replaces and
                 is refused if another write came first, so an older token never
                 overwrites a newer one
- ``lock``       the renewal lock; its value names the holding process (``renewal.life``)
- ``breaker``    why exchanges are paused and until when (kept a while past the pause,
                 to count failures in a row)
- ``counters``   fleet-wide counters (``CounterName`` and the fields ``renewal_counter``,
                 ``attempt_counter`` and ``opening_counter`` make)
- ``exchanges``  the last day's exchange attempts (a sorted set by time), for rates
- ``accepted``   the highest generation the API accepted (evidence that a later 401 is a
                 revocation, docs/design.md "Refusals")
- ``forced``     the times reserved for forced renewals (a sorted set), spaced fleet-wide
- ``probe``      the half-open breaker's probe slot
- ``waits``      when each caller waiting for another's renewal began (and its limit); the
                 next write turns them into the lock-wait histogram (and its meter's)
- ``completed:<task id>`` a call's result (``worker.completions``); ``renewal-sent`` beat's claim
- channel ``renewed``: the generation of each token written, to wake waiting processes

Every Redis error reaches callers as ``StoreUnavailable`` naming its cause (unreachable,
read-only replica, out of memory, a refused command). A corrupt or wrong-typed value in any
key reads as absent, is logged once naming the key, and the next write replaces it.

Times come from Redis's own clock (TIME), the one clock all hosts share: ``RedisClock``
reads it once a minute and advances it with the local monotonic clock in between, so the
hot path costs one GET and no TIME. See docs/design.md, "Keys".
"""

from __future__ import annotations

import functools
import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Generic, TypeVar, cast

from redis.client import PubSub
from redis.cluster import RedisCluster

from merchant_tasks import telemetry
from merchant_tasks.exceptions import StoreUnavailable
from merchant_tasks.store import scripts
from merchant_tasks.store.keys import (
    CORRUPT,
    AccountKeys,
    AccountRedis,
    Command,
    Replies,
    milliseconds,
    store_error,
    unavailable_as_error,
    wrong_type,
)
from merchant_tasks.store.sealing import PLAIN_TEXT, TokenCodec
from merchant_tasks.store.topology import StoreClient
from merchant_tasks.token import (
    ROUTES_KEPT,
    BreakerKind,
    CounterName,
    Outcome,
    RenewalReason,
    Token,
)

T = TypeVar("T")
ClientT = TypeVar("ClientT")
SenderT = TypeVar("SenderT", bound=Replies)

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
    since: float = 0.0  # when the failures in a row began (Redis time; 0: not recorded)
    misrouted: bool = False  # "unavailable": the endpoint answered as no token endpoint does

    @classmethod
    def from_json(cls, raw: bytes) -> BreakerRecord:
        data = json.loads(raw)
        record = cls(**{**data, "kind": BreakerKind(data["kind"])})
        if not math.isfinite(float(record.until)) or not isinstance(record.failures, int):
            raise ValueError("not a breaker record")
        return record


MGET_CHUNK = 1000  # keys read by one command in beat's check, not one command each
CLOCK_RESYNC = 60.0  # seconds between reads of Redis TIME; monotonic drift is negligible
LOCK_WAIT_SECONDS = "lock_wait_seconds"  # from finding another's renewal under way to a
# token being stored: recorded by the store's write, not by the waiters
_LOCK_WAIT_ARGS = Histogram(LOCK_WAIT_SECONDS).script_args()  # the same for every write
EXCHANGE_SECONDS = "exchange_seconds"  # one token exchange attempt, any outcome
HISTOGRAMS = {
    EXCHANGE_SECONDS: "Seconds one token exchange attempt took, any outcome.",
    LOCK_WAIT_SECONDS: "Seconds from a caller finding another's renewal under way to a token "
    "being stored.",
}


def redis_seconds(reply: tuple[int, int]) -> float:
    """Redis's TIME reply (seconds, microseconds) as seconds."""
    seconds, micros = reply
    return float(int(seconds) + int(micros) / 1e6)


class TokenCommands:
    """Every command of one account's token and records, as a value (``store.keys.Command``):
    what the renewal's flows yield and its drivers send, blocking or asyncio. Builds and
    reads, sends nothing. It also keeps what this process has seen stored: the highest
    generation (Redis may lose the last writes in a failover, and a process that used a
    token must never go back to an older one) and the last token parsed."""

    def __init__(
        self, replies: Replies, namespace: str, codec: TokenCodec = PLAIN_TEXT, account: str = ""
    ) -> None:
        self.replies = replies  # where corrupt values are reported, once per key
        self.namespace = namespace
        self.keys = AccountKeys.of(namespace)
        self.codec = codec  # how the token value is kept at rest (store.sealing)
        self.account = account  # the account's name (``accounts``), in telemetry
        self._parsed: tuple[bytes, Token] | None = None
        self._parsed_lock = threading.Lock()
        self._seen_generation = 0

    def __repr__(self) -> str:
        return f"TokenCommands(namespace={self.namespace!r})"

    # -- the token -----------------------------------------------------------------------

    def time(self) -> Command[float]:
        """Redis's clock, in seconds."""
        return Command.plain("TIME", parse=redis_seconds)

    def load(self) -> Command[Token | None]:
        """The stored token, or None (see ``parse_token``)."""
        return Command.get(self.keys.token, self._token_or_none, None)

    def _token_or_none(self, raw: bytes) -> Token | None:
        return self.parse_token(raw)

    def parse_token(self, raw: bytes | None) -> Token | None:
        """The token a GET of its key read (``raw``), opened; an unchanged value is not
        parsed again. None too when it is older than one this process has seen stored
        (Redis lost writes): it is renewed rather than used again."""
        if raw is None:
            return None
        parsed = self._parsed
        if parsed is not None and parsed[0] == raw:
            token = parsed[1]
        else:
            opened = stored_token(raw, self.codec, self.replies)
            if opened is None:
                return None
            token = opened
            with self._parsed_lock:
                self._parsed = (raw, token)
        if token.generation < self._seen_generation:
            return None
        if token.generation > self._seen_generation:
            self._see(token.generation)
        return token

    def generation(self) -> Command[int]:
        """The generation of the last token written (0 if none ever was), or the highest
        this process has seen stored if Redis has lost writes since (or evicted the
        counter: the stored token's generation counts, as in the save script)."""
        seen = self._seen_generation
        return Command.get(self.keys.generation, lambda raw: max(int(raw), seen), seen)

    def look_after_401(
        self,
        refused_generation: int,
        lock_value: str | None,
        owner_prefix: str,
        lease: float,
        wait_limit: float,
        *,
        route: str = "",
        count: bool = True,
        mark: bool | None = None,
        judged: bool = False,
    ) -> Command[tuple[Token | None, int]]:
        """After a 401 on ``route``, in one round trip: count it (unless ``count`` is False:
        no new 401 came, the call follows an earlier one), load the token; if it is still
        the refused generation and its record names ``route`` (not ``judged`` already),
        nothing more (what the 401 means is judged from the record first); else mark its
        record refused on ``route`` (``mark``, as ``count`` unless given) and, if it is still
        the refused generation (or none is stored), try the renewal lock with ``lock_value``
        (None: do not take it).

        Returns the stored token and 1 (lock taken), 0 (not tried), -1 (another holds it:
        the wait was noted, see ``note_wait``) or 2 (the record names the route).
        """
        return Command.script(
            scripts.LOOK_AFTER_401,
            [self.keys.token, self.keys.lock, self.keys.counters, self.keys.waits],
            [
                refused_generation,
                lock_value or "",
                owner_prefix,
                milliseconds(lease),
                CounterName.UNAUTHORIZED if count else "",
                CounterName.LOCK_WAITS,
                milliseconds(wait_limit),
                route,
                "1" if (count if mark is None else mark) else "",
                "1" if judged else "",
            ],
            lambda reply: (self.parse_token(reply[0] or None), int(reply[1])),
        )

    def judge_route(self, generation: int, route: str, until: float) -> Command[Token | None]:
        """Record in token ``generation``'s record what a 401 on ``route`` means: it lacks
        a permission (``until`` 0) or its calls are held back until ``until``; the record
        as it is now."""
        return Command.script(
            scripts.JUDGE_ROUTE,
            [self.keys.token],
            [generation, route, repr(until)],
            lambda raw: self.parse_token(raw or None),
        )

    def save(self, token: Token, issuer: str = "") -> Command[tuple[bool, int]]:
        """Write ``token`` if it is the successor of the stored generation (its generation
        must be the stored one plus one); ``issuer``, the fingerprint of the endpoint that
        issued it, is kept as evidence that it issues this account's tokens. The reply:
        whether it was written, and the generation now stored."""
        sealed = replace(token, value=self.codec.seal(token.value, self.namespace))
        keys = self.keys
        return Command.script(
            scripts.SAVE_IF_GENERATION,
            [keys.token, keys.generation, keys.waits, keys.histograms, keys.issuer],
            [
                token.generation - 1,
                sealed.to_json(),
                repr(token.kept_until),
                self._seen_generation,
                issuer,
                *_LOCK_WAIT_ARGS,
            ],
            self._saved,
        )

    def _saved(self, reply: list[Any]) -> tuple[bool, int]:
        written, generation, *waits = reply
        if written == 1:
            self._see(int(generation))
            for micros in waits:  # this process's meter gets the waits its write ended
                telemetry.observe_lock_wait(self.account, int(micros) / 1e6)
        return written == 1, int(generation)

    def issuer(self) -> Command[str]:
        """The fingerprint of the token endpoint that issued the account's last token
        ("" : none recorded)."""
        return Command.get(self.keys.issuer, bytes.decode, "")

    def _see(self, generation: int) -> None:
        with self._parsed_lock:
            self._seen_generation = max(self._seen_generation, generation)

    @property
    def seen_generation(self) -> int:
        """The highest generation this process has seen stored."""
        return self._seen_generation

    def announce(self, generation: int) -> Command[Any]:
        """Tell waiting processes that ``generation`` is stored."""
        return Command.plain("PUBLISH", self.keys.renewed, str(generation))

    def note_wait(self, stale_generation: int, wait_limit: float) -> Command[bool]:
        """Count a wait for another's renewal of ``stale_generation`` and note when it
        began, for the lock-wait histogram: the write that ends it records it, so a waiter
        sends no command for it. False, nothing noted, if a newer generation is stored."""
        return Command.script(
            scripts.NOTE_WAIT_UNLESS_RENEWED,
            [self.keys.token, self.keys.counters, self.keys.waits],
            [stale_generation, CounterName.LOCK_WAITS, milliseconds(wait_limit)],
            bool,
        )

    def mark_accepted(self, generation: int, route: str = "") -> Command[Token | None]:
        """Record that the API accepted a token of ``generation`` (on ``route``), in its own
        record (and in the ``accepted`` key older releases read); writes what changes. The
        record as it is now, if it is of that generation."""
        keys = [self.keys.accepted, self.keys.token]
        return Command.script(
            scripts.RAISE_ACCEPTED,
            keys,
            [generation, route, ROUTES_KEPT],
            lambda raw: self.parse_token(raw or None),
        )

    def accepted_generation(self) -> Command[int]:
        """The highest generation the API is known to have accepted (0: none ever)."""
        return Command.get(self.keys.accepted, int, 0)

    # -- the renewal lock (``renewal.life`` decides, drivers send) ------------------------

    def take_lock(self, value: str, owner_prefix: str, lease: float) -> Command[bool]:
        args = [value, owner_prefix, milliseconds(lease)]
        return Command.script(scripts.TAKE_LOCK, [self.keys.lock], args, bool)

    def extend_lock(self, value: str, lease: float) -> Command[bool]:
        args = [value, milliseconds(lease)]
        return Command.script(scripts.EXTEND_LOCK, [self.keys.lock], args, bool)

    def release_lock(self, value: str) -> Command[bool]:
        return Command.script(scripts.RELEASE_LOCK, [self.keys.lock], [value], bool)

    def lock_holder(self) -> Command[str | None]:
        """Who holds the renewal lock, if anyone."""
        return Command.get(self.keys.lock, bytes.decode, None)

    # -- breaker, forced renewals, probe ---------------------------------------------------

    def load_breaker(self) -> Command[BreakerRecord | None]:
        return Command.get(self.keys.breaker, BreakerRecord.from_json, None)

    def open_breaker(self, record: BreakerRecord, now: float) -> Command[Any]:
        """Store the breaker; it outlives ``record.until`` by BREAKER_MEMORY."""
        ttl_ms = milliseconds(record.until - now + BREAKER_MEMORY)
        return Command.plain("SET", self.keys.breaker, json.dumps(asdict(record)), "PX", ttl_ms)

    def close_breaker(self) -> Command[Any]:
        return Command.plain("DEL", self.keys.breaker)

    def reserve_forced(self, interval: float, tolerance: float) -> Command[float]:
        """Reserve the next forced renewal, fleet-wide: one per ``interval`` seconds, with
        ``tolerance`` seconds of them at once (``scripts.SPACE_FORCED``); the seconds its
        renewer waits for it."""
        args = [milliseconds(interval), int(tolerance * 1000), milliseconds(EXCHANGE_LOG_SPAN)]
        return Command.script(
            scripts.SPACE_FORCED, [self.keys.forced], args, lambda ms: int(ms) / 1000
        )

    def forced_in_period(self, now: float, period: float) -> Command[int]:
        """Forced renewals reserved in the ``period`` seconds before ``now``."""
        args = [repr(now - period), ""]
        return Command.script(scripts.COUNT_RECENT, [self.keys.forced], args, int)

    def log_forced(self, now: float) -> Command[Any]:
        """Log one forced renewal at ``now``."""
        args = [repr(now - EXCHANGE_LOG_SPAN), f"{now:.6f}"]
        return Command.script(scripts.COUNT_RECENT, [self.keys.forced], args)

    def take_probe(self, interval: float) -> Command[bool]:
        """The half-open probe slot, at most once per ``interval`` seconds fleet-wide."""
        args = [milliseconds(interval)]
        return Command.script(scripts.TAKE_SLOT, [self.keys.probe], args, bool)

    # -- counters and histograms -----------------------------------------------------------

    def count(self, *events: str) -> Command[Any]:
        """Add one to each named fleet-wide counter."""
        return self._add(self.keys.counters, [(event, 1) for event in events])

    def _add(
        self,
        hash_key: str,
        increments: list[tuple[str, int]],
        logged: tuple[str, float] | None = None,
    ) -> Command[Any]:
        """Add to fields of ``hash_key``; with ``logged`` (entry, time), also log the entry
        in the exchange log, which keeps the last EXCHANGE_LOG_SPAN seconds."""
        entry, at = logged if logged is not None else ("", 0.0)
        args: list[Any] = [entry, repr(at), repr(at - EXCHANGE_LOG_SPAN)]
        args += [x for increment in increments for x in increment]
        return Command.script(scripts.COUNT, [hash_key, self.keys.exchange_log], args)

    def record_attempt(self, reason: RenewalReason, outcome: Outcome, now: float) -> Command[Any]:
        """Count one HTTP attempt at the token endpoint, and log its time for rates."""
        telemetry.count_exchange_attempt(self.account, reason, outcome)
        counter = attempt_counter(reason, outcome)
        return self._add(self.keys.counters, [(counter, 1)], logged=(f"{now:.6f}:{counter}", now))

    def record_renewal(self, reason: RenewalReason, outcome: Outcome) -> Command[Any]:
        """Count one renewal (however many attempts it made) by reason and outcome."""
        telemetry.count_renewal(self.account, reason, outcome)
        return self.count(renewal_counter(reason, outcome))

    def exchanges_since(self, since: float) -> Command[int]:
        """Exchange attempts (any outcome) since ``since``, within the last day."""
        key = self.keys.exchange_log
        return Command(("ZCOUNT", key, since, "+inf"), int, key, 0)

    def counters(self) -> Command[dict[str, int]]:
        return self._numbers(self.keys.counters)

    def histograms(self) -> Command[dict[str, int]]:
        """The raw fields of every histogram (``Histogram``)."""
        return self._numbers(self.keys.histograms)

    def _numbers(self, key: str) -> Command[dict[str, int]]:
        return Command(("HGETALL", key), lambda raw: self.numbers(key, raw), key, {})

    def numbers(self, key: str, raw: Mapping[bytes, bytes]) -> dict[str, int]:
        return stored_numbers(key, raw, self.replies)

    def observe(self, name: str, seconds: float) -> Command[Any]:
        """Add one duration to the fleet-wide histogram ``name`` (see ``Histogram``)."""
        micros = round(max(0.0, seconds) * 1e6)
        args = [micros, *Histogram(name).script_args()]
        return Command.script(scripts.OBSERVE, [self.keys.histograms], args)

    # -- completion records ----------------------------------------------------------------

    def load_completion(self, task_id: str) -> Command[dict[str, Any] | None]:
        """The completion record of ``task_id`` (``{"result": ...}``), or None."""
        return Command.get(self.keys.completed(task_id), _completion, None)

    def save_completion(self, task_id: str, result: Any, ttl: float) -> Command[Any]:
        payload = json.dumps({"result": result})
        key = self.keys.completed(task_id)
        return Command.plain("SET", key, payload, "PX", milliseconds(ttl))


def _completion(raw: bytes) -> dict[str, Any]:
    record = json.loads(raw)
    return {"result": record["result"]}


def stored_token(raw: bytes, codec: TokenCodec, replies: Replies) -> Token | None:
    """The token a read of its key found (``raw``), opened with ``codec``; None when it is
    corrupt (logged once by ``replies``). ``TokenCommands.parse_token`` and `status`'s
    reading of many accounts (``store.reading``) both read a token through this."""
    try:
        token = Token.from_json(raw)
        value = codec.open(token.value, replies.keys.namespace)
        return token if value == token.value else replace(token, value=value)
    except CORRUPT as exc:  # (a value in clear where a key seals them is a ValueError)
        replies.corrupt(replies.keys.token, type(exc).__name__)
        return None


def stored_numbers(key: str, raw: Mapping[bytes, bytes], replies: Replies) -> dict[str, int]:
    """The fields of hash ``key`` as read (``raw``), as integers; a field that is not one
    is left out (logged once by ``replies``)."""
    numbers = {}
    for field, value in raw.items():
        try:
            numbers[field.decode()] = int(value)
        except ValueError:
            replies.corrupt(key, f"field {field.decode(errors='replace')[:64]!r}")
    return numbers


class AccountRecords:
    """Breaker, forced renewals, probe, counters, histograms and completion records of one
    account, each command sent at once (``TokenCommands`` builds them)."""

    def __init__(self, redis: AccountRedis, ask: TokenCommands) -> None:
        self.commands = redis
        self.ask = ask
        self.account = ask.account  # its name in this process's meters (telemetry)
        self.keys = ask.keys

    def __repr__(self) -> str:
        return f"AccountRecords(namespace={self.keys.namespace!r})"

    def load_breaker(self) -> BreakerRecord | None:
        return self.commands.send(self.ask.load_breaker())

    def open_breaker(self, record: BreakerRecord, now: float) -> None:
        self.commands.send(self.ask.open_breaker(record, now))

    def close_breaker(self) -> None:
        self.commands.send(self.ask.close_breaker())

    def forced_in_period(self, now: float, period: float) -> int:
        return self.commands.send(self.ask.forced_in_period(now, period))

    def log_forced(self, now: float) -> None:
        self.commands.send(self.ask.log_forced(now))

    def reserve_forced(self, interval: float, tolerance: float = 0.0) -> float:
        return self.commands.send(self.ask.reserve_forced(interval, tolerance))

    def take_probe(self, interval: float) -> bool:
        return self.commands.send(self.ask.take_probe(interval))

    def count(self, *events: str) -> None:
        self.commands.send(self.ask.count(*events))

    def record_attempt(self, reason: RenewalReason, outcome: Outcome, now: float) -> None:
        self.commands.send(self.ask.record_attempt(reason, outcome, now))

    def record_renewal(self, reason: RenewalReason, outcome: Outcome) -> None:
        self.commands.send(self.ask.record_renewal(reason, outcome))

    def exchanges_since(self, since: float) -> int:
        return self.commands.send(self.ask.exchanges_since(since))

    def counters(self) -> dict[str, int]:
        return self.commands.send(self.ask.counters())

    def histograms(self) -> dict[str, int]:
        return self.commands.send(self.ask.histograms())

    def load_completion(self, task_id: str) -> dict[str, Any] | None:
        return self.commands.send(self.ask.load_completion(task_id))

    def save_completion(self, task_id: str, result: Any, ttl: float) -> None:
        self.commands.send(self.ask.save_completion(task_id, result, ttl))


class RedisClock:
    """Redis's clock, estimated locally between reads of TIME: the reading (``at``) and when
    to read again (``due``) are here, the read itself is the caller's (blocking:
    ``__call__``; asyncio: ``store.async_store``)."""

    def __init__(
        self,
        read_time: Callable[[], float] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        resync: float = CLOCK_RESYNC,
    ) -> None:
        self._read_time = read_time
        self.monotonic = monotonic
        self._resync = resync
        self._base: tuple[float, float] | None = None  # (redis time, monotonic) at the last read
        self._next_read = 0.0

    def due(self, mono: float) -> bool:
        """Whether Redis's TIME should be read again at ``mono`` (claims the read)."""
        if self._base is None or mono >= self._next_read:
            self._next_read = mono + self._resync
            return True
        return False

    def read(self, remote: float, before: float, after: float) -> None:
        """A reading of TIME (``remote``), sent at ``before`` and answered at ``after``."""
        self._base = (remote, (before + after) / 2)  # read about mid round trip

    def at(self, mono: float) -> float:
        """Redis's time at ``mono``; StoreUnavailable if it was never read."""
        if self._base is None:
            raise StoreUnavailable("token store: Redis's clock was never read")
        remote_then, mono_then = self._base
        return remote_then + (mono - mono_then)

    def __call__(self) -> float:
        """Redis's time now. Raises StoreUnavailable only if Redis was never reached."""
        assert self._read_time is not None, "a blocking clock needs read_time"
        mono = self.monotonic()
        if self.due(mono):
            try:
                before = self.monotonic()
                remote = self._read_time()
                self.read(remote, before, self.monotonic())
            except StoreUnavailable:
                if self._base is None:
                    raise
        return self.at(mono)


class AccountStore(Generic[ClientT, SenderT]):
    """One account's store, blocking (``TokenStore``) or asyncio (``store.async_store``'s
    ``AsyncTokenStore``): its keys, its commands (``ask``) and what sends them
    (``commands``, made by ``sender`` over the client)."""

    def __init__(
        self,
        client: ClientT,
        namespace: str,
        codec: TokenCodec = PLAIN_TEXT,
        account: str = "",
    ) -> None:
        self.namespace = namespace
        self.account = account  # the account's name (``accounts``), in telemetry
        self.keys = AccountKeys.of(namespace)
        self.codec = codec
        self.commands = self.sender(client, self.keys)
        self.ask = TokenCommands(self.commands, namespace, codec, account)

    def sender(self, client: ClientT, keys: AccountKeys) -> SenderT:
        """What sends the account's commands with ``client``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(namespace={self.namespace!r})"


class TokenStore(AccountStore[StoreClient, AccountRedis]):
    """One account's token, generation, acceptance and renewal lock; ``records`` holds its
    breaker, counters and completion records. Each method sends the command of the same
    name of ``ask`` (``TokenCommands``, what the renewal's flows yield) and returns its
    reply. Beat's check, completions and wake-ups reach Redis through it (status and metrics
    read many accounts at once: ``store.reading``)."""

    namespace_for = staticmethod(AccountKeys.namespace_for)

    def sender(self, client: StoreClient, keys: AccountKeys) -> AccountRedis:
        return AccountRedis(client, keys)

    @functools.cached_property
    def records(self) -> AccountRecords:
        return AccountRecords(self.commands, self.ask)

    @property
    def redis(self) -> StoreClient:
        """The Redis client (wake-ups subscribe with it; tests swap it)."""
        return self.commands.client

    @redis.setter
    def redis(self, client: StoreClient) -> None:
        self.commands.client = client

    def send(self, command: Command[T]) -> T:
        """Send one of ``ask``'s commands and read its reply."""
        return self.commands.send(command)

    def time(self) -> float:
        return self.send(self.ask.time())

    def load(self) -> Token | None:
        return self.send(self.ask.load())

    def parse_token(self, raw: bytes | None) -> Token | None:
        return self.ask.parse_token(raw)

    def generation(self) -> int:
        return self.send(self.ask.generation())

    def save(self, token: Token, issuer: str = "") -> tuple[bool, int]:
        return self.send(self.ask.save(token, issuer))

    @property
    def seen_generation(self) -> int:
        return self.ask.seen_generation

    def note_wait(self, stale_generation: int, wait_limit: float) -> bool:
        return self.send(self.ask.note_wait(stale_generation, wait_limit))

    def mark_accepted(self, generation: int, route: str = "") -> None:
        self.send(self.ask.mark_accepted(generation, route))

    def accepted_generation(self) -> int:
        return self.send(self.ask.accepted_generation())

    def take_lock(self, value: str, owner_prefix: str, lease: float) -> bool:
        return self.send(self.ask.take_lock(value, owner_prefix, lease))

    def extend_lock(self, value: str, lease: float) -> bool:
        return self.send(self.ask.extend_lock(value, lease))

    def release_lock(self, value: str) -> bool:
        return self.send(self.ask.release_lock(value))

    def lock_holder(self) -> str | None:
        return self.send(self.ask.lock_holder())


def read_values(client: StoreClient, keys: list[str]) -> tuple[float, list[bytes | None]]:
    """Redis's time and the string value of each key, in one round trip (beat's due check);
    a key of the wrong type reads as absent or empty. Keys go by MGET_CHUNK per script
    (``READ_STRINGS``; one GET each on a Cluster, whose slots a script may not span):
    10,000 GETs cost more to pack and parse than the round trip itself."""
    pipe = client.pipeline(transaction=False)
    clustered = isinstance(client, RedisCluster)  # its pipelines refuse TIME: read it apart
    if clustered:
        for key in keys:
            pipe.get(key)
    else:
        pipe.time()
        for start in range(0, len(keys), MGET_CHUNK):
            chunk = keys[start : start + MGET_CHUNK]
            pipe.eval(scripts.READ_STRINGS, len(chunk), *chunk)
    with unavailable_as_error():
        clock = [client.time()] if clustered else []
        replies = [*clock, *pipe.execute(raise_on_error=False)]
    for reply in replies:
        if isinstance(reply, Exception) and not wrong_type(reply):
            raise store_error(reply) from reply
    seconds, micros = cast(tuple[int, int], replies[0])
    found = replies[1:] if clustered else [raw for chunk in replies[1:] for raw in chunk]
    values = [b"" if wrong_type(raw) else cast(bytes | None, raw) for raw in found]
    return seconds + micros / 1e6, values


def claim_slots(client: StoreClient, slots: list[tuple[str, float]]) -> list[bool]:
    """SET NX each (key, lifetime) in one round trip; whether each was taken."""
    pipe = client.pipeline(transaction=False)
    for key, ttl in slots:
        pipe.set(key, b"1", nx=True, px=milliseconds(ttl))
    with unavailable_as_error():
        return [bool(won) for won in pipe.execute()]


def open_subscription(client: StoreClient) -> PubSub:
    """A pub/sub connection of ``client``, for ``store.wakeup``'s subscriber thread."""
    # Redis and RedisCluster both make their own kind of PubSub here
    pubsub: PubSub = client.pubsub()  # type: ignore[no-untyped-call]
    return pubsub


def delete_key(client: StoreClient, key: str) -> None:
    with unavailable_as_error():
        client.delete(key)


def open_breaker(store: TokenStore, now: float) -> BreakerRecord | None:
    """The breaker record while its pause runs at ``now`` (Redis time)."""
    return paused(store.records.load_breaker(), now)


def paused(record: BreakerRecord | None, now: float) -> BreakerRecord | None:
    """``record`` while its pause runs at ``now``; a record kept past its pause only
    remembers failures in a row, and reads as closed."""
    return record if record is not None and record.until > now else None


def breaker_states(store: TokenStore) -> list[tuple[BreakerKind, int]]:
    """Each kind with 1 if the breaker paused now is of that kind, else 0: the exporter's
    ``breaker_open`` of one account, for the meter's gauge (``telemetry.watch_breaker``)."""
    record = open_breaker(store, store.time())
    return [(kind, int(record is not None and record.kind == kind)) for kind in BreakerKind]
