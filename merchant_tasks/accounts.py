"""Accounts: one fleet serving one or several (environment, API key) pairs.

The MERCHANT_* variables define the account ``default`` when MERCHANT_API_KEY is set.
MERCHANT_ACCOUNTS_FILE names a TOML or JSON file with more (or all) of them::

    [accounts.eu-shop]                           # JSON: {"accounts": {"eu-shop": {...}}}
    environment = "production"
    base_url = "https://api.example.com"
    api_key = "AK123"
    api_secret_file = "/run/secrets/eu-shop"     # secrets come from files, never this file
    # optional: allow_insecure_http, and the windows and timeouts (docs/configuration.md)

MERCHANT_ACCOUNTS_SOURCE="package.module:function" names a function of the platform's own
(reading its database, say) that returns more of them: a mapping of account name to a
``Settings`` or to an entry of the file's form. The sources add up; a name defined twice is
an error.

What an account does not set (windows, timeouts) comes from the MERCHANT_* variables;
the fleet's settings (Redis, key prefix, token keys) are every account's. Tokens, locks,
breakers and counters are keyed by environment and API key, so two accounts of one
environment and key are refused unless they are the same in every field.
A sandbox account and a production account may not share a server (compared by origin: a
key of one environment must never reach the other).
"""

from __future__ import annotations

import importlib
import json
import re
import threading
import tomllib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from merchant_tasks import telemetry
from merchant_tasks.exceptions import ConfigurationError
from merchant_tasks.renewal.due import claim_renewals, due_accounts, namespace_of, release_renewal
from merchant_tasks.settings import FleetSettings, Settings, environment, read_variable
from merchant_tasks.store import topology as redis_topology
from merchant_tasks.store.exchange_rate import ExchangeRate
from merchant_tasks.store.keys import AccountKeys, Replies
from merchant_tasks.store.reading import Client, StoredAccount
from merchant_tasks.store.sealing import TokenCodec, codec_for
from merchant_tasks.store.token_store import TokenStore, breaker_states
from merchant_tasks.store.topology import StoreClient
from merchant_tasks.token import fingerprint
from merchant_tasks.variable_files import read_text_file

# requests, the HTTP clients and the renewal's driver are imported when the first client is
# built (``client_for``): `status`, the exporter and beat's check read Redis only, and a
# worker serving 10,000 accounts builds the clients of those it calls, not the others'
if TYPE_CHECKING:
    import requests

    from merchant_tasks.api.client import MerchantClient
    from merchant_tasks.api.exchange import ExchangeRequest
    from merchant_tasks.renewal.manager import TokenManager

    FleetClient = MerchantClient[TokenManager]  # the client whose token source is the fleet's

DEFAULT_ACCOUNT = "default"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


def load_accounts(
    environ: Mapping[str, str] | None = None, *, read_secrets: bool = True
) -> dict[str, Settings]:
    """Every configured account by name; ConfigurationError names what is wrong.

    ``read_secrets=False`` checks everything but the secret files' content (beat's check:
    beat holds no secret).
    """
    env = environment(environ)
    fleet = FleetSettings.from_env(env)
    accounts: dict[str, Settings] = {}
    if read_variable("MERCHANT_API_KEY", env):
        accounts[DEFAULT_ACCOUNT] = Settings.from_env(env, fleet=fleet, read_secret=read_secrets)
    sources = [
        ("MERCHANT_ACCOUNTS_FILE", fleet.accounts_file, _read_accounts_file),
        ("MERCHANT_ACCOUNTS_SOURCE", fleet.accounts_source, _call_accounts_source),
    ]
    for variable, value, read in sources:
        if not value:
            continue
        for name, settings in read(value, env, fleet).items():
            if name in accounts:
                raise ConfigurationError(
                    f"{variable}: account {name!r} is also defined elsewhere "
                    "(MERCHANT_API_KEY, MERCHANT_ACCOUNTS_FILE or MERCHANT_ACCOUNTS_SOURCE)"
                )
            accounts[name] = settings
    if not accounts:
        raise ConfigurationError(
            "no account configured: set MERCHANT_API_KEY (one account), "
            "MERCHANT_ACCOUNTS_FILE or MERCHANT_ACCOUNTS_SOURCE (several)"
        )
    _check_environments_apart(accounts)
    _check_one_account_per_token(accounts)
    return accounts


