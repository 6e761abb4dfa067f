"""TokenManager and its Renewer (renewal/manager.py) on fakeredis with an injected clock,
sleep and exchange: the windows of the callers' and beat's paths, the exchange's tries
under the lock, an answer no better than the stored token, races and outages, a fork."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from merchant_tasks.exceptions import (
    ExchangeRateLimited,
    MalformedTokenResponse,
    StoreUnavailable,
    TokenEndpointUnavailable,
    TokenExchangeError,
    TokenRejected,
)
from merchant_tasks.renewal.life import EXCHANGE_ATTEMPTS, EXCHANGE_RETRY_WAIT_MAX, Fly, Unhold
from merchant_tasks.renewal.manager import TokenManager
from merchant_tasks.store import scripts
from merchant_tasks.store.token_store import BreakerRecord, TokenStore
from merchant_tasks.token import BreakerKind, IssuedToken, RenewalReason, Token, fingerprint
from support.clock import ManualClock, Sleeper
from support.redis_conditions import dead_redis
from support.renewal import FakeExchange, LockHolder, Renewal, when_sent
from support.tokens import LIFETIME, stored

RENEW_BEFORE = 480.0
RENEW_MANDATORY = 120.0


# -- token(): the callers' path ----------------------------------------------------------


@pytest.mark.parametrize(
    "elapsed",
    [0.0, 3600.0 - RENEW_MANDATORY - 1.0],  # fresh; just above the mandatory window
    ids=["fresh", "advisory-window"],
)
def test_token_returns_the_stored_token_until_the_mandatory_window_without_exchanging(
    renewal: Renewal, elapsed: float
) -> None:
    token = stored(renewal.store, renewal.clock, left=3600.0)
    renewal.clock.now += elapsed
    assert renewal.manager.token() == token
    assert renewal.exchange.calls == []


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


def test_a_final_token_is_renewed_only_once_the_server_surely_let_it_go(renewal: Renewal) -> None:
    """Its expiry counts from before the request that issued it was sent: the server's may
    be as much later as that exchange took (``lag``). The renewal waits for that rather
    than be handed the same token back with 0 s left."""
    now = renewal.clock.now
    final = Token(
        "tok-final", now - 100.0, now + 1.0, 1, "x", RenewalReason.MANDATORY, final=True, lag=0.3
    )
    assert renewal.store.save(final) == (True, 1)
    renewal.clock.now += 1.1  # expired on our clock, maybe not yet on the server's
    renewal.sleep.advance_clock = True
    assert renewal.manager.token().value == "tok-issued-1"
    assert renewal.sleep.waits == [pytest.approx(0.2)]
    assert renewal.exchange.calls == [pytest.approx(now + 1.3)]


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


# -- the exchange's tries, under the lock ------------------------------------------------


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
    assert manager.limits.renewal > worst


@pytest.mark.parametrize(
    "failure",
    [TokenEndpointUnavailable("HTTP 502", status=502), MalformedTokenResponse("not JSON")],
)
def test_an_endpoint_that_recovers_within_the_attempts_gives_a_token(
    renewal: Renewal, failure: TokenExchangeError
) -> None:
    renewal.exchange.outcomes = [failure, failure]
    assert renewal.manager.token().value == "tok-issued-3"
    assert len(renewal.sleep.waits) == 2
    assert renewal.store.records.load_breaker() is None


def test_a_5xx_retry_after_is_honoured_before_the_next_exchange(renewal: Renewal) -> None:
    renewal.sleep.advance_clock = True
    renewal.exchange.outcomes = [
        TokenEndpointUnavailable("HTTP 503", status=503, retry_after=30.0)
    ] * 3
    started = renewal.clock.now
    with pytest.raises(TokenEndpointUnavailable):
        renewal.manager.token()
    gaps = [b - a for a, b in zip(renewal.exchange.calls, renewal.exchange.calls[1:], strict=False)]
    assert all(gap >= 30.0 for gap in gaps)
    record = renewal.store.records.load_breaker()
    assert record is not None
    assert record.until >= started + 30.0


# -- a still-valid token while exchanges are paused or failing ---------------------------


@pytest.mark.parametrize(
    "kind",
    [BreakerKind.REJECTED, BreakerKind.RATE_LIMITED, BreakerKind.UNAVAILABLE],
    ids=lambda kind: f"{kind}-breaker",
)
def test_a_still_valid_token_is_returned_while_the_breaker_is_open(
    renewal: Renewal, kind: BreakerKind
) -> None:
    token = stored(renewal.store, renewal.clock, left=3600.0)
    renewal.clock.now += 3600.0 - 60.0  # mandatory window
    record = BreakerRecord(
        kind, renewal.clock.now + 30.0, 1, fingerprint(renewal.secret[0]), "paused"
    )
    renewal.store.records.open_breaker(record, renewal.clock.now)
    assert renewal.manager.token() == token
    assert renewal.exchange.calls == []


@pytest.mark.parametrize(
    "failure",
    [
        TokenEndpointUnavailable("HTTP 503", status=503),
        ExchangeRateLimited("HTTP 429", retry_after=30.0),
    ],
    ids=["unavailable", "rate-limited"],
)
def test_a_failed_renewal_in_the_mandatory_window_still_returns_the_valid_token(
    renewal: Renewal, failure: TokenExchangeError
) -> None:
    token = stored(renewal.store, renewal.clock, left=3600.0)
    renewal.clock.now += 3600.0 - 60.0
    renewal.exchange.outcomes = [failure] * EXCHANGE_ATTEMPTS
    assert renewal.manager.token() == token
    assert renewal.store.records.load_breaker() is not None


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


# -- a fork ------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")  # Python 3.12+: we mean it
def test_a_forked_child_renews_although_a_parent_thread_held_the_locks_at_the_fork(
    copying_manager: TokenManager, store: TokenStore, clock: ManualClock
) -> None:
    """A client made before a fork (say a preloaded web app): a parent thread leads the
    process's renewal and holds the lock of its flights at that moment; the child must
    still renew."""
    old = stored(store, clock, left=3600.0)
    assert copying_manager.token() == old
    holding, release = threading.Event(), threading.Event()

    def hold_both() -> None:
        copying_manager.perform(Fly(old.generation))  # this thread leads a renewal ...
        with copying_manager._fly_lock:  # ... and holds the flights' lock at the fork
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


def test_what_a_renewal_records_beside_the_token_is_best_effort(
    manager: TokenManager,
    store: TokenStore,
    exchange: FakeExchange,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Announcing the new token (waiters poll too) and timing its exchange (a histogram)
    fail without failing the renewal when Redis refuses them: the token is stored and
    returned, each failure logged."""

    def refused(send: Callable[[], Any]) -> Any:
        raise StoreUnavailable("token store: Redis refused it (test)")

    when_sent(store, store.ask.announce(1), refused)
    when_sent(store, scripts.OBSERVE, refused)
    token = manager.renew(force=True)
    assert store.load() == token
    assert len(exchange.calls) == 1
    logged = caplog.text
    assert "could not announce a new token in Redis" in logged
    assert "could not time it in Redis" in logged


