"""The token store: one account's keys in Redis. With ``records`` (the account's breaker,
budget, counters and completion records), ``redis_commands`` (under both) and
``store_reading`` (many accounts' status at once) it is the only code that speaks to Redis.

Keys, under ``<prefix>:<environment>:<api key>:`` (``<prefix>:{<environment>:<api key>}:``
on a Redis Cluster: the hash tag keeps them in one slot, as the save script and the lock
need), all named by ``redis_commands.AccountKeys``:

- ``token``      the current token as JSON (value, issue and expiry times, generation, who
                 renewed and why, the renewal's trace context); its TTL is the token's
                 time left, so it expires with it; the value is sealed when a codec is
                 given (``sealing.py``)
- ``generation`` a counter that only grows; a write names the generation it replaces and
                 is refused if another write came first, so an older token never
                 overwrites a newer one
- ``lock``       the renewal lock; its value names the holding process (``renewal_lock``)
- ``breaker``    why exchanges are paused and until when (kept a while past the pause,
                 to count failures in a row)
- ``counters``   fleet-wide counters (``CounterName`` and the fields ``renewal_counter``,
                 ``attempt_counter`` and ``opening_counter`` make)
- ``exchanges``  the last day's exchange attempts (a sorted set by time), for rates
- ``accepted``   the highest generation the API accepted (evidence that a later 401 is a
                 revocation, docs/design.md "Refusals")
- ``forced``     forced renewals of the last period (a sorted set by time), the budget
- ``probe``      the half-open breaker's probe slot
- ``waits``      when each caller waiting for another's renewal began (and its limit); the
                 next write turns them into the lock-wait histogram (and its meter's)
- ``completed:<task id>`` a call's result (``completions``); ``renewal-sent`` beat's claim
- channel ``renewed``: the generation of each token written, to wake waiting processes

Every Redis error reaches callers as ``StoreUnavailable`` naming its cause (unreachable,
read-only replica, out of memory, a refused command). A corrupt or wrong-typed value in any
key reads as absent, is logged once naming the key, and the next write replaces it.

Times come from Redis's own clock (TIME), the one clock all hosts share: ``RedisClock``
reads it once a minute and advances it with the local monotonic clock in between, so the
hot path costs one GET and no TIME. See docs/design.md, "Keys".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import cast

from redis.client import PubSub
from redis.cluster import RedisCluster

from merchant_tasks import telemetry
from merchant_tasks.exceptions import StoreUnavailable
from merchant_tasks.renewal.policy import CounterName
from merchant_tasks.store import scripts
from merchant_tasks.store.keys import (
    CORRUPT,
    AccountKeys,
    AccountRedis,
    milliseconds,
    store_error,
    unavailable_as_error,
    wrong_type,
)
from merchant_tasks.store.records import AccountRecords, Histogram
from merchant_tasks.store.sealing import PLAIN_TEXT, TokenCodec
from merchant_tasks.store.topology import StoreClient
from merchant_tasks.token import Token

log = logging.getLogger(__name__)

MGET_CHUNK = 1000  # keys read by one command in beat's check, not one command each
CLOCK_RESYNC = 60.0  # seconds between reads of Redis TIME; monotonic drift is negligible
LOCK_WAIT_SECONDS = "lock_wait_seconds"  # from finding another's renewal under way to a
# token being stored: recorded by the store's write, not by the waiters
_LOCK_WAIT_ARGS = Histogram(LOCK_WAIT_SECONDS).script_args()  # the same for every write


class RedisClock:
    """Redis's clock, estimated locally between reads of TIME."""

    def __init__(
        self,
        read_time: Callable[[], float],
        monotonic: Callable[[], float] = time.monotonic,
        resync: float = CLOCK_RESYNC,
    ) -> None:
        self._read_time = read_time
        self._monotonic = monotonic
        self._resync = resync
        self._base: tuple[float, float] | None = None  # (redis time, monotonic) at the last read
        self._next_read = 0.0

    def __call__(self) -> float:
        """Redis's time now. Raises StoreUnavailable only if Redis was never reached."""
        mono = self._monotonic()
        if self._base is None or mono >= self._next_read:
            self._next_read = mono + self._resync
            try:
                before = self._monotonic()
                remote = self._read_time()
                after = self._monotonic()
            except StoreUnavailable:
                if self._base is None:
                    raise
            else:
                self._base = (remote, (before + after) / 2)  # read about mid round trip
        remote_then, mono_then = self._base
        return remote_then + (mono - mono_then)


