"""TokenManager on fakeredis with an injected clock, sleep and exchange: windows,
single flight, compare-and-swap after a 401, and the fleet-wide breaker."""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from conftest import FakeExchange, dead_redis, make_manager
from merchant_tasks.exceptions import (
    CredentialsRejected,
    ExchangeRateLimited,
    MalformedTokenResponse,
    RenewalTimeout,
    StoreUnavailable,
    TokenEndpointUnavailable,
    TokenExchangeError,
    TokenRejected,
)
from merchant_tasks.renewal.lock import POLL_INITIAL, POLL_MAX
from merchant_tasks.renewal.manager import EXCHANGE_ATTEMPTS, EXCHANGE_RETRY_WAIT_MAX, TokenManager
from merchant_tasks.renewal.refusals import (
    FORCED_RENEWAL_SPACING,
    PROBE_INTERVAL,
    RATE_LIMITED_BACKOFF,
    REFUSED_BACKOFF,
    REJECTED_BACKOFF,
    RETRY_AFTER_MARGIN,
    UNAVAILABLE_BACKOFF,
)
from merchant_tasks.sandbox.processes import wait_until
from merchant_tasks.store.token_store import BreakerRecord, TokenStore
from merchant_tasks.token import BreakerKind, IssuedToken, RenewalReason, Token, fingerprint

RENEW_BEFORE = 480.0
RENEW_MANDATORY = 120.0
LIFETIME = 7200.0
OTHER_HOLDER = "other-host:99:deadbeef"


class ManualClock:
    """The store's clock as the manager sees it; starts at real time, which Redis TIME follows."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


class Sleeper:
    """Records every wait instead of sleeping; ``on_sleep`` lets a test act meanwhile."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.waits: list[float] = []
        self.advance_clock = False
        self.on_sleep: Callable[[int], None] | None = None

    def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        if self.advance_clock:
            self.clock.now += seconds
        if self.on_sleep is not None:
            self.on_sleep(len(self.waits))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def sleep(clock: ManualClock) -> Sleeper:
    return Sleeper(clock)


@pytest.fixture
def exchange(clock: ManualClock) -> FakeExchange:
    return FakeExchange(clock)


@pytest.fixture
def secret() -> list[str]:
    """The current API secret; a test rotates it by replacing the item."""
    return ["secret-one-0a1b2c3d4e"]