@pytest.mark.parametrize("let_go", [False, True], ids=["held", "let-go"])
def test_close_waits_for_a_heartbeat_in_the_middle_of_a_command(
    store: TokenStore, let_go: bool
) -> None:
    """The application closes its client while a heartbeat is in the middle of extending
    the lease, the renewal holding the lock or just done with it (its heartbeat told to stop,
    not yet stopped): ``close()`` returns once that thread has ended, so that closing the
    Redis pool next pulls no connection from under it (seen in full runs: a traceback from
    redis-py's socket reader in the heartbeat's thread)."""
    holder = LockHolder(store, lease=0.4, longest=60.0)  # a heartbeat every 0.1 s
    sending, release = threading.Event(), threading.Event()

    def slow(send: Callable[[], Any]) -> Any:
        sending.set()
        release.wait(5.0)
        return send()

    when_sent(store, scripts.EXTEND_LOCK, slow)
    assert holder.acquire()
    assert sending.wait(5.0)  # the heartbeat is in the middle of a command
    [beat] = [t for t in threading.enumerate() if t in holder.manager._beating]
    if let_go:
        assert holder.value is not None
        holder.manager.perform(Unhold(holder.value))
    threading.Timer(0.2, release.set).start()
    holder.manager.close()
    assert not beat.is_alive()
