"""The token store: Redis keys for one account (environment and API key).

Keys, under ``<prefix>:<environment>:<api key>:`` (``<prefix>:{<environment>:<api key>}:``
on a Redis Cluster: the hash tag keeps them in one slot, as the save script and the lock need)

- ``token``      the current token as JSON (value, issue and expiry times, generation, who
                 renewed and why); its TTL is the token's time left, so it expires with it;
                 the value is sealed when a codec is given (``sealing.py``)
- ``generation`` a counter that only grows; a write names the generation it replaces and
                 is refused if another write came first, so an older token never
                 overwrites a newer one
- ``lock``       the renewal lock; its value names the holder
- ``breaker``    why exchanges are paused and until when (kept a while past the pause,
                 to count failures in a row)
- ``counters``   fleet-wide counters (exchanges by reason and outcome, 401s, lock waits)
- ``exchanges``  the last day's exchange attempts (a sorted set by time), for rates
- ``accepted``   the highest generation the API accepted (evidence that a later 401 is a
                 revocation, docs/design.md "Refusals")
- ``forced``     forced renewals of the last period (a sorted set by time), the budget
- ``probe``      the half-open breaker's probe slot
- ``waits``      when each caller waiting for another's renewal began (and its limit); the
                 next write turns them into the lock-wait histogram
- channel ``renewed``: the generation of each token written, to wake waiting processes

Times come from Redis's own clock (TIME), the one clock all hosts share: ``RedisClock``
reads it once a minute and advances it with the local monotonic clock in between, so the
hot path costs one GET and no TIME. See docs/design.md, "Keys".
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any, cast

import redis
from redis.exceptions import ClusterError, RedisClusterException
from redis.lock import Lock

from .exceptions import StoreUnavailable
from .redis_topology import StoreClient
from .sealing import PLAIN_TEXT, TokenCodec
from .token import Token

log = logging.getLogger(__name__)

CLOCK_RESYNC = 60.0  # seconds between reads of Redis TIME; monotonic drift is negligible
EXCHANGE_LOG_SPAN = 86400.0  # exchange times kept for `status` (last hour, last day)
# upper bounds (seconds) of the fleet-wide histograms: an exchange takes ~0.1-1 s, a wait
# for another process's exchange as long, up to the read timeout (10 s) and its retries
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LOCK_WAIT_SECONDS = "lock_wait_seconds"  # from finding another's renewal under way to a
# token being stored: recorded by the store's write, not by the waiters
_WAIT_BUCKETS = [x for b in DURATION_BUCKETS for x in (round(b * 1e6), f"{b:g}")]  # ARGV pairs
BREAKER_MEMORY = 600.0  # a breaker record is kept this long past its pause, so that
# failures in a row are counted and the back-off grows; a success deletes it

# What a caller that finds another's renewal under way adds: it counts the wait, and
# notes when it began and how long it may last, for the lock-wait histogram (below).
_NOTE_WAIT = """
local function note_wait(counters, counter, waits, limit_ms)
  redis.call('HINCRBY', counters, counter, 1)
  local now = redis.call('TIME')
  redis.call('RPUSH', waits, now[1] .. string.format('%06d', tonumber(now[2])) .. ':' .. limit_ms)
  redis.call('LTRIM', waits, -1000, -1)
  redis.call('PEXPIRE', waits, limit_ms)