def _read_accounts_file(
    value: str, env: Mapping[str, str], fleet: FleetSettings
) -> dict[str, Settings]:
    path = Path(value)
    where = f"MERCHANT_ACCOUNTS_FILE ({path})"
    text = read_text_file("MERCHANT_ACCOUNTS_FILE", path)
    try:
        document: Any = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ConfigurationError(f"{where}: not valid {path.suffix[1:] or 'TOML'}: {exc}") from None
    entries = document.get("accounts") if isinstance(document, dict) else None
    if not isinstance(entries, dict) or not entries:
        raise ConfigurationError(f"{where}: needs an 'accounts' table with at least one account")
    return _accounts_from_entries(where, entries, env, fleet)


def _call_accounts_source(
    value: str, env: Mapping[str, str], fleet: FleetSettings
) -> dict[str, Settings]:
    """Accounts from ``package.module:function``: a platform's own store of accounts.

    The function takes no argument and returns a mapping of account name to either a
    ``Settings`` or an entry of the accounts file's form (its keys, secrets from files).
    """
    where = f"MERCHANT_ACCOUNTS_SOURCE ({value})"
    module_name, _, attribute = value.partition(":")
    if not (module_name and attribute):
        raise ConfigurationError(f"{where}: must be 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"{where}: cannot import {module_name!r} ({exc})") from None
    except Exception as exc:  # its module-level code failed: only the type, as below
        raise ConfigurationError(
            f"{where}: importing {module_name!r} raised {type(exc).__name__}"
        ) from exc
    source = getattr(module, attribute, None)
    if not callable(source):
        raise ConfigurationError(f"{where}: {module_name!r} has no function {attribute!r}")
    try:
        entries = source()
    except ConfigurationError as exc:
        raise ConfigurationError(f"{where}: {exc}") from None
    except Exception as exc:
        # the platform's own error may carry a database URL: only its type is shown here;
        # the chained exception keeps the rest for whoever debugs the platform's code
        raise ConfigurationError(f"{where}: the function raised {type(exc).__name__}") from exc
    if not isinstance(entries, Mapping) or not entries:
        raise ConfigurationError(f"{where}: must return a mapping with at least one account")
    return _accounts_from_entries(where, entries, env, fleet)


def _accounts_from_entries(
    where: str, entries: Mapping[Any, Any], env: Mapping[str, str], fleet: FleetSettings
) -> dict[str, Settings]:
    """Validate named entries: each a ``Settings`` or a table of the accounts file's keys,
    what it does not set coming from the MERCHANT_* variables."""
    accounts: dict[str, Settings] = {}
    for name, entry in entries.items():
        if not (isinstance(name, str) and _NAME.match(name)):
            raise ConfigurationError(f"{where}: account name {name!r} must be a short identifier")
        if isinstance(entry, Settings):
            accounts[name] = entry
            continue
        if not isinstance(entry, Mapping):
            raise ConfigurationError(f"{where}: account {name!r} must be a table")
        try:
            accounts[name] = Settings.from_entry(entry, env, fleet)
        except ConfigurationError as exc:
            raise ConfigurationError(f"{where}: account {name!r}: {exc}") from None
    return accounts


def _check_environments_apart(accounts: Mapping[str, Settings]) -> None:
    """A sandbox account and a production account must not point at the same server."""
    seen: dict[str, tuple[str, str]] = {}
    for name, settings in accounts.items():
        origin = settings.origin
        other = seen.setdefault(origin, (name, settings.environment))
        if other[1] != settings.environment:
            raise ConfigurationError(
                f"accounts {other[0]!r} ({other[1]}) and {name!r} ({settings.environment}) share "
                f"the base URL {origin}: a key of one environment must never reach the other"
            )


def _check_one_account_per_token(accounts: Mapping[str, Settings]) -> None:
    """Two accounts of one environment and API key share one token record (its namespace
    holds neither the base URL nor the secret), so unless they are one account in every
    field, each would renew over the other's token: refused."""
    seen: dict[str, tuple[str, Settings]] = {}
    for name, settings in accounts.items():
        other = seen.setdefault(namespace_of(settings), (name, settings))
        if other[0] != name and other[1].to_env() != settings.to_env():
            raise ConfigurationError(
                f"accounts {other[0]!r} and {name!r} have the same environment "
                f"({settings.environment}) and API key but differ in other settings: they "
                "would share one token record and revoke each other's tokens; give each its "
                "own API key, or define the account once"
            )


def __getattr__(name: str) -> object:
    """``FleetClient`` at run time (``isinstance``, subscripting), made when asked for."""
    if name == "FleetClient":
        from merchant_tasks.api.client import MerchantClient
        from merchant_tasks.renewal.manager import TokenManager

        return MerchantClient[TokenManager]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def client_for(
    settings: Settings,
    *,
    redis_client: StoreClient | None = None,
    session: requests.Session | None = None,
    name: str = DEFAULT_ACCOUNT,
    store: TokenStore | None = None,
) -> FleetClient:
    """The client of account ``name``: its settings wired to a store, an exchange and a
    manager.

    ``redis_client`` (or the ``store`` itself) and ``session`` are shared when given
    (``AccountClients`` shares one Redis pool per server); otherwise the client gets its own.
    The exchange always has its own session, whose transport cuts each exchange at its
    deadline.
    """
    from merchant_tasks.api.client import MerchantClient, new_session
    from merchant_tasks.api.exchange import TokenExchange
    from merchant_tasks.renewal.manager import TokenManager

    session = session or new_session()
    given_store = store
    store = store or store_for(settings, redis_client or redis_for(settings.fleet), name=name)
    telemetry.watch_breaker(name, store, breaker_states)
    exchange = TokenExchange.from_settings(settings)
    manager = TokenManager(
        store,
        exchange,
        lambda: credentials_fingerprint(settings, settings.secret.reveal()),
        **renewal_terms(settings, store.commands, exchange),
        owns_redis=redis_client is None and given_store is None,
    )
    return MerchantClient(
        settings.base_url,
        manager,
        session=session,
        timeout=(settings.connect_timeout, settings.read_timeout),
        account=name,
        secret=settings.secret,
    )


def store_for(
    settings: Settings,
    redis_client: StoreClient,
    *,
    name: str = DEFAULT_ACCOUNT,
    codec: TokenCodec | None = None,
) -> TokenStore:
    """The token store of account ``name`` (all that `status` needs of it); ``codec`` is
    shared when given, else made from the fleet's key files."""
    codec = codec_of(settings.fleet) if codec is None else codec
    return TokenStore(redis_client, namespace_of(settings), codec, account=name)


def codec_of(fleet: FleetSettings) -> TokenCodec:
    """The codec of the fleet's key files (MERCHANT_TOKEN_KEY_FILE, and the key being
    rotated out): each account's store seals and opens its token with it."""
    return codec_for(fleet.token_key_file, fleet.token_key_previous_file)


class Codecs:
    """A set of clients' codecs (``codec_of``), one per pair of key files, each read once:
    accounts sharing their files share a codec."""

    def __init__(self) -> None:
        self._made: dict[tuple[str | None, str | None], TokenCodec] = {}

    def __call__(self, fleet: FleetSettings) -> TokenCodec:
        files = (fleet.token_key_file, fleet.token_key_previous_file)
        codec = self._made.get(files)
        if codec is None:
            codec = self._made[files] = codec_of(fleet)
        return codec


def credentials_fingerprint(settings: Settings, secret: str) -> str:
    """What a pause over rejected credentials is tied to (``secret``: the secret now): the
    key, the secret and the endpoint; a pause opened against other ones ends at once."""
    return fingerprint(f"{settings.api_key}\n{settings.base_url}\n{secret}")


class RenewalTerms(TypedDict):
    """An account's renewal terms, as ``TokenManager`` and ``AsyncTokenManager`` take them."""

    renew_before: float
    renew_mandatory: float
    exchange_timeout: float
    rate: ExchangeRate
    endpoint: str


def renewal_terms(settings: Settings, commands: Replies, exchange: ExchangeRequest) -> RenewalTerms:
    """The renewal terms of the account: its windows, the exchange's deadline, the
    fleet-wide exchange rate of its token endpoint (asked through ``commands``, its
    store's) and that endpoint's fingerprint (both from ``exchange``)."""
    return RenewalTerms(
        renew_before=settings.renew_before,
        renew_mandatory=settings.renew_mandatory,
        exchange_timeout=exchange.deadline,
        rate=exchange_rate_for(settings, commands),
        endpoint=exchange.endpoint,
    )


def exchange_rate_for(settings: Settings, commands: Replies) -> ExchangeRate:
    """The fleet-wide exchange rate of the account's token endpoint host, asked through
    the account's Redis (``commands``, its store's)."""
    host = settings.origin.split("://", 1)[-1]  # host:port; the scheme adds nothing
    key = AccountKeys.exchange_rate(settings.fleet.key_prefix, host)
    return ExchangeRate(commands, key, host, settings.fleet.max_exchanges_per_second)


def stored_accounts(
    accounts: Mapping[str, Settings],
    redis_of: Callable[[str], Client],
    codec_of: Callable[[FleetSettings], TokenCodec],
) -> dict[str, StoredAccount[Client]]:
    """Every account as `status` reads it, on the Redis client ``redis_of`` gives for its
    URL (blocking or asyncio): one ``ExchangeRate`` per token endpoint host and Redis,
    shared by its accounts, so that status reads each host once."""
    rates: dict[tuple[str, str, str, float], ExchangeRate] = {}
    stored: dict[str, StoredAccount[Client]] = {}
    for name, settings in accounts.items():
        fleet = settings.fleet
        replies = Replies(AccountKeys.of(namespace_of(settings)))
        host = (fleet.redis_url, fleet.key_prefix, settings.origin, fleet.max_exchanges_per_second)
        rate = rates.get(host)
        if rate is None:
            rate = rates[host] = exchange_rate_for(settings, replies)
        client = redis_of(fleet.redis_url)
        stored[name] = StoredAccount(name, client, codec_of(fleet), replies, rate)
    return stored


def redis_for(fleet: FleetSettings) -> StoreClient:
    """The token store's client for the fleet's Redis URL and topology."""
    return redis_topology.redis_from_url(
        fleet.redis_url,
        sentinel_master=fleet.redis_sentinel_master,
        sentinel_password=fleet.redis_sentinel_password,
        cluster=fleet.redis_cluster,
    )


def close_client(client: FleetClient) -> None:
    """Close ``client`` (``close()``) and its store's Redis connections, whoever made them
    (a test's shared client too)."""
    client.close()
    client.manager.store.redis.close()


def client_from_env(environ: Mapping[str, str] | None = None) -> FleetClient:
    """The client of the only (or ``default``) account the MERCHANT_* variables and
    MERCHANT_ACCOUNTS_FILE / _SOURCE configure (see docs/configuration.md), with a Redis
    pool of its own: ``close()`` (or ``with``) closes it, its HTTP session, and stops its
    listening for renewals."""
    accounts = load_accounts(environ)
    name = default_name(accounts)
    return client_for(accounts[name], name=name)


class AccountClients:
    """This process's clients, one per account, each made on its first use (one HTTP
    session each; one Redis pool per Redis server). `status` and the exporter read the
    accounts' records (``stored_accounts``) without building a client or a store."""

    def __init__(self, accounts: Mapping[str, Settings]) -> None:
        self.accounts = dict(accounts)
        self._clients: dict[str, FleetClient] = {}
        self._stores: dict[str, TokenStore] = {}
        self._stored: dict[str, StoredAccount[StoreClient]] | None = None
        self._codec = Codecs()  # called with the lock held
        self._redis_by_url: dict[str, StoreClient] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, read_secrets: bool = True
    ) -> AccountClients:
        return cls(load_accounts(environ, read_secrets=read_secrets))

    def get(self, account: str | None = None) -> FleetClient:
        """The client of ``account`` (the only or ``default`` account when None)."""
        name = account or self.default_name()
        client = self._clients.get(name)
        if client is not None:
            return client
        settings = settings_of(self.accounts, name)
        with self._lock:
            client = self._clients.get(name)
            if client is None:
                store = self._stores[name] = self._store(name)
                # a session of its own: cookies never cross accounts
                client = self._clients[name] = client_for(settings, store=store, name=name)
        return client

    def stored_accounts(self) -> dict[str, StoredAccount[StoreClient]]:
        """Every account as `status` and the exporter read it (``store.reading``): its
        keys, Redis client, codec and host's exchange rate, made once; no store or client
        built."""
        with self._lock:
            if self._stored is None:
                self._stored = stored_accounts(self.accounts, self._redis_for, self._codec)
            return self._stored

    def each_store(self) -> Iterator[tuple[str, TokenStore]]:
        """Every account's store in turn, each made when reached and kept by nobody (the
        start-up check, ``worker.store_check``): 10,000 accounts never hold 10,000 stores."""
        for name in self.accounts:
            with self._lock:
                store = self._stores.get(name) or self._store(name)
            yield name, store

    def _store(self, name: str) -> TokenStore:
        """A new store of ``name`` on this process's Redis pool; the lock is held."""
        settings = self.accounts[name]
        client = self._redis_for(settings.fleet.redis_url)
        return store_for(settings, client, name=name, codec=self._codec(settings.fleet))

    def close(self) -> None:
        """Close the HTTP sessions and Redis connections made so far (a command, a test,
        a process that stops using its clients); a client asked for afterwards opens new
        ones."""
        with self._lock:
            clients, redis_clients = list(self._clients.values()), list(self._redis_by_url.values())
            for made in (self._clients, self._stores, self._redis_by_url):
                made.clear()
            self._stored = None
        for client in clients:
            client.close()  # its session; its manager stops listening (the pool is ours)
        for redis_client in redis_clients:
            redis_client.close()

    def __enter__(self) -> AccountClients:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def redis_for(self, url: str) -> StoreClient:
        """This process's Redis client (one pool) for ``url``, shared by its accounts."""
        with self._lock:
            return self._redis_for(url)

    def _redis_for(self, url: str) -> StoreClient:
        client = self._redis_by_url.get(url)
        if client is None:
            # the accounts of one URL share the topology variables (MERCHANT_REDIS_*)
            fleet = next(s.fleet for s in self.accounts.values() if s.fleet.redis_url == url)
            client = self._redis_by_url[url] = redis_for(fleet)
        return client

    def due(self) -> list[str]:
        """The accounts due for renewal with no renewal task pending (``renewal.due``): one
        round trip per Redis server when none is due, no client built."""
        due = due_accounts(self.accounts, self.redis_for)
        return claim_renewals(due, self.accounts, self.redis_for) if due else []

    def renewal_done(self, name: str) -> None:
        """``name``'s renewal task has run: beat may send the next one."""
        settings = self.accounts.get(name)
        if settings is not None:
            release_renewal(settings, self.redis_for(settings.fleet.redis_url))

    def default_name(self) -> str:
        return default_name(self.accounts)


def settings_of(accounts: Mapping[str, Settings], name: str) -> Settings:
    """The settings of account ``name``; ConfigurationError naming the configured ones if
    there is no such account."""
    settings = accounts.get(name)
    if settings is None:
        raise ConfigurationError(
            f"unknown account {name!r}; configured: {', '.join(sorted(accounts))}"
        )
    return settings


def default_name(accounts: Mapping[str, Settings]) -> str:
    """The account used when none is named: the only one, or ``default``."""
    if len(accounts) == 1:
        return next(iter(accounts))
    if DEFAULT_ACCOUNT in accounts:
        return DEFAULT_ACCOUNT
    raise ConfigurationError(
        f"several accounts are configured ({', '.join(sorted(accounts))}): name one"
    )