class TokenStore:
    """One account's token, generation, acceptance and renewal lock; ``records`` holds its
    breaker, budget, counters and completion records. The manager, beat's check,
    completions, wake-ups, status and metrics reach Redis through it."""

    namespace_for = staticmethod(AccountKeys.namespace_for)

    def __init__(
        self,
        client: StoreClient,
        namespace: str,
        codec: TokenCodec = PLAIN_TEXT,
        account: str = "",
    ) -> None:
        self.namespace = namespace
        self.account = account  # the account's name (``accounts``), in telemetry
        self.keys = AccountKeys.of(namespace)
        self.codec = codec  # how the token value is kept at rest (sealing.py)
        self.commands = AccountRedis(client, self.keys)
        self.records: AccountRecords = AccountRecords(self.commands, account)
        self._parsed: tuple[bytes, Token] | None = None
        self._parsed_lock = threading.Lock()
        # the highest generation this process has seen stored: Redis may lose the last
        # writes in a failover (asynchronous replication), and a process that used a token
        # must never go back to an older one
        self._seen_generation = 0

    def __repr__(self) -> str:
        return f"TokenStore(namespace={self.namespace!r})"

    @property
    def redis(self) -> StoreClient:
        """The Redis client (wake-ups subscribe with it; tests swap it)."""
        return self.commands.client

    @redis.setter
    def redis(self, client: StoreClient) -> None:
        self.commands.client = client

    # -- the token ---------------------------------------------------------------------------

    def time(self) -> float:
        """Redis's clock, in seconds."""
        seconds, micros = self.commands.command(self.redis.time)
        return float(seconds + micros / 1e6)

    def load(self) -> Token | None:
        """The stored token, or None. One GET; an unchanged value is not parsed again.

        None too when the stored token is older than one this process has seen stored
        (Redis lost writes): it is renewed rather than used again.
        """
        key = self.keys.token
        return self.parse_token(self.commands.get(key, bytes, None))

    def parse_token(self, raw: bytes | None) -> Token | None:
        """The token a GET of its key read (``raw``), opened; see ``load``."""
        if raw is None:
            return None
        parsed = self._parsed
        if parsed is not None and parsed[0] == raw:
            token = parsed[1]
        else:
            try:
                token = Token.from_json(raw)
                token = replace(token, value=self.codec.open(token.value, self.namespace))
            except CORRUPT as exc:  # (a value in clear where a key seals them is a ValueError)
                self.commands.corrupt(self.keys.token, type(exc).__name__)
                return None
            with self._parsed_lock:
                self._parsed = (raw, token)
        if token.generation < self._seen_generation:
            return None
        if token.generation > self._seen_generation:
            self._see(token.generation)
        return token

    def look_after_401(
        self,
        refused_generation: int,
        lock_value: str | None,
        owner_prefix: str,
        lease: float,
        wait_limit: float,
        *,
        count: bool = True,
    ) -> tuple[Token | None, int]:
        """After a 401, in one round trip: count it (unless ``count`` is False: no new 401
        came, the call follows an earlier one), load the token and, if it is still the
        refused generation (or none is stored), try the renewal lock with ``lock_value``
        (None: a thread of this process holds it; only ``renewal_lock`` calls this).

        Returns the stored token and 1 (lock taken), 0 (not tried) or -1 (another holds
        it: the wait was noted, see ``note_wait``).
        """
        raw, outcome = self.commands.run(
            scripts.LOOK_AFTER_401,
            keys=[self.keys.token, self.keys.lock, self.keys.counters, self.keys.waits],
            args=[
                refused_generation,
                lock_value or "",
                owner_prefix,
                milliseconds(lease),
                CounterName.UNAUTHORIZED if count else "",
                CounterName.LOCK_WAITS,
                milliseconds(wait_limit),
            ],
        )
        return self.parse_token(raw), int(outcome)

    def generation(self) -> int:
        """The generation of the last token written (0 if none ever was), or the highest
        this process has seen stored if Redis has lost writes since."""
        key = self.keys.generation
        return max(self.commands.get(key, int, 0), self._seen_generation)

    def save(self, token: Token) -> tuple[bool, int]:
        """Write ``token`` if it is the successor of the stored generation.

        ``token.generation`` must be the stored generation plus one. Returns whether it was
        written and the generation now stored.
        """
        written, generation, *waits = self.commands.run(
            scripts.SAVE_IF_GENERATION,
            keys=[self.keys.token, self.keys.generation, self.keys.waits, self.keys.histograms],
            args=[
                token.generation - 1,
                replace(token, value=self.codec.seal(token.value, self.namespace)).to_json(),
                repr(token.kept_until),
                self._seen_generation,
                *_LOCK_WAIT_ARGS,
            ],
        )
        if written == 1:
            self._see(int(generation))
            for micros in waits:  # this process's meter gets the waits its write ended
                telemetry.observe_lock_wait(self.account, int(micros) / 1e6)
        return written == 1, int(generation)

    def _see(self, generation: int) -> None:
        with self._parsed_lock:
            self._seen_generation = max(self._seen_generation, generation)

    @property
    def seen_generation(self) -> int:
        """The highest generation this process has seen stored."""
        return self._seen_generation

    def announce(self, generation: int) -> bool:
        """Tell waiting processes that ``generation`` is stored. Best effort (they poll too):
        False if it could not be published (Redis down, or an ACL without the channel)."""
        try:
            self.commands.command(lambda: self.redis.publish(self.keys.renewed, str(generation)))
        except StoreUnavailable as exc:
            log.warning("could not announce a new token: %s", exc)
            return False
        return True

    def note_wait(self, stale_generation: int, wait_limit: float) -> bool:
        """Count a wait for another's renewal of ``stale_generation`` and note when it
        began, for the lock-wait histogram: the write that ends it records it, so a waiter
        sends no command for it. False, nothing noted, if a newer generation is stored."""
        noted = self.commands.run(
            scripts.NOTE_WAIT_UNLESS_RENEWED,
            keys=[self.keys.token, self.keys.counters, self.keys.waits],
            args=[stale_generation, CounterName.LOCK_WAITS, milliseconds(wait_limit)],
        )
        return bool(noted)

    def mark_accepted(self, generation: int) -> None:
        """Record that the API accepted a token of ``generation`` (no write if already known)."""
        self.commands.run(scripts.RAISE_ACCEPTED, keys=[self.keys.accepted], args=[generation])

    def accepted_generation(self) -> int:
        """The highest generation the API is known to have accepted (0: none ever)."""
        key = self.keys.accepted
        return self.commands.get(key, int, 0)

    # -- the renewal lock (``renewal_lock.RenewalLock`` is its only user) -----------------

    def take_lock(self, value: str, owner_prefix: str, lease: float) -> bool:
        args = [value, owner_prefix, milliseconds(lease)]
        return bool(self.commands.run(scripts.TAKE_LOCK, keys=[self.keys.lock], args=args))

    def extend_lock(self, value: str, lease: float) -> bool:
        args = [value, milliseconds(lease)]
        return bool(self.commands.run(scripts.EXTEND_LOCK, keys=[self.keys.lock], args=args))

    def release_lock(self, value: str) -> bool:
        return bool(self.commands.run(scripts.RELEASE_LOCK, keys=[self.keys.lock], args=[value]))

    def lock_holder(self) -> str | None:
        """Who holds the renewal lock, if anyone."""
        key = self.keys.lock
        return self.commands.get(key, bytes.decode, None)


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
    """A pub/sub connection of ``client``, for ``wakeup``'s subscriber thread."""
    # Redis and RedisCluster both make their own kind of PubSub here
    pubsub: PubSub = client.pubsub()  # type: ignore[no-untyped-call]
    return pubsub


def delete_key(client: StoreClient, key: str) -> None:
    with unavailable_as_error():
        client.delete(key)
