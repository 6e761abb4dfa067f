"""The token store's Redis client for each topology: one server, Sentinel, or Cluster.

``MERCHANT_REDIS_URL`` takes three forms:

- ``redis://``, ``rediss://`` or ``unix://``: one server (the usual case);
- Celery's own Sentinel form, ``sentinel://[:password@]host:26379[/db]`` repeated with
  ``;`` for each sentinel: the client asks the sentinels for the master named by
  ``MERCHANT_REDIS_SENTINEL_MASTER`` and follows a failover by itself. The URL's password
  is the master's (as for Celery); the sentinels' own is
  ``MERCHANT_REDIS_SENTINEL_PASSWORD``;
- with ``MERCHANT_REDIS_CLUSTER=1``, the ``redis://`` or ``rediss://`` URL of any node of
  a Redis Cluster; every key of one account then carries a hash tag, so they share a slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeAlias
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.asyncio.sentinel
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.sentinel import Sentinel

from merchant_tasks.exceptions import ConfigurationError, StoreUnavailable

StoreClient: TypeAlias = "redis.Redis | RedisCluster"
AsyncStoreClient: TypeAlias = "redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster"

SOCKET_CONNECT_TIMEOUT = 2.0  # a dead Redis (or sentinel) fails a call fast...
SOCKET_TIMEOUT = 5.0  # ... and so does one that accepted the connection and hangs
ASYNC_POOL_SIZE = 100  # an asyncio client's connections to one Redis (redis.asyncio's cap)
HEALTH_CHECK_INTERVAL = 30  # seconds idle before a pooled connection is pinged on reuse
DEFAULT_SENTINEL_MASTER = "mymaster"  # Redis's own example name, and Celery's docs'
SENTINEL_PORT = 26379  # the port Redis assigns to Sentinel
SENTINEL_SCHEME = "sentinel"
URL_VARIABLE = "MERCHANT_REDIS_URL"
KOMBU_REDIS_SCHEMES = frozenset({"redis", "rediss", "redis+socket", "unix", "socket", "sentinel"})


@dataclass(frozen=True)
class SentinelUrl:
    """Celery's ``sentinel://...;sentinel://...`` form, taken apart."""

    sentinels: tuple[tuple[str, int], ...]
    db: int
    username: str | None
    password: str | None = field(repr=False)  # the master's (Celery reads it from the first
    # address too); never in repr, which a log line or a traceback could show


def is_kombu_redis_url(url: str) -> bool:
    """Whether a Celery broker or result backend URL is served by kombu's Redis transport."""
    return url.split("://", 1)[0].lower() in KOMBU_REDIS_SCHEMES


def is_sentinel_url(url: str) -> bool:
    return url.lower().startswith(f"{SENTINEL_SCHEME}://")


def parse_sentinel_url(url: str, variable: str = URL_VARIABLE) -> SentinelUrl:
    """Take Celery's Sentinel form apart; ConfigurationError names ``variable``, never the URL.

    Every address must be ``sentinel://`` with a host, and all must name the same database
    and credentials (Celery takes them from the first one: differing ones would be ignored
    there and used here).
    """
    parts = [part.strip() for part in url.split(";") if part.strip()]
    if not parts:
        raise ConfigurationError(f"{variable}: no sentinel address given")
    sentinels = []
    seen: set[tuple[int, str | None, str | None]] = set()
    for number, part in enumerate(parts, start=1):
        where = f"{variable}: sentinel address #{number}"
        split = urlsplit(part)
        if split.scheme.lower() != SENTINEL_SCHEME:
            raise ConfigurationError(f"{where} must start with sentinel:// (separate them with ;)")
        try:
            port = split.port or SENTINEL_PORT
        except ValueError:
            raise ConfigurationError(f"{where} has a port that is not a number") from None
        if not split.hostname:
            raise ConfigurationError(f"{where} has no host (sentinel://host:26379)")
        path = split.path.strip("/")
        if path and not path.isdigit():
            raise ConfigurationError(f"{where}: the path must be a database number (/0)")
        if split.query or split.fragment:
            raise ConfigurationError(
                f"{where}: options after ? or # are not supported in the sentinel form"
            )
        username = unquote(split.username) if split.username else None
        password = unquote(split.password) if split.password else None
        seen.add((int(path or 0), username, password))
        sentinels.append((split.hostname, port))
    if len(seen) > 1:
        raise ConfigurationError(
            f"{variable}: every sentinel address must give the same database and password"
        )
    db, username, password = seen.pop()
    return SentinelUrl(tuple(sentinels), db, username, password)


def check_server_url(url: str, variable: str = URL_VARIABLE) -> None:
    """One server's ``redis://``, ``rediss://`` or ``unix://`` URL as redis-py and Celery
    read it: a database number for a path, and query values redis-py can use.
    ConfigurationError names ``variable``, never the URL."""
    parts = urlsplit(url)
    database = parts.path.strip("/") if parts.scheme in ("redis", "rediss") else ""
    if database and not database.isdigit():
        raise ConfigurationError(
            f"{variable}'s path must be a database number (redis://host:6379/0), if any"
        )
    try:
        redis.connection.parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError as exc:  # its messages name the parameter, not the URL
        raise ConfigurationError(f"{variable}: {exc}") from None


