"""One account's Redis commands, under the token store and its records
(``store.token_store``): every key name made from the account's namespace (``AccountKeys``), every
command a value (``Command``: what is sent, and how its reply reads) that redis-py
(``AccountRedis.send``) or redis.asyncio (``store.async_store``) sends, every Redis error typed
(``StoreUnavailable`` naming the cause), every corrupt or wrong-typed value read as absent
and logged once. docs/design.md, "Seams".
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

import redis
from redis.exceptions import RedisClusterException

from merchant_tasks.exceptions import StoreRefusingWrites, StoreUnavailable
from merchant_tasks.store.topology import StoreClient

log = logging.getLogger(__name__)

CORRUPT = (ValueError, KeyError, TypeError, AttributeError, RecursionError)  # parsing garbage
REDIS_ERRORS = (redis.RedisError, RedisClusterException)  # whatever a Redis client raises

T = TypeVar("T")


_KEY_OF = {"exchange_log": "exchanges", "renewal_sent": "renewal-sent"}  # field -> key, where
# they differ (the names in Redis never change: a fleet upgraded mid-flight keeps its keys)


@dataclass(frozen=True)
class AccountKeys:
    """Every key of one account, made from its namespace here and nowhere else."""

    namespace: str
    token: str
    generation: str
    lock: str
    breaker: str
    counters: str
    histograms: str
    exchange_log: str
    accepted: str
    forced: str
    probe: str
    waits: str
    renewal_sent: str
    issuer: str
    renewed: str  # a channel

    @classmethod
    def of(cls, namespace: str) -> AccountKeys:
        """The keys under ``namespace``: ``<namespace>:<field>``, but for the fields below."""
        keys = cls.__new__(cls)
        # the fields set at once, not by a frozen __setattr__ each: `status` of 10,000
        # accounts makes 10,000 (20 ms so, 30 ms through __init__)
        made = [namespace, *[f"{namespace}:{key}" for key in _KEYS]]
        keys.__dict__.update(zip(_FIELDS, made, strict=True))
        return keys

    @staticmethod
    def namespace_for(
        prefix: str, environment: str, api_key: str, *, hash_tag: bool = False
    ) -> str:
        """The account's key namespace; with ``hash_tag`` (Redis Cluster), its keys share
        one hash slot, as the save script and the lock need."""
        if hash_tag:
            return f"{prefix}:{{{environment}:{api_key}}}"
        return f"{prefix}:{environment}:{api_key}"

    @staticmethod
    def exchange_rate(prefix: str, host: str) -> str:
        """The fleet-wide exchange rate of the token endpoint ``host`` (``store.exchange_rate``),
        shared by every account on it: one key, hash-tagged so that it names its own slot
        on a Redis Cluster."""
        return f"{prefix}:{{exchange-rate:{host}}}"

    def completed(self, task_id: str) -> str:
        """The completion record of call ``task_id`` (``worker.completions``)."""
        return f"{self.namespace}:completed:{task_id}"


# each field's key under the namespace, in the fields' order (`status` of 10,000 accounts
# makes 10,000 AccountKeys: the fields are listed once, not at each)
_FIELDS = [key.name for key in dataclasses.fields(AccountKeys)]
_KEYS = [_KEY_OF.get(name, name) for name in _FIELDS[1:]]


def _same(reply: Any) -> Any:
    return reply


@dataclass(frozen=True)
class Command(Generic[T]):
    """One Redis command of an account as a value: the arguments sent (``args``, as
    ``execute_command`` takes them), and how its reply reads (``parse``; ``absent`` when
    ``key`` holds nothing, or something corrupt or of the wrong type). The renewal's flows
    yield these and a driver sends them, blocking (``AccountRedis.send``) or asyncio
    (``store.async_store``): one command, written once, for both."""

    args: tuple[Any, ...] = field(repr=False)  # a token being saved, in clear without a key
    parse: Callable[[Any], T]
    key: str
    absent: T

    @classmethod
    def get(cls, key: str, parse: Callable[[bytes], T], absent: T) -> Command[T]:
        """GET ``key``, parsed."""
        return cls(("GET", key), parse, key, absent)

    @classmethod
    def script(
        cls, script: str, keys: list[str], args: list[Any], parse: Callable[[Any], T] = _same
    ) -> Command[T]:
        """One of ``store.scripts``, sent whole (EVAL), not by digest (EVALSHA): they run a
        few times a renewal, never on the hot path, and after a Redis restart or failover
        the server's script cache is empty, when a digest would cost every process two more
        commands (NOSCRIPT, SCRIPT LOAD) in the very storm that follows."""
        return cls(("EVAL", script, len(keys), *keys, *args), parse, keys[0], cast(T, None))

    @classmethod
    def plain(cls, *args: Any, parse: Callable[[Any], T] = _same) -> Command[T]:
        """Any other command (TIME, SET, DEL, PUBLISH...), its reply parsed as given."""
        return cls(args, parse, str(args[1]) if len(args) > 1 else "", cast(T, None))


class Replies:
    """How an account's replies read, whatever client sent the command: a corrupt or
    wrong-typed value as absent, logged once per key; any other error typed."""

    def __init__(self, keys: AccountKeys) -> None:
        self.keys = keys
        self._reported: set[str] = set()  # keys whose corrupt value was logged

    @property
    def address(self) -> str:
        """Where the commands go, for error messages (never a password)."""
        return "MERCHANT_REDIS_URL"

    def reply(self, key: str, raw: Any, parse: Callable[[Any], T], absent: T) -> T:
        """What a command on ``key`` answered (``raw``; a pipeline's, errors left in it),
        parsed: ``absent`` when nothing is there or what is there is corrupt or of the wrong
        type (logged once); an error other than WRONGTYPE is raised as StoreUnavailable."""
        if isinstance(raw, Exception):
            if not wrong_type(raw):
                raise store_error(raw, self.address) from raw
            self.corrupt(key, "a value of the wrong type")
            return absent
        if raw is None:
            return absent
        try:
            return parse(raw)
        except CORRUPT as exc:
            self.corrupt(key, type(exc).__name__)
            return absent

    def refused(self, exc: Exception) -> Exception:
        """A Redis error a command met, as a reply: WRONGTYPE (a corrupt value, read as
        absent); any other is raised as StoreUnavailable naming its cause."""
        if not wrong_type(exc):
            raise store_error(exc, self.address) from exc
        return exc

    def corrupt(self, key: str, why: str) -> None:
        if key not in self._reported:
            self._reported.add(key)
            log.warning(
                "%s holds what merchant-tasks never writes (%s): treated as absent; "
                "the next write replaces it",
                key,
                why,
            )


ClientT = TypeVar("ClientT")


class ClientReplies(Replies, Generic[ClientT]):
    """The replies of one account's commands sent with ``client`` (redis-py's:
    ``AccountRedis``; redis.asyncio's: ``store.async_store.AsyncAccountRedis``)."""

    def __init__(self, client: ClientT, keys: AccountKeys) -> None:
        super().__init__(keys)
        self.client = client

    @property
    def address(self) -> str:
        """host:port of the client in use, for error messages (never a password)."""
        return redis_address(self.client)


class AccountRedis(ClientReplies[StoreClient]):
    """One account's Redis commands sent with redis-py: every error typed
    (``StoreUnavailable`` naming the cause), every corrupt or wrong-typed value read as
    absent and logged once."""

    def send(self, command: Command[T]) -> T:
        """Send ``command`` and read its reply (see ``Command``)."""
        try:
            raw = self.client.execute_command(*command.args)  # type: ignore[no-untyped-call]
        except REDIS_ERRORS as exc:
            raw = self.refused(exc)
        return self.reply(command.key, raw, command.parse, command.absent)


def milliseconds(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def wrong_type(exc: BaseException | None) -> bool:
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("WRONGTYPE")


def redis_address(client: object) -> str:
    """Where a client connects (host:port or socket path), never its user or password."""
    pool = getattr(client, "connection_pool", None)  # a cluster client has one per node
    service = getattr(pool, "service_name", None)  # Sentinel: the master has no fixed address
    if isinstance(service, str):
        sentinels = getattr(getattr(pool, "sentinel_manager", None), "sentinels", [])
        where = ",".join(redis_address(sentinel) for sentinel in sentinels)
        return f"master {service} via sentinels {where}" if where else f"master {service}"
    kwargs = getattr(pool, "connection_kwargs", None)
    if not isinstance(kwargs, dict):
        return "MERCHANT_REDIS_URL"
    if kwargs.get("path"):
        return str(kwargs["path"])
    return f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"


def cause(exc: Exception) -> str:
    """What a Redis error says about the store, without any text the server chose."""
    name = type(exc).__name__
    if isinstance(exc, redis.exceptions.ReadOnlyError):
        return f"is a read-only replica ({name}): a failover may be under way"
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return f"refused a command its ACL user may not run ({name})"
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return f"is out of memory ({name}): check its maxmemory"
    if isinstance(exc, redis.ResponseError):
        code = str(exc).split(" ", 1)[0]
        return f"refused a command ({name} {code if code.isalpha() and code.isupper() else ''})"
    return f"unavailable: {name}"


@contextmanager
def unavailable_as_error(address: str | None = None) -> Iterator[None]:
    """Every Redis error as StoreUnavailable naming ``address`` (host:port) and the cause
    (unreachable, read-only, out of memory, a refused command); the original is chained."""
    try:
        yield
    except REDIS_ERRORS as exc:
        raise store_error(exc, address) from exc


# what a Redis answering but refusing writes raises: out of memory (``maxmemory`` with
# ``noeviction``) or a read-only replica (a failover under way)
REFUSING_WRITES = (redis.exceptions.ReadOnlyError, redis.exceptions.OutOfMemoryError)


def store_error(exc: Exception, address: str | None = None) -> StoreUnavailable:
    """The StoreUnavailable a Redis error ``exc`` becomes (chain it with ``from``)."""
    where = f"Redis at {address}" if address else "Redis"
    error = StoreRefusingWrites if isinstance(exc, REFUSING_WRITES) else StoreUnavailable
    return error(f"token store ({where}) {cause(exc)}; check MERCHANT_REDIS_URL")