@pytest.fixture
def manager(
    store: TokenStore,
    exchange: FakeExchange,
    clock: ManualClock,
    sleep: Sleeper,
    secret: list[str],
) -> TokenManager:
    return make_manager(
        store, exchange, secret_fingerprint=lambda: fingerprint(secret[0]), clock=clock, sleep=sleep
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


def holder_writes_at_poll(
    poll: int, sleep: Sleeper, store: TokenStore, clock: ManualClock
) -> list[Token]:
    """The holder elsewhere stores a fresh token while the caller sleeps its ``poll``-th
    wait; the list gets that token."""
    written: list[Token] = []

    def holder_finishes(polls: int) -> None:
        if polls == poll:
            written.append(stored(store, clock, left=LIFETIME))

    sleep.on_sleep = holder_finishes
    return written


def hold_lock(store: TokenStore) -> None:
    """Another process takes the renewal lock (and never lets go during the test)."""
    assert store.take_lock(f"{OTHER_HOLDER}:1", f"{OTHER_HOLDER}:", 60.0)


# -- token(): the callers' path ----------------------------------------------------------


@pytest.mark.parametrize(
    "elapsed",
    [0.0, 3600.0 - RENEW_MANDATORY - 1.0],  # fresh; just above the mandatory window
    ids=["fresh", "advisory-window"],
)
def test_token_returns_the_stored_token_until_the_mandatory_window_without_exchanging(
    manager: TokenManager,
    store: TokenStore,
    clock: ManualClock,
    exchange: FakeExchange,
    elapsed: float,
) -> None:
    token = stored(store, clock, left=3600.0)
    clock.now += elapsed
    assert manager.token() == token
    assert exchange.calls == []


def test_token_exchanges_in_the_mandatory_window(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    old = stored(store, clock, left=3600.0)
    clock.now += 3600.0 - RENEW_MANDATORY + 1.0
    token = manager.token()
    assert token.value == "tok-issued-1"
    assert token.generation == old.generation + 1
    assert (token.issued_at, token.expires_at) == (clock.now, clock.now + LIFETIME)
    assert token.reason == "mandatory"
    assert store.load() == token
    assert len(exchange.calls) == 1


def test_token_exchanges_when_the_stored_token_has_expired(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    stored(store, clock, left=60.0)
    clock.now += 61.0
    assert manager.token().value == "tok-issued-1"
    assert len(exchange.calls) == 1


def test_token_exchanges_when_none_is_stored_and_then_reuses_it(
    manager: TokenManager, store: TokenStore, exchange: FakeExchange
) -> None:
    first = manager.token()
    assert first.generation == 1
    assert manager.token() == first
    assert len(exchange.calls) == 1
    assert store.records.counters() == {
        "renewals:mandatory:ok": 1,
        "exchange_attempts:mandatory:ok": 1,
    }


def test_a_renewal_records_who_renewed_and_releases_the_lock(
    manager: TokenManager, store: TokenStore
) -> None:
    token = manager.token()
    host, pid, nonce = token.renewed_by.split(":")
    assert (host, pid) == (socket.gethostname(), str(os.getpid()))
    assert len(nonce) == 8
    assert store.lock_holder() is None


# -- renew(): beat, operators ------------------------------------------------------------


def test_scheduled_renewal_does_not_exchange_while_the_token_is_fresh(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    token = stored(store, clock, left=3600.0)
    clock.now += 3600.0 - RENEW_BEFORE  # exactly at the advisory bound: still fresh
    assert manager.renew() == token
    assert exchange.calls == []


def test_scheduled_renewal_exchanges_inside_the_advisory_window(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    stored(store, clock, left=3600.0)
    clock.now += 3600.0 - RENEW_BEFORE + 1.0
    token = manager.renew()
    assert token.reason == "scheduled"
    assert token.generation == 2
    assert len(exchange.calls) == 1
    assert store.records.counters() == {
        "renewals:scheduled:ok": 1,
        "exchange_attempts:scheduled:ok": 1,
    }


def test_forced_renewal_always_exchanges_once(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    stored(store, clock, left=7000.0)
    first = manager.renew(force=True)
    assert (first.generation, first.reason) == (2, "manual")
    assert len(exchange.calls) == 1
    second = manager.renew(force=True)
    assert second.generation == 3
    assert len(exchange.calls) == 2


# -- renew(stale_token=...): after a 401 -------------------------------------------------


def test_renewal_after_401_returns_the_newer_stored_token_without_exchanging(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    refused = stored(store, clock, left=3600.0)
    newer = stored(store, clock, left=7200.0)  # someone renewed meanwhile
    assert manager.renew(stale_token=refused) == newer
    assert exchange.calls == []
    assert store.records.counters() == {"unauthorized": 1}


def test_renewal_after_401_exchanges_when_the_stored_token_is_the_refused_one(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    refused = stored(store, clock, left=3600.0, reason=RenewalReason.MANDATORY, age=1.0)
    manager.accepted(refused)  # the API accepted it before: a 401 now means revoked
    token = manager.renew(stale_token=refused)
    assert token.value != refused.value
    assert token.reason == "forced"
    assert len(exchange.calls) == 1
    assert store.records.counters() == {
        "unauthorized": 1,
        "forced_renewals": 1,
        "renewals:forced:ok": 1,
        "exchange_attempts:forced:ok": 1,
    }


# -- refusals: evidence, not timers -------------------------------------------------------


def test_a_token_refused_on_its_first_use_the_first_in_a_row_is_replaced_at_once(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    """Never accepted, but nothing before it was refused: revoked before use, or a beat
    renewal nobody called with. Not evidence of a wrong key."""
    refused = stored(store, clock, left=7190.0, reason=RenewalReason.SCHEDULED, age=10.0)
    renewed = manager.renew(stale_token=refused)
    assert renewed.replaces(refused, clock.now)
    assert renewed.first_use_refusals == 1  # the run its successor would continue
    assert len(exchange.calls) == 1
    looked = store.load()
    assert looked is not None
    assert looked.generation == renewed.generation


def test_a_token_refused_on_its_first_use_right_after_another_is_token_rejected_unsent(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    refused = stored(
        store, clock, left=7190.0, reason=RenewalReason.MANDATORY, age=10.0, in_a_row=1
    )
    with pytest.raises(TokenRejected, match="other environment") as caught:
        manager.renew(stale_token=refused)
    assert "2 tokens in a row" in str(caught.value)
    assert not caught.value.retryable
    assert exchange.calls == []
    assert caught.value.retry_after == REFUSED_BACKOFF
    assert store.records.counters() == {
        "unauthorized": 1,
        "never_accepted_rejected": 1,
        "breaker_openings:refused": 1,
    }


def test_a_token_known_refused_is_not_sent_again_until_its_backoff_ends_then_is_renewed(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    refused = stored(
        store, clock, left=7190.0, reason=RenewalReason.MANDATORY, age=10.0, in_a_row=1
    )
    with pytest.raises(TokenRejected):
        manager.renew(stale_token=refused)
    for _ in range(3):  # fail fast: no Redis command, nothing sent
        with pytest.raises(TokenRejected, match="in a row"):
            manager.token()
    assert store.records.counters()["unauthorized"] == 1
    clock.now += REFUSED_BACKOFF
    renewed = manager.token()
    assert renewed.replaces(refused, clock.now)
    assert renewed.reason == RenewalReason.FORCED
    assert len(exchange.calls) == 1
    assert store.records.counters()["unauthorized"] == 1  # its renewal met no new 401


def test_two_revocations_before_first_use_heal_after_one_backoff(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    first = manager.token()
    manager.accepted(first)
    second = manager.renew(stale_token=first)  # revoked after use: renewed at once
    third = manager.renew(stale_token=second)  # revoked before use: renewed once more
    with pytest.raises(TokenRejected) as caught:  # and the next one too: it waits
        manager.renew(stale_token=third)
    assert caught.value.retry_after is not None
    assert caught.value.retry_after <= 60.0
    clock.now += caught.value.retry_after
    healed = manager.token()
    manager.accepted(healed)
    assert healed.generation == 4
    assert len(exchange.calls) == 4


def test_a_key_whose_every_token_is_refused_costs_at_most_9_exchanges_in_2_hours(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    """Calls every 10 s for two hours, every token refused at its first use. (8 before the
    first refusal in a row was replaced at once, as a token revoked before use is.)"""
    end = clock.now + 7200.0
    pauses: list[float] = []
    while clock.now < end:
        try:
            token = manager.token()
            manager.renew(stale_token=token)  # its first call: 401
        except TokenRejected as exc:
            if exc.retry_after and (not pauses or exc.retry_after > pauses[-1] + 10.0):
                pauses.append(exc.retry_after)
        clock.now += 10.0
    print(f"\nwrong key: {len(exchange.calls)} exchanges in 2 h, pauses {pauses}")
    assert 2 <= len(exchange.calls) <= 9
    assert pauses[0] <= 60.0
    assert max(pauses) <= 1800.0


def test_a_replaced_secret_ends_a_refused_pause_in_the_process_that_met_it(
    manager: TokenManager,
    store: TokenStore,
    clock: ManualClock,
    exchange: FakeExchange,
    secret: list[str],
) -> None:
    refused = stored(
        store, clock, left=7190.0, reason=RenewalReason.MANDATORY, age=10.0, in_a_row=1
    )
    with pytest.raises(TokenRejected):
        manager.renew(stale_token=refused)
    with pytest.raises(TokenRejected, match="in a row"):
        manager.token()
    secret[0] = "secret-two-rotated-5f6e7d"
    renewed = manager.token()  # not the rest of a back-off of up to 30 minutes
    assert renewed.replaces(refused, clock.now)
    assert len(exchange.calls) == 1


def test_a_replaced_secret_ends_a_refused_pause_fleet_wide(
    manager: TokenManager,
    store: TokenStore,
    clock: ManualClock,
    exchange: FakeExchange,
    secret: list[str],
) -> None:
    refused = stored(
        store, clock, left=7190.0, reason=RenewalReason.MANDATORY, age=10.0, in_a_row=1
    )
    with pytest.raises(TokenRejected):
        manager.renew(stale_token=refused)
    record = store.records.load_breaker()
    assert record is not None
    assert record.secret_fingerprint == fingerprint(secret[0])
    secret[0] = "secret-two-rotated-5f6e7d"
    other = make_manager(store, exchange, secret_fingerprint=lambda: fingerprint(secret[0]))
    renewed = other.renew(stale_token=refused)  # another process's first 401 on it
    assert renewed.replaces(refused, clock.now)
    with pytest.raises(TokenRejected) as caught:  # the new secret's token is refused too
        other.renew(stale_token=renewed)
    # the run goes on (no acceptance between): its third token in a row, the second pause
    assert caught.value.retry_after == 2 * REFUSED_BACKOFF
    assert len(exchange.calls) == 1


@pytest.mark.parametrize(
    ("kind", "ends"),
    [
        (BreakerKind.REFUSED, True),
        (BreakerKind.REVOKED, True),
        (BreakerKind.REJECTED, True),
        (BreakerKind.RATE_LIMITED, False),
        (BreakerKind.UNAVAILABLE, False),
    ],
)
def test_an_operators_forced_renewal_ends_the_pauses_over_credentials_and_refused_tokens(
    manager: TokenManager,
    store: TokenStore,
    clock: ManualClock,
    exchange: FakeExchange,
    secret: list[str],
    kind: BreakerKind,
    ends: bool,
) -> None:
    """``renew --force`` says the cause is fixed (access restored, the key re-enabled);
    a pause over the endpoint's health (rate limited, unavailable) still holds."""
    record = BreakerRecord(kind, clock.now + 600.0, 1, fingerprint(secret[0]), "paused", 1)
    store.records.open_breaker(record, clock.now)
    if ends:
        assert manager.renew(force=True).value == "tok-issued-1"
    else:
        with pytest.raises(TokenExchangeError, match="paused"):
            manager.renew(force=True)
    assert len(exchange.calls) == (1 if ends else 0)


def test_a_token_accepted_by_another_process_and_refused_is_renewed_at_once_however_fresh(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    refused = stored(store, clock, left=7199.0, reason=RenewalReason.FORCED, age=1.0)
    store.mark_accepted(refused.generation)  # evidence left by another process
    assert manager.renew(stale_token=refused).value == "tok-issued-1"
    assert len(exchange.calls) == 1


def test_a_token_refused_before_its_first_use_is_renewed_once_and_the_next_one_waits(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    """A revocation landing between an exchange and the first call: renewed once more,
    but the token after it gets no such second chance (no loop)."""
    manager.accepted(stored(store, clock, left=7000.0))
    revoked_before_use = stored(store, clock, left=7100.0, reason=RenewalReason.FORCED)
    renewed = manager.renew(stale_token=revoked_before_use)
    assert len(exchange.calls) == 1
    with pytest.raises(TokenRejected, match="in a row"):
        manager.renew(stale_token=renewed)
    assert len(exchange.calls) == 1


def test_acceptance_is_written_to_redis_once_per_generation_and_process(
    manager: TokenManager, store: TokenStore, clock: ManualClock, fake_redis: redis.Redis
) -> None:
    token = stored(store, clock, left=3600.0)
    calls: list[int] = []
    original = store.mark_accepted

    def spy(generation: int) -> None:
        calls.append(generation)
        original(generation)

    store.mark_accepted = spy  # type: ignore[method-assign]
    for _ in range(5):
        manager.accepted(token)
    assert calls == [token.generation]
    assert store.accepted_generation() == token.generation
    store.mark_accepted(token.generation - 1)  # a late, older mark never lowers it
    assert store.accepted_generation() == token.generation


def test_forced_renewals_are_spaced_fleet_wide_and_none_fails(
    manager: TokenManager,
    store: TokenStore,
    clock: ManualClock,
    exchange: FakeExchange,
    sleep: Sleeper,
) -> None:
    """Revocations one after another (each token accepted, then refused): each is replaced,
    the second and later after waiting their turn, one FORCED_RENEWAL_SPACING apart in
    Redis time; no per-window budget turns a fifth revocation into failures."""
    manager.accepted(stored(store, clock, left=7000.0))
    for _ in range(6):
        current = store.load()
        assert current is not None
        store.mark_accepted(current.generation)
        assert manager.renew(stale_token=current).replaces(current, clock.now)
    assert len(exchange.calls) == 6
    assert store.records.counters()["forced_renewals"] == 6
    waits = [seconds for seconds in sleep.waits if seconds > 1.0]
    assert len(waits) == 5  # Redis's clock hardly moved: each waited about one spacing more
    assert all(w <= n * FORCED_RENEWAL_SPACING + 0.5 for n, w in enumerate(waits, 1))
    assert "breaker_openings:revoked" not in store.records.counters()


# -- an answer no better than the stored token ---------------------------------------------


def test_an_exchange_handing_back_the_stored_token_marks_it_final_until_it_expires(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    current = stored(store, clock, left=100.0)  # mandatory window
    exchange.outcomes.append(IssuedToken(current.value, expires_in=100.0))
    token = manager.token()
    assert token.value == current.value
    assert token.final
    assert store.records.counters()["renewals:mandatory:unchanged"] == 1
    for _ in range(50):  # every caller and beat until expiry: no further exchange
        clock.now += 1.9
        assert manager.token().value == current.value
        manager.renew()
    assert len(exchange.calls) == 1
    clock.now += 10.0  # expired: the next caller renews
    assert manager.token().value == "tok-issued-2"
    assert len(exchange.calls) == 2


def test_a_final_token_is_renewed_only_once_the_server_surely_let_it_go(
    manager: TokenManager,
    store: TokenStore,
    clock: ManualClock,
    exchange: FakeExchange,
    sleep: Sleeper,
) -> None:
    """Its expiry counts from before the request that issued it was sent: the server's may
    be as much later as that exchange took (``lag``). The renewal waits for that rather
    than be handed the same token back with 0 s left."""
    now = clock.now
    final = Token(
        "tok-final", now - 100.0, now + 1.0, 1, "x", RenewalReason.MANDATORY, final=True, lag=0.3
    )
    assert store.save(final) == (True, 1)
    clock.now += 1.1  # expired on our clock, maybe not yet on the server's
    sleep.advance_clock = True
    assert manager.token().value == "tok-issued-1"
    assert sleep.waits == [pytest.approx(0.2)]
    assert exchange.calls == [pytest.approx(now + 1.3)]


def test_an_answer_expiring_no_later_than_the_stored_token_is_no_better(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    current = stored(store, clock, left=100.0)
    exchange.outcomes.append(IssuedToken("tok-shorter", expires_in=50.0))
    assert manager.token().value == current.value
    assert store.load() == dataclasses.replace(current, generation=2, final=True)


def test_a_lifetime_of_zero_while_a_valid_token_is_stored_is_no_better_not_malformed(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    current = stored(store, clock, left=5.0)
    exchange.outcomes.append(IssuedToken(current.value, expires_in=0.0))
    assert manager.token().value == current.value
    assert len(exchange.calls) == 1


def test_a_lifetime_of_zero_without_a_valid_token_is_retried_as_an_endpoint_failure(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    exchange.outcomes.append(IssuedToken("tok-expiring-now", expires_in=0.0))
    assert manager.token().value == "tok-issued-2"
    assert len(exchange.calls) == 2


def test_a_forced_renewal_handed_back_the_refused_token_is_token_rejected(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    refused = stored(store, clock, left=3000.0)
    manager.accepted(refused)
    exchange.outcomes.append(IssuedToken(refused.value, expires_in=3000.0))
    with pytest.raises(TokenRejected, match="handed back the token the API refuses"):
        manager.renew(stale_token=refused)
    clock.now += 5.0  # past the 1 s an error without retry_after is remembered
    with pytest.raises(TokenRejected, match="handed back"):  # as it said: not asked again
        manager.token()
    assert len(exchange.calls) == 1


# -- breaker half-open ---------------------------------------------------------------------


def test_without_a_valid_token_one_caller_probes_the_endpoint_during_an_unavailable_pause(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    store.records.open_breaker(
        BreakerRecord(BreakerKind.UNAVAILABLE, clock.now + 60.0, 6, "", "HTTP 503"), clock.now
    )
    assert manager.token().value == "tok-issued-1"  # the probe got through and closed it
    assert store.records.load_breaker() is None


def test_a_failed_half_open_probe_is_one_attempt_and_reopens_the_breaker(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    store.records.open_breaker(
        BreakerRecord(BreakerKind.UNAVAILABLE, clock.now + 60.0, 6, "", "HTTP 503"), clock.now
    )
    exchange.outcomes = [TokenEndpointUnavailable("HTTP 503", status=503)] * EXCHANGE_ATTEMPTS
    with pytest.raises(TokenEndpointUnavailable, match="HTTP 503"):
        manager.token()
    assert len(exchange.calls) == 1
    record = store.records.load_breaker()
    assert record is not None
    assert record.failures == 7
    with pytest.raises(TokenEndpointUnavailable, match="paused"):  # next probe: an interval on
        manager.token()
    assert len(exchange.calls) == 1


def test_the_half_open_probe_is_taken_once_per_interval_fleet_wide(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    store.records.open_breaker(
        BreakerRecord(BreakerKind.UNAVAILABLE, clock.now + 60.0, 6, "", "HTTP 503"), clock.now
    )
    assert store.records.take_probe(PROBE_INTERVAL)  # another process probes right now
    with pytest.raises(TokenEndpointUnavailable, match="paused"):
        manager.token()
    assert exchange.calls == []


# -- single flight -----------------------------------------------------------------------


def test_a_caller_with_a_still_valid_token_gets_it_while_another_process_renews(
    manager: TokenManager,
    store: TokenStore,
    clock: ManualClock,
    exchange: FakeExchange,
    sleep: Sleeper,
) -> None:
    token = stored(store, clock, left=3600.0)
    clock.now += 3600.0 - 60.0  # mandatory window, a minute left
    hold_lock(store)
    assert manager.token() == token
    assert exchange.calls == []
    assert sleep.waits == []


def test_a_caller_without_a_token_waits_for_the_renewal_held_elsewhere(
    manager: TokenManager,
    store: TokenStore,
    clock: ManualClock,
    exchange: FakeExchange,
    sleep: Sleeper,
) -> None:
    hold_lock(store)
    written = holder_writes_at_poll(3, sleep, store, clock)
    assert manager.token() == written[0]
    assert exchange.calls == []
    assert len(sleep.waits) == 3
    assert all(0 < wait <= POLL_MAX for wait in sleep.waits)
    assert store.records.counters() == {"lock_waits": 1}


def test_waiting_for_another_process_starts_with_short_polls(
    manager: TokenManager, store: TokenStore, clock: ManualClock, sleep: Sleeper
) -> None:
    hold_lock(store)

    def holder_finishes(polls: int) -> None:
        if polls == 3:
            stored(store, clock, left=LIFETIME)

    sleep.on_sleep = holder_finishes
    manager.token()
    assert sleep.waits[0] <= POLL_INITIAL
    assert sum(sleep.waits) < POLL_MAX  # a renewal on loopback is awaited in short polls


def test_a_caller_without_a_token_gets_renewal_timeout_when_the_holder_never_writes(
    manager: TokenManager, store: TokenStore, exchange: FakeExchange, sleep: Sleeper
) -> None:
    hold_lock(store)
    with pytest.raises(RenewalTimeout, match=OTHER_HOLDER) as caught:
        manager.token()
    assert caught.value.retryable
    assert exchange.calls == []
    assert len(sleep.waits) == math.ceil(manager.wait_limit / POLL_INITIAL) - 1
    assert store.records.counters() == {"lock_waits": 1}


def test_a_waiter_outlasts_a_dead_holder_and_the_whole_renewal_of_the_next_one(
    manager: TokenManager, store: TokenStore, clock: ManualClock, sleep: Sleeper
) -> None:
    """The caller arrives just after a holder took the lock and died; when that lock
    expires another process takes it first and needs its whole lock TTL. The caller still
    gets that process's token instead of a RenewalTimeout (CI once saw one in fault row 6)."""
    hold_lock(store)
    one_lock_ttl = math.ceil(manager.renewal_limit / POLL_INITIAL)
    next_holder = "third-host:7:cafebabe"

    def holders(polls: int) -> None:
        if polls == one_lock_ttl - 5:  # the dead holder's lock expires...
            store.redis.delete(store.keys.lock)
            # ...and another process wins it before our caller looks again
            assert store.take_lock(f"{next_holder}:1", f"{next_holder}:", 60.0)
        if polls == 2 * one_lock_ttl - 10:
            stored(store, clock, left=LIFETIME)

    sleep.on_sleep = holders
    assert manager.token().expires_at > clock()
    assert len(sleep.waits) == 2 * one_lock_ttl - 10


def test_the_renewal_limit_covers_the_longest_renewal(
    manager: TokenManager, exchange: FakeExchange, sleep: Sleeper
) -> None:
    """Every try times out (0.1 s here) and asks for the longest Retry-After still obeyed
    under the lock; the back-off comes on top of it."""
    exchange.outcomes = [
        TokenEndpointUnavailable("HTTP 503", status=503, retry_after=EXCHANGE_RETRY_WAIT_MAX)
    ] * EXCHANGE_ATTEMPTS
    with pytest.raises(TokenEndpointUnavailable):
        manager.renew(force=True)
    assert len(exchange.calls) == EXCHANGE_ATTEMPTS
    assert all(
        EXCHANGE_RETRY_WAIT_MAX <= wait <= 2 * EXCHANGE_RETRY_WAIT_MAX for wait in sleep.waits
    )
    worst = EXCHANGE_ATTEMPTS * 0.1 + (EXCHANGE_ATTEMPTS - 1) * 2 * EXCHANGE_RETRY_WAIT_MAX
    assert manager.renewal_limit > worst


# -- breaker -----------------------------------------------------------------------------


def test_rejected_credentials_open_the_breaker_for_that_secret(
    manager: TokenManager,
    store: TokenStore,
    clock: ManualClock,
    exchange: FakeExchange,
    secret: list[str],
    sleep: Sleeper,
) -> None:
    exchange.outcomes = [CredentialsRejected("token endpoint refused (HTTP 401)", status=401)]
    with pytest.raises(CredentialsRejected):
        manager.token()
    assert len(exchange.calls) == 1  # never retried
    assert sleep.waits == []
    record = store.records.load_breaker()
    assert record is not None
    assert record.kind == "rejected"
    assert record.until == clock.now + REJECTED_BACKOFF
    assert record.secret_fingerprint == fingerprint(secret[0])
    assert secret[0] not in record.detail
    assert store.records.counters() == {
        "renewals:mandatory:rejected": 1,
        "exchange_attempts:mandatory:rejected": 1,
        "breaker_openings:rejected": 1,
    }
    assert store.lock_holder() is None


def test_while_the_rejected_breaker_is_open_renewal_raises_without_exchanging(
    manager: TokenManager, exchange: FakeExchange
) -> None:
    exchange.outcomes = [CredentialsRejected("token endpoint refused (HTTP 401)", status=401)]
    with pytest.raises(CredentialsRejected):
        manager.token()
    with pytest.raises(CredentialsRejected, match="paused"):
        manager.token()
    assert len(exchange.calls) == 1  # (an operator's renew --force would try: see above)


def test_a_waiter_that_gets_the_lock_after_a_failed_renewal_obeys_the_breaker_it_opened(
    manager: TokenManager,
    store: TokenStore,
    exchange: FakeExchange,
    clock: ManualClock,
    sleep: Sleeper,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller found no breaker; before it took the lock, the process holding it got a
    429, paused exchanges and let go. Taking the lock next, the caller must not make a
    second refused exchange (fault rows 3, 8 and 9 count refused exchanges exactly)."""
    hold_lock(store)
    take_lock = store.take_lock

    def holder_fails_between_our_breaker_look_and_our_lock(
        value: str, prefix: str, lease: float
    ) -> bool:
        if sleep.waits:  # the caller has waited once; now, just after it looked...
            record = BreakerRecord(BreakerKind.RATE_LIMITED, clock.now + 30.0, 1, "", "HTTP 429")
            store.records.open_breaker(record, clock.now)
            store.redis.delete(store.keys.lock)
        return take_lock(value, prefix, lease)

    monkeypatch.setattr(store, "take_lock", holder_fails_between_our_breaker_look_and_our_lock)
    with pytest.raises(ExchangeRateLimited, match="paused"):
        manager.token()
    assert exchange.calls == []
    assert store.lock_holder() is None


def test_a_new_secret_goes_through_the_rejected_breaker_and_success_closes_it(
    manager: TokenManager, store: TokenStore, exchange: FakeExchange, secret: list[str]
) -> None:
    exchange.outcomes = [CredentialsRejected("token endpoint refused (HTTP 401)", status=401)]
    with pytest.raises(CredentialsRejected):
        manager.token()
    secret[0] = "secret-two-rotated-5f6e7d"
    token = manager.token()
    assert token.value == "tok-issued-2"
    assert store.records.load_breaker() is None


def test_a_new_secret_that_is_rejected_too_reopens_the_breaker_for_it(
    manager: TokenManager, store: TokenStore, exchange: FakeExchange, secret: list[str]
) -> None:
    exchange.outcomes = [
        CredentialsRejected("token endpoint refused (HTTP 401)", status=401),
        CredentialsRejected("token endpoint refused (HTTP 401)", status=401),
    ]
    with pytest.raises(CredentialsRejected):
        manager.token()
    secret[0] = "secret-two-also-wrong-11"
    with pytest.raises(CredentialsRejected):
        manager.token()
    record = store.records.load_breaker()
    assert record is not None
    assert record.secret_fingerprint == fingerprint(secret[0])
    assert len(exchange.calls) == 2


def test_a_rate_limited_exchange_pauses_exchanges_until_retry_after(
    manager: TokenManager,
    store: TokenStore,
    fake_redis: redis.Redis,
    clock: ManualClock,
    exchange: FakeExchange,
) -> None:
    exchange.outcomes = [ExchangeRateLimited("HTTP 429", retry_after=30.0)]
    with pytest.raises(ExchangeRateLimited):
        manager.token()
    record = store.records.load_breaker()
    assert record is not None
    assert (record.kind, record.until) == ("rate_limited", clock.now + 30.0 + RETRY_AFTER_MARGIN)
    # the record outlives its pause, to count failures in a row
    assert fake_redis.pttl(store.keys.breaker) > 30_000

    clock.now += 20.0
    with pytest.raises(ExchangeRateLimited) as caught:
        manager.token()
    assert caught.value.retry_after == pytest.approx(10.0 + RETRY_AFTER_MARGIN)
    assert len(exchange.calls) == 1

    clock.now += 11.0  # past ``until``: the record no longer pauses anything
    assert manager.token().value == "tok-issued-2"
    assert len(exchange.calls) == 2
    assert store.records.counters()["renewals:mandatory:rate_limited"] == 1
    assert store.records.counters()["breaker_openings:rate_limited"] == 1


def test_a_rate_limit_without_retry_after_pauses_for_the_default_backoff(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    exchange.outcomes = [ExchangeRateLimited("HTTP 429")]
    with pytest.raises(ExchangeRateLimited):
        manager.token()
    record = store.records.load_breaker()
    assert record is not None
    assert record.until == clock.now + RATE_LIMITED_BACKOFF + RETRY_AFTER_MARGIN
    assert len(exchange.calls) == 1  # a 429 is not retried while holding the lock


def test_an_unavailable_endpoint_is_retried_then_pauses_exchanges(
    manager: TokenManager,
    store: TokenStore,
    clock: ManualClock,
    exchange: FakeExchange,
    sleep: Sleeper,
) -> None:
    exchange.outcomes = [TokenEndpointUnavailable("HTTP 503", status=503)] * EXCHANGE_ATTEMPTS
    with pytest.raises(TokenEndpointUnavailable):
        manager.token()
    assert len(exchange.calls) == EXCHANGE_ATTEMPTS
    assert len(sleep.waits) == EXCHANGE_ATTEMPTS - 1
    assert all(0 <= wait <= EXCHANGE_RETRY_WAIT_MAX for wait in sleep.waits)
    record = store.records.load_breaker()
    assert record is not None
    assert (record.kind, record.failures) == ("unavailable", 1)
    pause = record.until - clock.now
    assert UNAVAILABLE_BACKOFF / 2 <= pause <= UNAVAILABLE_BACKOFF
    assert pause != UNAVAILABLE_BACKOFF  # jittered
    assert store.records.counters() == {
        "renewals:mandatory:failed": 1,
        "exchange_attempts:mandatory:failed": EXCHANGE_ATTEMPTS,  # every HTTP attempt
        "breaker_openings:unavailable": 1,
    }

    with pytest.raises(TokenEndpointUnavailable, match="paused"):
        manager.token()
    assert len(exchange.calls) == EXCHANGE_ATTEMPTS


@pytest.mark.parametrize(
    "failure",
    [TokenEndpointUnavailable("HTTP 502", status=502), MalformedTokenResponse("not JSON")],
)
def test_an_endpoint_that_recovers_within_the_attempts_gives_a_token(
    manager: TokenManager,
    store: TokenStore,
    exchange: FakeExchange,
    sleep: Sleeper,
    failure: TokenExchangeError,
) -> None:
    exchange.outcomes = [failure, failure]
    assert manager.token().value == "tok-issued-3"
    assert len(sleep.waits) == 2
    assert store.records.load_breaker() is None


def test_repeated_endpoint_failures_grow_the_jittered_backoff(
    manager: TokenManager,
    store: TokenStore,
    fake_redis: redis.Redis,
    clock: ManualClock,
    exchange: FakeExchange,
) -> None:
    exchange.outcomes = [TokenEndpointUnavailable("HTTP 503", status=503)] * (2 * EXCHANGE_ATTEMPTS)
    with pytest.raises(TokenEndpointUnavailable):
        manager.token()
    first = store.records.load_breaker()
    assert first is not None
    clock.now = first.until  # the pause is over; the record remembers the failure
    with pytest.raises(TokenEndpointUnavailable):
        manager.token()
    second = store.records.load_breaker()
    assert second is not None
    assert second.failures == 2
    assert second.until - clock.now > UNAVAILABLE_BACKOFF  # doubled, then jittered by half


def test_a_5xx_retry_after_is_honoured_before_the_next_exchange(
    manager: TokenManager,
    store: TokenStore,
    clock: ManualClock,
    exchange: FakeExchange,
    sleep: Sleeper,
) -> None:
    sleep.advance_clock = True
    exchange.outcomes = [TokenEndpointUnavailable("HTTP 503", status=503, retry_after=30.0)] * 3
    started = clock.now
    with pytest.raises(TokenEndpointUnavailable):
        manager.token()
    gaps = [b - a for a, b in zip(exchange.calls, exchange.calls[1:], strict=False)]
    assert all(gap >= 30.0 for gap in gaps)
    record = store.records.load_breaker()
    assert record is not None
    assert record.until >= started + 30.0


@pytest.mark.parametrize(
    "kind",
    [BreakerKind.REJECTED, BreakerKind.RATE_LIMITED, BreakerKind.UNAVAILABLE],
    ids=lambda kind: f"{kind}-breaker",
)
def test_a_still_valid_token_is_returned_while_the_breaker_is_open(
    manager: TokenManager,
    store: TokenStore,
    clock: ManualClock,
    exchange: FakeExchange,
    secret: list[str],
    kind: BreakerKind,
) -> None:
    token = stored(store, clock, left=3600.0)
    clock.now += 3600.0 - 60.0  # mandatory window
    record = BreakerRecord(kind, clock.now + 30.0, 1, fingerprint(secret[0]), "paused")
    store.records.open_breaker(record, clock.now)
    assert manager.token() == token
    assert exchange.calls == []


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        (BreakerKind.REJECTED, CredentialsRejected),
        (BreakerKind.RATE_LIMITED, ExchangeRateLimited),
        (BreakerKind.UNAVAILABLE, TokenEndpointUnavailable),
    ],
)
def test_without_a_valid_token_an_open_breaker_raises_its_error(
    manager: TokenManager,
    store: TokenStore,
    clock: ManualClock,
    exchange: FakeExchange,
    secret: list[str],
    kind: BreakerKind,
    error: type[Exception],
) -> None:
    record = BreakerRecord(kind, clock.now + 30.0, 1, fingerprint(secret[0]), "why it paused")
    store.records.open_breaker(record, clock.now)
    assert store.records.take_probe(PROBE_INTERVAL)  # another process is probing (half-open)
    with pytest.raises(error, match="paused for 30 s more: why it paused"):
        manager.token()
    assert exchange.calls == []


@pytest.mark.parametrize(
    "failure",
    [
        TokenEndpointUnavailable("HTTP 503", status=503),
        ExchangeRateLimited("HTTP 429", retry_after=30.0),
    ],
    ids=["unavailable", "rate-limited"],
)
def test_a_failed_renewal_in_the_mandatory_window_still_returns_the_valid_token(
    manager: TokenManager,
    store: TokenStore,
    clock: ManualClock,
    exchange: FakeExchange,
    failure: TokenExchangeError,
) -> None:
    token = stored(store, clock, left=3600.0)
    clock.now += 3600.0 - 60.0
    exchange.outcomes = [failure] * EXCHANGE_ATTEMPTS
    assert manager.token() == token
    assert store.records.load_breaker() is not None


# -- races and outages -------------------------------------------------------------------


def test_a_slow_exchange_refused_by_a_newer_generation_returns_the_newer_token(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    stored(store, clock, left=3600.0)
    newer: list[Token] = []
    exchange.during = lambda: newer.append(stored(store, clock, left=LIFETIME, value="tok-newer"))
    assert manager.renew(force=True) == newer[0]
    assert store.load() == newer[0]
    assert store.generation() == 2
    assert len(exchange.calls) == 1


def test_a_token_that_expires_before_it_is_stored_is_malformed(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    clock.now -= 3600.0  # the exchange is seen to start an hour ago ...
    exchange.outcomes = [IssuedToken("tok-short-lived", expires_in=60.0)]  # ... for a minute
    with pytest.raises(MalformedTokenResponse, match="expired before it could be stored"):
        manager.token()
    assert store.load() is None
    assert store.generation() == 0


def test_token_uses_its_last_token_when_redis_goes_down(
    manager: TokenManager, store: TokenStore, clock: ManualClock
) -> None:
    token = stored(store, clock, left=3600.0)
    assert manager.token() == token
    store.redis = dead_redis()
    assert manager.token() == token


def test_token_raises_store_unavailable_when_redis_is_down_and_its_last_token_expired(
    manager: TokenManager, store: TokenStore, clock: ManualClock
) -> None:
    stored(store, clock, left=3600.0)
    manager.token()
    store.redis = dead_redis()
    clock.now += 3600.0
    with pytest.raises(StoreUnavailable):
        manager.token()


def test_token_raises_store_unavailable_when_redis_is_down_and_it_has_no_token(
    manager: TokenManager, store: TokenStore
) -> None:
    store.redis = dead_redis()
    with pytest.raises(StoreUnavailable, match="MERCHANT_REDIS_URL"):
        manager.token()


def test_repr_names_the_store_only(manager: TokenManager, store: TokenStore) -> None:
    manager.token()
    assert repr(manager) == f"TokenManager(store={store!r})"


# -- this process's copy of the token ----------------------------------------------------


@pytest.fixture
def copying_manager(
    store: TokenStore, exchange: FakeExchange, clock: ManualClock, sleep: Sleeper
) -> TokenManager:
    """A manager that trusts its copy for 1 s of the injected clock."""
    return make_manager(
        store,
        exchange,
        clock=clock,
        sleep=sleep,
        local_copy_ttl=1.0,
        monotonic=clock,
        wake_ups=True,
    )


def test_the_copy_serves_calls_without_reading_redis_until_it_is_due_for_a_read(
    copying_manager: TokenManager, store: TokenStore, fake_redis: redis.Redis, clock: ManualClock
) -> None:
    token = stored(store, clock, left=3600.0)
    assert copying_manager.token() == token
    fake_redis.delete(store.keys.token)  # a read now would find nothing
    clock.now += 0.5
    assert copying_manager.token() == token
    newer = stored(store, clock, left=3600.0, value="tok-newer")
    clock.now += 0.6  # past the copy's second: Redis is read again
    assert copying_manager.token() == newer


def test_the_copy_is_not_used_once_it_enters_the_mandatory_window(
    copying_manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    stored(store, clock, left=RENEW_MANDATORY + 0.5)
    copying_manager.token()
    clock.now += 0.6  # inside the copy's second, but now in the mandatory window
    assert copying_manager.token().value.startswith("tok-issued")
    assert len(exchange.calls) == 1


def test_a_401_on_a_stale_copy_takes_the_stored_token_without_exchanging(
    copying_manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    old = stored(store, clock, left=3600.0)
    assert copying_manager.token() == old
    newer = stored(store, clock, left=3600.0, value="tok-renewed-elsewhere")
    assert copying_manager.renew(stale_token=old) == newer
    assert copying_manager.token() == newer  # the copy follows, within its second
    assert exchange.calls == []


def test_a_token_read_before_a_newer_one_was_kept_does_not_replace_the_copy(
    copying_manager: TokenManager,
    store: TokenStore,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Thread A reads the store; meanwhile thread B meets a 401 and keeps the token renewed
    elsewhere; A then keeps what it read. The copy must stay the newer token."""
    old = stored(store, clock, left=3600.0)
    assert copying_manager.token() == old
    clock.now += 1.1  # the copy is due for a read
    read = store.load
    newer: list[Token] = []

    def slow_read() -> Token | None:
        monkeypatch.setattr(store, "load", read)
        snapshot = read()  # thread A's read: the old token
        newer.append(stored(store, clock, left=3600.0, value="tok-renewed-elsewhere"))
        assert copying_manager.renew(stale_token=old) == newer[0]  # thread B
        return snapshot

    monkeypatch.setattr(store, "load", slow_read)
    assert copying_manager.token() == old  # what thread A read, and may use once
    assert copying_manager.token() == newer[0]  # the copy, within its second


def test_threads_of_one_process_wait_for_its_renewal_in_turn_without_polling_redis(
    copying_manager: TokenManager,
    store: TokenStore,
    clock: ManualClock,
    exchange: FakeExchange,
    sleep: Sleeper,
) -> None:
    """A 401 storm in one process: eight threads hold the revoked token. One renews; the
    others wait for their turn in the process, not by polling the Redis lock, and then take
    the new token from the process's copy."""
    old = stored(store, clock, left=3600.0)
    copying_manager.accepted(old)  # in use before the revocation
    exchange.during = lambda: time.sleep(0.2)  # the others arrive while it exchanges
    start = threading.Barrier(8)
    got: list[Token] = []

    def after_401() -> None:
        start.wait()
        got.append(copying_manager.renew(stale_token=old))

    threads = [threading.Thread(target=after_401) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(exchange.calls) == 1
    assert len({token.value for token in got}) == 1
    assert got[0].value != old.value
    assert sleep.waits == []  # nobody polled the Redis lock
    # one 401 per process reaches Redis; its siblings take the copy it kept (a storm's
    # Redis commands do not grow with the threads)
    assert store.records.counters()["unauthorized"] == 1


def test_a_thread_with_a_valid_token_does_not_queue_behind_another_threads_renewal(
    copying_manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    old = stored(store, clock, left=RENEW_MANDATORY / 2)  # due for renewal, still valid
    exchanging, release = threading.Event(), threading.Event()

    def slow_exchange() -> None:
        exchanging.set()
        assert release.wait(10)

    exchange.during = slow_exchange
    renewer_got: list[Token] = []
    renewer = threading.Thread(target=lambda: renewer_got.append(copying_manager.token()))
    renewer.start()
    try:
        assert exchanging.wait(10)
        assert copying_manager.token() == old  # at once, while the other thread exchanges
    finally:
        release.set()
        renewer.join()
    assert renewer_got[0].value.startswith("tok-issued")
    assert len(exchange.calls) == 1


def test_a_401_does_not_wait_behind_a_thread_waiting_for_another_process(
    manager: TokenManager, store: TokenStore, clock: ManualClock, sleep: Sleeper
) -> None:
    """Thread A's manual renewal waits for another process's lock; meanwhile thread B's 401
    finds the valid token in the store at once: only looks at the store take turns."""
    revoked = stored(store, clock, left=3600.0, value="tok-revoked")
    valid = stored(store, clock, left=3600.0, value="tok-valid")
    hold_lock(store)
    sleep.on_sleep = lambda polls: time.sleep(0.005)  # A polls in real time
    outcome: list[Token] = []
    waiting = threading.Thread(target=lambda: outcome.append(manager.renew(force=True)))
    waiting.start()
    try:
        wait_until(lambda: len(sleep.waits) >= 3, "thread A polling", 10.0)
        assert manager.renew(stale_token=revoked) == valid
        assert waiting.is_alive()  # B did not wait for A
    finally:
        newer = stored(store, clock, left=3600.0, value="tok-newer")
        waiting.join(timeout=30)
    assert outcome == [newer]


def test_threads_meeting_a_refusal_in_a_back_off_share_its_token_rejected(
    copying_manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    """Eight threads meet a 401 on a token refused on its first use right after another:
    one asks the store and opens the ``refused`` pause; the others get its TokenRejected
    instead of trying again themselves (no second opening, nothing exchanged)."""
    old = stored(store, clock, left=3600.0, in_a_row=1)
    loaded = store.records.load_breaker

    def slow_load() -> Any:
        time.sleep(0.2)  # the siblings arrive while it decides
        return loaded()

    store.records.load_breaker = slow_load  # type: ignore[method-assign]
    start = threading.Barrier(8)
    outcomes: list[str] = []

    def after_401() -> None:
        start.wait()
        try:
            copying_manager.renew(stale_token=old)
            outcomes.append("token")
        except (TokenRejected, RenewalTimeout) as exc:
            outcomes.append(type(exc).__name__)

    threads = [threading.Thread(target=after_401) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes == ["TokenRejected"] * 8
    assert exchange.calls == []
    assert store.records.counters()["breaker_openings:refused"] == 1


def test_a_thread_whose_sibling_renews_past_the_wait_limit_gets_renewal_timeout(
    copying_manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    """A sibling still renewing after two waits of the wait limit (here it has not even
    reached the exchange): the caller gets the retryable RenewalTimeout rather than make a
    second forced renewal beside it."""
    old = stored(store, clock, left=3600.0)
    copying_manager.accepted(old)
    copying_manager.flight.wait_limit = 0.2
    renewing, release = threading.Event(), threading.Event()
    renew_forced = copying_manager._renew_forced

    def slow_renewal(*args: Any) -> Token:
        renewing.set()
        assert release.wait(10)
        return renew_forced(*args)

    copying_manager._renew_forced = slow_renewal  # type: ignore[method-assign,assignment]
    renewer_got: list[Token] = []
    renewer = threading.Thread(
        target=lambda: renewer_got.append(copying_manager.renew(stale_token=old))
    )
    renewer.start()
    try:
        assert renewing.wait(10)
        with pytest.raises(RenewalTimeout, match="another thread of this process"):
            copying_manager.renew(stale_token=old)
    finally:
        release.set()
        renewer.join()
    assert renewer_got[0].replaces(old, clock.now)
    assert len(exchange.calls) == 1


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")  # Python 3.12+: we mean it
def test_a_forked_child_renews_although_a_parent_thread_held_the_locks_at_the_fork(
    copying_manager: TokenManager, store: TokenStore, clock: ManualClock
) -> None:
    """A client made before a fork (say a preloaded web app): a parent thread holds the
    process's turn and the copy's lock at that moment; the child must still renew."""
    old = stored(store, clock, left=3600.0)
    assert copying_manager.token() == old
    holding, release = threading.Event(), threading.Event()

    def hold_both() -> None:
        with copying_manager.flight.turn, copying_manager.copy._lock:
            holding.set()
            release.wait(10)

    holder = threading.Thread(target=hold_both)
    holder.start()
    assert holding.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: renew and keep the token, then report by exit status
        try:
            clock.now += 1.1  # the copy is due for a read, and then kept again
            assert copying_manager.token() == old
            renewed = copying_manager.renew(force=True)
            os._exit(0 if copying_manager.token() == renewed else 1)
        except BaseException:
            os._exit(2)
    release.set()
    holder.join()
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    if done == (0, 0):
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the child hung on a lock held by a parent's thread at the fork")
    assert os.waitstatus_to_exitcode(done[1]) == 0


# -- a refused token is never handed out, whatever its window (review of issue 27) --------


def _refused_elsewhere(store: TokenStore, token: Token) -> None:
    """Another process met a 401 on ``token``: its record says refused, and that process
    holds the renewal lock for the replacement."""
    holder = f"{OTHER_HOLDER}:1"
    _, outcome = store.look_after_401(token.generation, holder, f"{OTHER_HOLDER}:", 60.0, 30.0)
    assert outcome == 1
    looked = store.load()
    assert looked is not None
    assert looked.refused


def test_a_refused_token_in_the_mandatory_window_is_not_handed_out_while_another_replaces_it(
    manager: TokenManager, store: TokenStore, clock: ManualClock, sleep: Sleeper
) -> None:
    """Under 120 s left, the token was the mandatory renewal's fallback, handed out while
    another process held the lock: a refused one must wait for its replacement instead."""
    refused = stored(store, clock, left=100.0)
    manager.accepted(refused)
    _refused_elsewhere(store, refused)
    written = holder_writes_at_poll(3, sleep, store, clock)
    got = manager.token()
    assert got == written[0]
    assert not got.refused


def test_a_refused_token_in_the_mandatory_window_is_not_the_fallback_of_a_pause(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    """Its replacement's exchange was refused (a secret reset): calls get the pause's error,
    past the 1 s a process remembers it, not the refused token (which is still valid)."""
    refused = stored(store, clock, left=100.0)
    manager.accepted(refused)
    exchange.outcomes = [CredentialsRejected("the secret was reset")]
    with pytest.raises(CredentialsRejected):
        manager.renew(stale_token=refused)
    for _ in range(3):
        clock.now += 1.5
        with pytest.raises(CredentialsRejected, match="paused"):
            manager.token()
    assert len(exchange.calls) == 1


def test_a_newer_token_refused_elsewhere_does_not_replace_the_one_a_call_was_refused_with(
    manager: TokenManager, store: TokenStore, clock: ManualClock, sleep: Sleeper
) -> None:
    """Two revocations close together: this process met a 401 on its copy of generation 1
    while generation 2, stored since, was refused by another process, which replaces it.
    The call waits for generation 3 instead of meeting a second 401 with generation 2."""
    first = stored(store, clock, left=3600.0)
    manager.accepted(first)
    second = stored(store, clock, left=3600.0)
    _refused_elsewhere(store, second)
    written = holder_writes_at_poll(3, sleep, store, clock)
    got = manager.renew(stale_token=first)
    assert got == written[0]
    assert got.generation == 3


def test_a_lock_taken_after_a_401_is_released_when_the_renewal_fails_before_using_it(
    store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    """The 401's look takes the fleet's lock for the forced renewal; if that renewal ends
    before reaching it (here another thread of the process keeps the turn past the renewal
    limit), the holding is released, not left to its watchdog."""
    manager = make_manager(store, exchange, clock=clock, exchange_timeout=0.1)
    manager.flight.renewal_limit = 0.3
    refused = stored(store, clock, left=3600.0)
    manager.accepted(refused)
    look = manager.refusals._look
    sibling_has_the_turn = threading.Event()
    let_go = threading.Event()

    def sibling_keeps_the_turn() -> None:
        with manager.flight.turn:
            sibling_has_the_turn.set()
            let_go.wait(10.0)

    def look_then_lose_the_turn(stale: Token, new_401: bool) -> Any:
        found = look(stale, new_401)
        threading.Thread(target=sibling_keeps_the_turn, daemon=True).start()
        sibling_has_the_turn.wait(10.0)
        return found

    manager.refusals._look = look_then_lose_the_turn  # type: ignore[method-assign]
    try:
        with pytest.raises(RenewalTimeout):
            manager.renew(stale_token=refused)
        assert store.lock_holder() is None
    finally:
        let_go.set()
