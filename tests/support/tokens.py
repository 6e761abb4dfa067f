"""Tokens for tests: one made on the spot (``make_token``), and tokens written to Redis as
another process of the fleet would (``stored`` through a store, ``store_tokens`` for many
accounts in one pipeline)."""

from __future__ import annotations

import time
from collections.abc import Iterable

from merchant_tasks.renewal.due import namespace_of
from merchant_tasks.settings import Settings
from merchant_tasks.store.keys import AccountKeys
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.store.topology import StoreClient
from merchant_tasks.token import RenewalReason, Token
from support.clock import ManualClock

LIFETIME = 7200.0  # seconds, as the real API's tokens
RENEWED_BY = "host-a:123:abcd1234"  # who renewed a token made on the spot
OTHER_HOLDER = "other-host:99:deadbeef"  # the other process of the fleet, in unit tests


def make_token(
    generation: int = 1,
    *,
    left: float = 3600.0,
    value: str | None = None,
    now: float | None = None,
) -> Token:
    """A token of ``generation`` (``tok-gen-<generation>`` unless ``value`` is given) of
    LIFETIME with ``left`` seconds to live at ``now``: by default the real clock, which
    Redis TIME follows."""
    at = time.time() if now is None else now
    return Token(
        value=value or f"tok-gen-{generation}",
        issued_at=at - LIFETIME + left,
        expires_at=at + left,
        generation=generation,
        renewed_by=RENEWED_BY,
        reason=RenewalReason.SCHEDULED,
    )


def stored(
    store: TokenStore,
    clock: ManualClock,
    left: float = 3600.0,
    *,
    value: str | None = None,
    reason: RenewalReason = RenewalReason.SCHEDULED,
    age: float | None = None,
    in_a_row: int = 0,
) -> Token:
    """Save, as another process would, a token with ``left`` seconds to live (``in_a_row``:
    the tokens before it refused on their first use, in a row)."""
    generation = store.generation() + 1
    token = Token(
        value=value or f"tok-stored-{generation}",
        issued_at=clock.now - (LIFETIME - left if age is None else age),
        expires_at=clock.now + left,
        generation=generation,
        renewed_by=OTHER_HOLDER,
        reason=reason,
        first_use_refusals=in_a_row,
    )
    assert store.save(token) == (True, generation)
    return token


def store_tokens(
    client: StoreClient,
    accounts: Iterable[Settings],
    *,
    left: float = LIFETIME,
    generation: int = 1,
) -> None:
    """Write a token of ``generation`` with ``left`` seconds to live by Redis's clock for
    each account, where and as the store writes it (expiring with it), in one pipeline."""
    now = redis_time(client)
    pipe = client.pipeline(transaction=False)
    for settings in accounts:
        token = Token(f"tok-{settings.api_key}", now - 60.0, now + left, generation)
        key = AccountKeys.of(namespace_of(settings)).token
        pipe.set(key, token.to_json(), px=int(left * 1000))
    pipe.execute()


def redis_time(client: StoreClient) -> float:
    """Redis's clock (TIME), in seconds."""
    seconds, micros = client.time()
    return float(seconds + micros / 1e6)