def celery_url(url: str) -> str:
    """The token store's URL as Celery's broker and result backend read the same server:
    redis-py's ``unix:///path?db=N``, which neither kombu nor Celery knows, as
    ``redis+socket:///path?virtual_host=N``, its user and password in the address (kombu
    reads them nowhere else) and redis-py's other options left to the token store (kombu
    would pass them on as strings); a ``rediss://`` URL without ``ssl_cert_reqs`` (which
    Celery's result backend refuses) with redis-py's default, ``required``."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if parts.scheme == "unix":
        options = dict(query)
        user = parts.username or options.get("username") or ""
        password = parts.password or options.get("password")
        credentials = quote(unquote(user), safe="")
        if password:
            credentials += ":" + quote(unquote(password), safe="")
        address = f"{credentials}@" if credentials else ""
        given = f"?virtual_host={options['db']}" if options.get("db") else ""
        return f"redis+socket://{address}{parts.path}{given}"  # '//' even with no address
    if parts.scheme == "rediss" and "ssl_cert_reqs" not in dict(query):
        query.append(("ssl_cert_reqs", "required"))
        return urlunsplit(parts._replace(query=urlencode(query)))
    return url


def redis_from_url(
    url: str,
    *,
    sentinel_master: str = DEFAULT_SENTINEL_MASTER,
    sentinel_password: str | None = None,
    cluster: bool = False,
) -> StoreClient:
    """The token store's client for ``url``, with timeouts so a dead Redis fails fast.

    A Sentinel client reads and writes on the master: a replica may lag behind it, and the
    store compares generations.
    """
    client: StoreClient = _client_from_url(
        url, sentinel_master, sentinel_password, cluster, redis, Sentinel, RedisCluster
    )
    return client


def async_redis_from_url(
    url: str,
    *,
    sentinel_master: str = DEFAULT_SENTINEL_MASTER,
    sentinel_password: str | None = None,
    cluster: bool = False,
) -> AsyncStoreClient:
    """``redis_from_url``'s client, with redis.asyncio: the same topology and options."""
    client: AsyncStoreClient = _client_from_url(
        url,
        sentinel_master,
        sentinel_password,
        cluster,
        redis.asyncio,
        redis.asyncio.sentinel.Sentinel,
        redis.asyncio.cluster.RedisCluster,
    )
    return client


def _client_from_url(
    url: str,
    sentinel_master: str,
    sentinel_password: str | None,
    cluster: bool,
    module: Any,
    sentinel_class: Any,
    cluster_class: Any,
) -> Any:
    """A client of redis-py's ``module`` (``redis`` or ``redis.asyncio``) for ``url``."""
    timeouts = {
        "socket_connect_timeout": SOCKET_CONNECT_TIMEOUT,
        "socket_timeout": SOCKET_TIMEOUT,
    }
    if is_sentinel_url(url):
        parsed = parse_sentinel_url(url)
        sentinel = sentinel_class(
            list(parsed.sentinels),
            sentinel_kwargs={**timeouts, "password": sentinel_password},
            **timeouts,
        )
        return sentinel.master_for(
            sentinel_master,
            db=parsed.db,
            username=parsed.username,
            password=parsed.password,
            health_check_interval=HEALTH_CHECK_INTERVAL,
        )
    if cluster:
        return cluster_class.from_url(url, **timeouts)
    if module is redis.asyncio:  # an event loop's burst of tasks waits for a connection
        # (up to SOCKET_TIMEOUT) instead of failing with MaxConnectionsError past the pool
        pool = module.BlockingConnectionPool.from_url(
            url,
            max_connections=ASYNC_POOL_SIZE,
            timeout=SOCKET_TIMEOUT,
            health_check_interval=HEALTH_CHECK_INTERVAL,
            **STALE_CONNECTION_RETRY,
            **timeouts,
        )
        return module.Redis.from_pool(pool)
    return module.Redis.from_url(url, health_check_interval=HEALTH_CHECK_INTERVAL, **timeouts)


# redis-py's pool checks each pooled connection it hands out and reconnects one Redis has
# closed (a restart, a failover, a client timeout); redis.asyncio's hands it out unchecked
# (its check does not wait for the close to be read), and the command sent on it failed:
# after a restart, one call per pooled connection failed with StoreUnavailable. One retry,
# at once, on a new connection, after a ConnectionError only (redis-py's Retry takes
# timeouts too by default): a refused connect is refused again at once, and a Redis that
# does not answer (TimeoutError) is neither waited for twice nor sent again what it may
# have run. A command whose connection broke after Redis ran it runs twice: the store's
# commands allow it (a read; a lock taken again by its holder; a token stored by
# generation, compared first; a counter off by one).
STALE_CONNECTION_RETRY: dict[str, Any] = {
    "retry": redis.asyncio.retry.Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
    "retry_on_error": [redis.ConnectionError],
}


def probe_redis(url: str, *, connect_timeout: float) -> bool:
    """Whether the Redis at ``url`` answers a PING; the probe's connection is not kept."""
    probe = redis.Redis.from_url(url, socket_connect_timeout=connect_timeout)
    try:
        return bool(probe.ping())
    except redis.RedisError:
        return False
    finally:
        probe.close()


DELETE_BATCH = 500  # keys scanned and unlinked per round trip


def delete_under_prefix(url: str, prefix: str) -> int:
    """Delete every key of the Redis at ``url`` that starts with ``prefix:`` (a run's own
    keys, the demo's, on a Redis that others use); the number deleted. StoreUnavailable if
    Redis fails meanwhile."""
    pattern = "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + ":*"
    client = redis.Redis.from_url(url)
    deleted = 0
    try:
        batch: list[bytes] = []
        for key in client.scan_iter(match=pattern, count=DELETE_BATCH):
            batch.append(key)
            if len(batch) == DELETE_BATCH:
                deleted += int(client.unlink(*batch))
                batch.clear()
        if batch:
            deleted += int(client.unlink(*batch))
    except redis.RedisError as exc:
        raise StoreUnavailable(
            f"Redis failed while deleting the keys under {prefix} ({type(exc).__name__})"
        ) from exc
    finally:
        client.close()
    return deleted