end
"""

# KEYS: token, generation, waits, histograms. ARGV: expected generation, token JSON, kept
# until (Redis seconds), the highest generation the writer saw stored, the lock-wait
# histogram's name, then pairs of (bucket bound in microseconds, bucket label).
# Returns {1, new generation} when written, {0, current generation} when another write
# came first, {-1, expected generation} when the token has already expired. A stored
# generation below the expected one is accepted only when the writer saw the expected one
# stored: Redis lost writes (a failover, a restart without persistence), and the token is
# written above them. A write ends the noted waits: each one that has not outlasted its
# limit goes into the histogram, from its start to now, so a waiter sends nothing more.
_SAVE_IF_GENERATION = """
local current = tonumber(redis.call('GET', KEYS[2]) or '0')
local expected = tonumber(ARGV[1])
if current ~= expected and not (current < expected and expected <= tonumber(ARGV[4])) then
  return {0, current}
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local ttl_ms = math.floor(tonumber(ARGV[3]) * 1000) - now_ms
if ttl_ms <= 0 then return {-1, expected} end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ttl_ms)
redis.call('SET', KEYS[2], expected + 1)
local waits = redis.call('LRANGE', KEYS[3], 0, -1)
if #waits > 0 then
  redis.call('DEL', KEYS[3])
  local now_us = tonumber(now[1]) * 1000000 + tonumber(now[2])
  for _, wait in ipairs(waits) do
    local since, limit_ms = string.match(wait, '^(%d+):(%d+)$')
    local waited = since and now_us - tonumber(since)
    if waited and waited >= 0 and waited <= tonumber(limit_ms) * 1000 then
      local label = '+Inf'
      for i = 6, #ARGV, 2 do
        if waited <= tonumber(ARGV[i]) then label = ARGV[i + 1]; break end
      end
      redis.call('HINCRBY', KEYS[4], ARGV[5] .. ':le:' .. label, 1)
      redis.call('HINCRBY', KEYS[4], ARGV[5] .. ':sum_us', waited)
    end
  end
end
return {1, expected + 1}
"""

# KEYS: token, counters, waits. ARGV: the generation the caller found stale, the lock-wait
# counter, the wait's limit (ms). Notes the wait unless a token of a newer generation is
# stored (the renewal ended before this caller could wait for it): 1 noted, 0 not. With no
# token stored (a new process, an expired token) the wait is noted whatever it last saw.
_NOTE_WAIT_UNLESS_RENEWED = (
    _NOTE_WAIT
    + """
local raw = redis.call('GET', KEYS[1])
if raw and tonumber(cjson.decode(raw)['generation']) > tonumber(ARGV[1]) then return 0 end
note_wait(KEYS[2], ARGV[2], KEYS[3], ARGV[3])
return 1
"""
)

# KEYS: accepted. ARGV: generation. Raises the key to ARGV[1]: one write per generation.
_RAISE_ACCEPTED = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) <= current then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""

# KEYS: token, lock, counters, waits. ARGV: refused generation, owner, lock TTL (ms), the
# 401 counter, the lock-wait counter, the wait's limit (ms). Counts the 401 and reads the
# token; when the stored token is the refused one (or none is stored), tries the renewal
# lock for ARGV[2], and notes the wait if another holds it.
# Returns {token JSON or nil, 1: lock taken, 0: not tried, -1: held by another (noted)}.
_LOOK_AFTER_401 = (
    _NOTE_WAIT
    + """
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
local raw = redis.call('GET', KEYS[1])
if raw and tonumber(cjson.decode(raw)['generation']) ~= tonumber(ARGV[1]) then
  return {raw, 0}
