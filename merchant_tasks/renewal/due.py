"""Beat's fleet-wide check: which accounts' tokens are due for renewal, in one round trip.

Beat's ``renew_token`` asks this module which accounts to renew, then sends one renewal
task per due account. The check reads, in one pipeline per Redis server, Redis's clock
(TIME) and every account's stored token (GET), so 1,000 accounts with nothing due cost one
round trip, not 1,000; it builds no client and no HTTP session. Only the token's times
are read: a value sealed at rest (see ``store.sealing``) is never opened here.

Each account has its own renewal point, between ``renew_before`` and a little above the
mandatory window, picked by a hash of its namespace: the same on every host and after
every restart. Tokens issued together after a cold start then fall due at points spread
over the advisory window, so their exchanges are spread too instead of one burst. The
renewal task renews through ``TokenManager.renew()``, which exchanges only when the token
is no longer fresh (see docs/design.md): the spread decides when beat asks, never whether
a renewal is single-flight.

Beat sends an account's renewal task only if none is pending: a claim key per account
(``<namespace>:renewal-sent``, SET NX, one pipeline for all due accounts) lives until the
task has run (it deletes the claim) or, for a task lost on the way, for as long as the
advisory window lasts (``claim_ttl``, counted from the claim; callers renew in the
mandatory window meanwhile). One Redis server that cannot be reached skips only its own
accounts. So a backlog after a cold start is never flooded with the same account's
tasks tick after tick, and two beats do not double the tasks.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from merchant_tasks.exceptions import StoreUnavailable
from merchant_tasks.settings import Settings
from merchant_tasks.store.keys import AccountKeys, redis_address
from merchant_tasks.store.token_store import claim_slots, delete_key, read_values
from merchant_tasks.store.topology import StoreClient
from merchant_tasks.token import Token

SPREAD_TICKS = 2.0  # the lowest renewal point leaves two beat intervals before the
# mandatory window: a tick may fall just before the point, and the next one then renews
# with a whole interval to spare for the task's queueing and exchange
_HASH_SPAN = 2**64  # the renewal point's fraction of the window: 8 bytes of SHA-256

log = logging.getLogger(__name__)
Group = TypeVar("Group")


def namespace_of(settings: Settings) -> str:
    """The account's key namespace in the token store."""
    return AccountKeys.namespace_for(
        settings.fleet.key_prefix,
        settings.environment,
        settings.api_key,
        hash_tag=settings.fleet.redis_cluster,
    )


def renewal_point(settings: Settings) -> float:
    """Seconds before expiry from which beat renews this account; fixed per account.

    Between ``renew_before`` and ``renew_mandatory + SPREAD_TICKS * renew_interval`` (or
    exactly ``renew_before`` when the advisory window is narrower than that).
    """
    lowest = min(
        settings.renew_before,
        settings.renew_mandatory + SPREAD_TICKS * settings.fleet.renew_interval,
    )
    digest = hashlib.sha256(namespace_of(settings).encode()).digest()
    fraction = int.from_bytes(digest[:8], "big") / _HASH_SPAN
    return settings.renew_before - fraction * (settings.renew_before - lowest)


@dataclass(frozen=True)
class _Entry:
    name: str
    token_key: str
    renewal_point: float


def due_accounts(
    accounts: Mapping[str, Settings], redis_for: Callable[[str], StoreClient]
) -> list[str]:
    """Names of the accounts whose token is missing or past its renewal point.

    ``redis_for`` gives the Redis client of a Redis URL; accounts sharing a server share
    one pipeline (one round trip). A server that cannot be reached is logged and its
    accounts skipped (``_per_server``); StoreUnavailable if none can be.
    """
    by_server: dict[str, list[_Entry]] = {}
    for name, settings in accounts.items():
        by_server.setdefault(settings.fleet.redis_url, []).append(
            _Entry(name, _keys(settings).token, renewal_point(settings))
        )
    return _per_server(
        by_server.items(),
        redis_for,
        lambda url, entries: _due_on_server(redis_for(url), entries),
    )


def claim_renewals(
    names: list[str],
    accounts: Mapping[str, Settings],
    redis_for: Callable[[str], StoreClient],
) -> list[str]:
    """The due accounts beat may send a renewal task for: those without one pending.

    One pipeline per Redis server; each claim expires after ``claim_ttl``.
    """
    by_server: dict[str, list[str]] = {}
    for name in names:
        by_server.setdefault(accounts[name].fleet.redis_url, []).append(name)

    def claim(url: str, server_names: list[str]) -> list[str]:
        slots = [(claim_key(accounts[name]), claim_ttl(accounts[name])) for name in server_names]
        replies = claim_slots(redis_for(url), slots)
        return [name for name, won in zip(server_names, replies, strict=True) if won]

    return _per_server(by_server.items(), redis_for, claim)


def _per_server(
    groups: Iterable[tuple[str, Group]],
    redis_for: Callable[[str], StoreClient],
    run: Callable[[str, Group], list[str]],
) -> list[str]:
    """``run`` on each server's group, joined. A server that fails is logged and skipped,
    so one Redis down does not stop the renewals of the accounts on the others; if every
    server fails, the first failure is raised (beat's tick logs it)."""
    found: list[str] = []
    failures: list[tuple[str, StoreUnavailable]] = []
    served = 0
    for url, group in groups:
        try:
            found += run(url, group)
            served += 1
        except StoreUnavailable as exc:
            failures.append((url, exc))
    if failures and not served:
        raise failures[0][1]
    for url, failure in failures:
        log.warning(
            "scheduled token check skipped the accounts on Redis %s: %s",
            redis_address(redis_for(url)),
            failure,
        )
    return found


def release_renewal(settings: Settings, client: StoreClient) -> None:
    """The renewal task has run: beat may send the next one."""
    delete_key(client, claim_key(settings))


def claim_key(settings: Settings) -> str:
    return _keys(settings).renewal_sent


def _keys(settings: Settings) -> AccountKeys:
    return AccountKeys.of(namespace_of(settings))


def claim_ttl(settings: Settings) -> float:
    """How long a sent renewal task stays useful: the advisory window. After it, callers
    renew in the mandatory window anyway, and beat may send another."""
    return settings.renew_before - settings.renew_mandatory


def _due_on_server(client: StoreClient, entries: list[_Entry]) -> list[str]:
    now, values = read_values(client, [entry.token_key for entry in entries])
    return [
        entry.name
        for entry, raw in zip(entries, values, strict=True)
        if raw is None or Token.stored_time_left(raw, now) < entry.renewal_point
    ]