end
if redis.call('SET', KEYS[2], ARGV[2], 'NX', 'PX', ARGV[3]) then return {raw, 1} end
note_wait(KEYS[3], ARGV[5], KEYS[4], ARGV[6])
return {raw, -1}
"""
)


@dataclass(frozen=True)
class BreakerRecord:
    """Why token exchanges are paused fleet-wide, and until when (Redis time)."""

    kind: str  # a breaker.BreakerKind
    until: float
    failures: int = 1
    secret_fingerprint: str = ""  # for "rejected": the secret that was refused
    detail: str = ""  # the error's message, free of secrets by construction


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
    """Reads and writes one account's token, lock, breaker and counters in Redis."""

    def __init__(self, client: StoreClient, namespace: str, codec: TokenCodec = PLAIN_TEXT) -> None:
        self.redis = client
        self.namespace = namespace
        self.codec = codec  # how the token value is kept at rest (sealing.py)
        self.address = redis_address(client)  # for error messages: host only, no password
        self.token_key = f"{namespace}:token"
        self.generation_key = f"{namespace}:generation"
        self.lock_key = f"{namespace}:lock"
        self.breaker_key = f"{namespace}:breaker"
        self.counters_key = f"{namespace}:counters"
        self.histograms_key = f"{namespace}:histograms"
        self.exchange_log_key = f"{namespace}:exchanges"
        self.accepted_key = f"{namespace}:accepted"
        self.forced_key = f"{namespace}:forced"
        self.probe_key = f"{namespace}:probe"
        self.waits_key = f"{namespace}:waits"
        self.renewed_channel = f"{namespace}:renewed"
        self._parsed: tuple[bytes, Token] | None = None
        self._parsed_lock = threading.Lock()
        # the highest generation this process has seen stored: Redis may lose the last
        # writes in a failover (asynchronous replication), and a process that used a token
        # must never go back to an older one
        self._seen_generation = 0

    @staticmethod
    def namespace_for(
        prefix: str, environment: str, api_key: str, *, hash_tag: bool = False
    ) -> str:
        """The account's key namespace; with ``hash_tag`` (Redis Cluster), its keys share
        one hash slot, as the save script and the lock need."""
        if hash_tag:
            return f"{prefix}:{{{environment}:{api_key}}}"
        return f"{prefix}:{environment}:{api_key}"

    def __repr__(self) -> str:
        return f"TokenStore(namespace={self.namespace!r})"

    def time(self) -> float:
        """Redis's clock, in seconds."""
        with unavailable_as_error(self.address):
            seconds, micros = self.redis.time()
        return seconds + micros / 1e6

    def load(self) -> Token | None:
        """The stored token, or None. One GET; an unchanged value is not parsed again.

        None too when the stored token is older than one this process has seen stored
        (Redis lost writes): it is renewed rather than used again.
        """
        with unavailable_as_error(self.address):
            raw = cast(bytes | None, self.redis.get(self.token_key))
        return self._parse(raw)

    def _parse(self, raw: bytes | None) -> Token | None:
        if raw is None:
            return None
        parsed = self._parsed
        if parsed is not None and parsed[0] == raw:
            token = parsed[1]
        else:
            token = Token.from_json(raw)
            token = replace(token, value=self.codec.open(token.value, self.namespace))
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
        owner: str,
        lock_ttl: float,
        unauthorized_counter: str,
        wait_counter: str,
        wait_limit: float,
    ) -> tuple[Token | None, Lock | None, bool]:
        """After a 401, in one round trip: count it (in ``unauthorized_counter``), load the
        token and, if it is still the refused generation (or none is stored), try the renewal
        lock.

        Returns the stored token, the lock if it was taken, and whether another holds it
        (then the wait was noted, see ``note_wait``).
        """
        with unavailable_as_error():
            raw, outcome = cast(
                list[Any],
                self._run(
                    _LOOK_AFTER_401,
                    keys=[self.token_key, self.lock_key, self.counters_key, self.waits_key],
                    args=[
                        refused_generation,
                        owner,
                        int(lock_ttl * 1000),
                        unauthorized_counter,
                        wait_counter,
                        _milliseconds(wait_limit),
                    ],
                ),
            )
        lock = None
        if outcome == 1:
            lock = self.lock(lock_ttl)
            # redis-py's Lock keeps its owner token here; set as its acquire() would
            lock.local.token = owner.encode()
        return self._parse(raw), lock, outcome == -1

    def generation(self) -> int:
        """The generation of the last token written (0 if none ever was), or the highest
        this process has seen stored if Redis has lost writes since."""
        with unavailable_as_error(self.address):
            raw = self.redis.get(self.generation_key)
        stored = int(cast(bytes, raw)) if raw is not None else 0
        return max(stored, self._seen_generation)

    def save(self, token: Token) -> tuple[bool, int]:
        """Write ``token`` if it is the successor of the stored generation.

        ``token.generation`` must be the stored generation plus one. Returns whether it was
        written and the generation now stored.
        """
        with unavailable_as_error(self.address):
            result = cast(
                list[int],
                self._run(
                    _SAVE_IF_GENERATION,
                    keys=[self.token_key, self.generation_key, self.waits_key, self.histograms_key],
                    args=[
                        token.generation - 1,
                        self._stored_form(token),
                        repr(token.kept_until),
                        self._seen_generation,
                        LOCK_WAIT_SECONDS,
                        *_WAIT_BUCKETS,
                    ],
                ),
            )
        written, generation = int(result[0]), int(result[1])
        if written == 1:
            self._see(generation)
        return written == 1, generation

    def _see(self, generation: int) -> None:
        with self._parsed_lock:
            self._seen_generation = max(self._seen_generation, generation)

    def _stored_form(self, token: Token) -> str:
        return replace(token, value=self.codec.seal(token.value, self.namespace)).to_json()

    def announce(self, generation: int) -> bool:
        """Tell waiting processes that ``generation`` is stored. Best effort (they poll too):
        False if it could not be published (Redis down, or an ACL without the channel)."""
        try:
            self.redis.publish(self.renewed_channel, str(generation))
        except redis.RedisError as exc:
            log.warning("could not announce a new token: %s", type(exc).__name__)
            return False
        return True

    def note_wait(self, stale_generation: int, wait_counter: str, wait_limit: float) -> bool:
        """Count a wait for another's renewal of ``stale_generation`` (in ``wait_counter``)
        and note when it began, for the lock-wait histogram: the write that ends it records
        it, so a waiter sends no command for it. False, nothing noted, if a newer
        generation is already stored."""
        with unavailable_as_error(self.address):
            noted = self._run(
                _NOTE_WAIT_UNLESS_RENEWED,
                keys=[self.token_key, self.counters_key, self.waits_key],
                args=[stale_generation, wait_counter, _milliseconds(wait_limit)],
            )
        return bool(noted)

    @property
    def seen_generation(self) -> int:
        """The highest generation this process has seen stored."""
        return self._seen_generation

    def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        """Run one of this module's scripts, sent whole (EVAL), not by digest (EVALSHA).

        They run a few times a renewal, never on the hot path; after a Redis restart or
        failover the server's script cache is empty, and a digest would cost every process
        two more commands (NOSCRIPT, SCRIPT LOAD) in the very storm that follows.
        """
        return self.redis.eval(script, len(keys), *keys, *args)

    def mark_accepted(self, generation: int) -> None:
        """Record that the API accepted a token of ``generation`` (no write if already known)."""
        with unavailable_as_error():
            self._run(_RAISE_ACCEPTED, keys=[self.accepted_key], args=[generation])

    def accepted_generation(self) -> int:
        """The highest generation the API is known to have accepted (0: none ever)."""
        with unavailable_as_error():
            raw = self.redis.get(self.accepted_key)
        return int(cast(bytes, raw)) if raw is not None else 0

    def forced_in_period(self, now: float, period: float) -> int:
        """Forced renewals logged in the ``period`` seconds before ``now``."""
        with unavailable_as_error():
            pipe = self.redis.pipeline(transaction=False)
            pipe.zremrangebyscore(self.forced_key, "-inf", now - period)
            pipe.zcount(self.forced_key, now - period, "+inf")
            count = pipe.execute()[1]
        return int(count)

    def log_forced(self, now: float) -> None:
        """Log one forced renewal at ``now``, for the budget."""
        with unavailable_as_error():
            self.redis.zadd(self.forced_key, {f"{now:.6f}": now})

    def take_probe(self, interval: float) -> bool:
        """The half-open probe slot, at most once per ``interval`` seconds fleet-wide."""
        with unavailable_as_error():
            return bool(self.redis.set(self.probe_key, b"1", nx=True, px=int(interval * 1000)))

    def lock(self, ttl: float) -> Lock:
        """The renewal lock (redis-py's: owner token, TTL, release only by its owner)."""
        return Lock(self.redis, self.lock_key, timeout=ttl, blocking=False, thread_local=False)

    def lock_holder(self) -> str | None:
        """Who holds the renewal lock, if anyone."""
        with unavailable_as_error(self.address):
            raw = self.redis.get(self.lock_key)
        return cast(bytes, raw).decode() if raw is not None else None

    def load_breaker(self) -> BreakerRecord | None:
        with unavailable_as_error(self.address):
            raw = self.redis.get(self.breaker_key)
        if raw is None:
            return None
        data: dict[str, Any] = json.loads(cast(bytes, raw))
        return BreakerRecord(**data)

    def open_breaker(self, record: BreakerRecord, now: float) -> None:
        """Store the breaker; it outlives ``record.until`` by BREAKER_MEMORY."""
        ttl_ms = max(1, int((record.until - now + BREAKER_MEMORY) * 1000))
        with unavailable_as_error(self.address):
            self.redis.set(self.breaker_key, json.dumps(asdict(record)), px=ttl_ms)

    def close_breaker(self) -> None:
        with unavailable_as_error(self.address):
            self.redis.delete(self.breaker_key)

    def count(self, *events: str) -> None:
        """Add one to each named fleet-wide counter."""
        with unavailable_as_error(self.address):
            pipe = self.redis.pipeline(transaction=False)
            for event in events:
                pipe.hincrby(self.counters_key, event, 1)
            pipe.execute()

    def record_exchange(self, reason: str, outcome: str, now: float) -> None:
        """Count one exchange attempt by reason and outcome, and log its time for rates."""
        with unavailable_as_error(self.address):
            pipe = self.redis.pipeline(transaction=False)
            pipe.hincrby(self.counters_key, f"exchanges:{reason}:{outcome}", 1)
            pipe.zadd(self.exchange_log_key, {f"{now:.6f}:{reason}:{outcome}": now})
            pipe.zremrangebyscore(self.exchange_log_key, "-inf", now - EXCHANGE_LOG_SPAN)
            pipe.execute()

    def exchanges_since(self, since: float) -> int:
        """Exchange attempts (any outcome) since ``since``, within the last day."""
        with unavailable_as_error(self.address):
            return int(self.redis.zcount(self.exchange_log_key, since, "+inf"))

    def counters(self) -> dict[str, int]:
        with unavailable_as_error(self.address):
            raw = cast(dict[bytes, bytes], self.redis.hgetall(self.counters_key))
        return {k.decode(): int(v) for k, v in raw.items()}

    def observe(self, name: str, seconds: float) -> None:
        """Add one duration to the fleet-wide histogram ``name`` (buckets DURATION_BUCKETS).

        Kept as ``name:le:<bound>`` counts (not cumulative; ``+Inf`` for longer ones; their
        total is the count) and ``name:sum_us`` (microseconds: HINCRBY only, no float
        command): two commands an observation.
        Best effort: a failure is logged, never raised, so it cannot fail what it measures.
        """
        bound = next((f"{b:g}" for b in DURATION_BUCKETS if seconds <= b), "+Inf")
        pipe = self.redis.pipeline(transaction=False)
        pipe.hincrby(self.histograms_key, f"{name}:le:{bound}", 1)
        pipe.hincrby(self.histograms_key, f"{name}:sum_us", round(max(0.0, seconds) * 1e6))
        try:
            pipe.execute()
        except redis.RedisError as exc:
            log.warning("could not record %s in Redis: %s", name, type(exc).__name__)

    def histograms(self) -> dict[str, int]:
        """The raw fields written by ``observe``."""
        with unavailable_as_error(self.address):
            raw = cast(dict[bytes, bytes], self.redis.hgetall(self.histograms_key))
        return {k.decode(): int(v) for k, v in raw.items()}


def _milliseconds(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def redis_address(client: object) -> str:
    """Where a client connects (host:port or socket path), never its user or password."""
    pool = getattr(client, "connection_pool", None)  # a cluster client has one per node
    kwargs = getattr(pool, "connection_kwargs", None)
    if not isinstance(kwargs, dict):
        return "MERCHANT_REDIS_URL"
    if kwargs.get("path"):
        return str(kwargs["path"])
    return f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"


@contextmanager
def unavailable_as_error(address: str | None = None) -> Iterator[None]:
    """Redis's connection errors as StoreUnavailable, naming ``address`` (host:port);
    shared by every module that talks to the account's Redis."""
    where = f"Redis at {address}" if address else "Redis"
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError, ClusterError, RedisClusterException) as exc:
        raise StoreUnavailable(
            f"token store ({where}) unavailable: {type(exc).__name__}; check MERCHANT_REDIS_URL"
        ) from exc
