"""Refusals and the breaker (renewal/life.py's flows after a 401 and an exchange failing)
through a TokenManager on fakeredis with an injected clock, sleep and exchange: what a 401
means and the renewal after it, the fleet-wide pauses on exchanges and their half-open
probe."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis

from merchant_tasks.exceptions import (
    CredentialsRejected,
    ExchangeRateLimited,
    PathForbidden,
    StoreUnavailable,
    TokenEndpointUnavailable,
    TokenExchangeError,
    TokenRejected,
)
from merchant_tasks.renewal.life import (
    EXCHANGE_ATTEMPTS,
    EXCHANGE_RETRY_WAIT_MAX,
    FORCED_BURST,
    FORCED_INTERVAL,
    PROBE_INTERVAL,
    RATE_LIMITED_BACKOFF,
    REFUSED_BACKOFF,
    REJECTED_BACKOFF,
    RETRY_AFTER_MARGIN,
    UNAVAILABLE_BACKOFF,
)
from merchant_tasks.renewal.manager import TokenManager
from merchant_tasks.store import scripts
from merchant_tasks.store.token_store import BreakerRecord, TokenStore
from merchant_tasks.token import BreakerKind, RenewalReason, Token, fingerprint
from support.clock import ManualClock, Sleeper
from support.renewal import (
    FakeExchange,
    Renewal,
    hold_lock,
    holder_writes_at_poll,
    make_manager,
    when_sent,
)
from support.routes import PING
from support.tokens import OTHER_HOLDER, stored

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


def refused_in_a_row(renewal: Renewal) -> Token:
    """A stored token, the second in a row refused (the one before it was too): its 401
    pauses renewals over the current secret. Returns that token."""
    refused = stored(
        renewal.store,
        renewal.clock,
        left=7190.0,
        reason=RenewalReason.MANDATORY,
        age=10.0,
        in_a_row=1,
    )
    with pytest.raises(TokenRejected):
        renewal.manager.renew(stale_token=refused)
    return refused


def test_a_replaced_secret_ends_a_refused_pause_in_the_process_that_met_it(
    renewal: Renewal,
) -> None:
    refused = refused_in_a_row(renewal)
    with pytest.raises(TokenRejected, match="in a row"):
        renewal.manager.token()
    renewal.secret[0] = "secret-two-rotated-5f6e7d"
    renewed = renewal.manager.token()  # not the rest of a back-off of up to 30 minutes
    assert renewed.replaces(refused, renewal.clock.now)
    assert len(renewal.exchange.calls) == 1


def test_a_replaced_secret_ends_a_refused_pause_fleet_wide(renewal: Renewal) -> None:
    refused = refused_in_a_row(renewal)
    record = renewal.store.records.load_breaker()
    assert record is not None
    assert record.secret_fingerprint == fingerprint(renewal.secret[0])
    renewal.secret[0] = "secret-two-rotated-5f6e7d"
    other = make_manager(
        renewal.store, renewal.exchange, secret_fingerprint=lambda: fingerprint(renewal.secret[0])
    )
    renewed = other.renew(stale_token=refused)  # another process's first 401 on it
    assert renewed.replaces(refused, renewal.clock.now)
    with pytest.raises(TokenRejected) as caught:  # the new secret's token is refused too
        other.renew(stale_token=renewed)
    # the run goes on (no acceptance between): its third token in a row, the second pause
    assert caught.value.retry_after == 2 * REFUSED_BACKOFF
    assert len(renewal.exchange.calls) == 1


# the pauses over the endpoint's health, which an operator's forced renewal does not end
ENDPOINT_HEALTH = {BreakerKind.RATE_LIMITED, BreakerKind.UNAVAILABLE}


@pytest.mark.parametrize("kind", list(BreakerKind), ids=str)
def test_an_operators_forced_renewal_ends_the_pauses_over_credentials_and_refused_tokens(
    renewal: Renewal, kind: BreakerKind
) -> None:
    """``renew --force`` says the cause is fixed (access restored, the key re-enabled);
    a pause over the endpoint's health (rate limited, unavailable) still holds."""
    ends = kind not in ENDPOINT_HEALTH
    record = BreakerRecord(
        kind, renewal.clock.now + 600.0, 1, fingerprint(renewal.secret[0]), "paused", 1
    )
    renewal.store.records.open_breaker(record, renewal.clock.now)
    if ends:
        assert renewal.manager.renew(force=True).value == "tok-issued-1"
    else:
        with pytest.raises(TokenExchangeError, match="paused"):
            renewal.manager.renew(force=True)
    assert len(renewal.exchange.calls) == (1 if ends else 0)


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

    def spy(send: Callable[[], Any]) -> Any:
        calls.append(token.generation)
        return send()

    when_sent(store, store.ask.mark_accepted(token.generation), spy)
    for _ in range(5):
        manager.accepted(token)
    assert calls == [token.generation]
    assert store.accepted_generation() == token.generation
    store.mark_accepted(token.generation - 1)  # a late, older mark never lowers it
    assert store.accepted_generation() == token.generation


def test_forced_renewals_are_spaced_fleet_wide_and_none_fails(renewal: Renewal) -> None:
    """Revocations one after another (each token accepted, then refused): each is replaced,
    the first FORCED_BURST at once, the later ones after waiting their turn in the fleet's
    allowance, one FORCED_INTERVAL apart in Redis time; no per-window budget turns a fifth
    revocation into failures."""
    renewal.manager.accepted(stored(renewal.store, renewal.clock, left=7000.0))
    for _ in range(6):
        current = renewal.store.load()
        assert current is not None
        renewal.store.mark_accepted(current.generation)
        assert renewal.manager.renew(stale_token=current).replaces(current, renewal.clock.now)
    assert len(renewal.exchange.calls) == 6
    assert renewal.store.records.counters()["forced_renewals"] == 6
    waits = [seconds for seconds in renewal.sleep.waits if seconds > 1.0]
    assert len(waits) == 6 - FORCED_BURST  # Redis's clock hardly moved: each of those waited
    # about one interval more than the one before
    assert all(w <= n * FORCED_INTERVAL + 0.5 for n, w in enumerate(waits, 1))
    assert "breaker_openings:revoked" not in renewal.store.records.counters()


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


# -- breaker -----------------------------------------------------------------------------


def test_rejected_credentials_open_the_breaker_for_that_secret(renewal: Renewal) -> None:
    renewal.exchange.outcomes = [
        CredentialsRejected("token endpoint refused (HTTP 401)", status=401)
    ]
    with pytest.raises(CredentialsRejected):
        renewal.manager.token()
    assert len(renewal.exchange.calls) == 1  # never retried
    assert renewal.sleep.waits == []
    record = renewal.store.records.load_breaker()
    assert record is not None
    assert record.kind == "rejected"
    assert record.until == renewal.clock.now + REJECTED_BACKOFF
    assert record.secret_fingerprint == fingerprint(renewal.secret[0])
    assert renewal.secret[0] not in record.detail
    assert renewal.store.records.counters() == {
        "renewals:mandatory:rejected": 1,
        "exchange_attempts:mandatory:rejected": 1,
        "breaker_openings:rejected": 1,
    }
    assert renewal.store.lock_holder() is None


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
    renewal: Renewal, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller found no breaker; before it took the lock, the process holding it got a
    429, paused exchanges and let go. Taking the lock next, the caller must not make a
    second refused exchange (fault rows 3, 8 and 9 count refused exchanges exactly)."""
    hold_lock(renewal.store)

    def holder_fails_between_our_breaker_look_and_our_lock(take_lock: Callable[[], Any]) -> Any:
        if renewal.sleep.waits:  # the caller has waited once; now, just after it looked...
            record = BreakerRecord(
                BreakerKind.RATE_LIMITED, renewal.clock.now + 30.0, 1, "", "HTTP 429"
            )
            renewal.store.records.open_breaker(record, renewal.clock.now)
            renewal.store.redis.delete(renewal.store.keys.lock)
        return take_lock()

    when_sent(renewal.store, scripts.TAKE_LOCK, holder_fails_between_our_breaker_look_and_our_lock)
    with pytest.raises(ExchangeRateLimited, match="paused"):
        renewal.manager.token()
    assert renewal.exchange.calls == []
    assert renewal.store.lock_holder() is None


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
    renewal: Renewal, fake_redis: redis.Redis
) -> None:
    renewal.exchange.outcomes = [ExchangeRateLimited("HTTP 429", retry_after=30.0)]
    with pytest.raises(ExchangeRateLimited):
        renewal.manager.token()
    record = renewal.store.records.load_breaker()
    assert record is not None
    assert (record.kind, record.until) == (
        "rate_limited",
        renewal.clock.now + 30.0 + RETRY_AFTER_MARGIN,
    )
    # the record outlives its pause, to count failures in a row
    assert fake_redis.pttl(renewal.store.keys.breaker) > 30_000

    renewal.clock.now += 20.0
    with pytest.raises(ExchangeRateLimited) as caught:
        renewal.manager.token()
    assert caught.value.retry_after == pytest.approx(10.0 + RETRY_AFTER_MARGIN)
    assert len(renewal.exchange.calls) == 1

    renewal.clock.now += 11.0  # past ``until``: the record no longer pauses anything
    assert renewal.manager.token().value == "tok-issued-2"
    assert len(renewal.exchange.calls) == 2
    assert renewal.store.records.counters()["renewals:mandatory:rate_limited"] == 1
    assert renewal.store.records.counters()["breaker_openings:rate_limited"] == 1


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


def test_an_unavailable_endpoint_is_retried_then_pauses_exchanges(renewal: Renewal) -> None:
    renewal.exchange.outcomes = [
        TokenEndpointUnavailable("HTTP 503", status=503)
    ] * EXCHANGE_ATTEMPTS
    with pytest.raises(TokenEndpointUnavailable):
        renewal.manager.token()
    assert len(renewal.exchange.calls) == EXCHANGE_ATTEMPTS
    assert len(renewal.sleep.waits) == EXCHANGE_ATTEMPTS - 1
    assert all(0 <= wait <= EXCHANGE_RETRY_WAIT_MAX for wait in renewal.sleep.waits)
    record = renewal.store.records.load_breaker()
    assert record is not None
    assert (record.kind, record.failures) == ("unavailable", 1)
    pause = record.until - renewal.clock.now
    assert UNAVAILABLE_BACKOFF / 2 <= pause <= UNAVAILABLE_BACKOFF
    assert pause != UNAVAILABLE_BACKOFF  # jittered
    assert renewal.store.records.counters() == {
        "renewals:mandatory:failed": 1,
        "exchange_attempts:mandatory:failed": EXCHANGE_ATTEMPTS,  # every HTTP attempt
        "breaker_openings:unavailable": 1,
    }

    with pytest.raises(TokenEndpointUnavailable, match="paused"):
        renewal.manager.token()
    assert len(renewal.exchange.calls) == EXCHANGE_ATTEMPTS


def test_repeated_endpoint_failures_grow_the_jittered_backoff(
    renewal: Renewal, fake_redis: redis.Redis
) -> None:
    renewal.exchange.outcomes = [TokenEndpointUnavailable("HTTP 503", status=503)] * (
        2 * EXCHANGE_ATTEMPTS
    )
    with pytest.raises(TokenEndpointUnavailable):
        renewal.manager.token()
    first = renewal.store.records.load_breaker()
    assert first is not None
    renewal.clock.now = first.until  # the pause is over; the record remembers the failure
    with pytest.raises(TokenEndpointUnavailable):
        renewal.manager.token()
    second = renewal.store.records.load_breaker()
    assert second is not None
    assert second.failures == 2
    assert second.until - renewal.clock.now > UNAVAILABLE_BACKOFF  # doubled, then jittered by half


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        (BreakerKind.REJECTED, CredentialsRejected),
        (BreakerKind.RATE_LIMITED, ExchangeRateLimited),
        (BreakerKind.UNAVAILABLE, TokenEndpointUnavailable),
    ],
)
def test_without_a_valid_token_an_open_breaker_raises_its_error(
    renewal: Renewal, kind: BreakerKind, error: type[Exception]
) -> None:
    record = BreakerRecord(
        kind, renewal.clock.now + 30.0, 1, fingerprint(renewal.secret[0]), "why it paused"
    )
    renewal.store.records.open_breaker(record, renewal.clock.now)
    assert renewal.store.records.take_probe(
        PROBE_INTERVAL
    )  # another process is probing (half-open)
    with pytest.raises(error, match="paused for 30 s more: why it paused"):
        renewal.manager.token()
    assert renewal.exchange.calls == []


# -- a refused token is never handed out, whatever its window (review of issue 27) --------


def _refused_elsewhere(store: TokenStore, token: Token) -> None:
    """Another process met a 401 on ``token``: its record says refused, and that process
    holds the renewal lock for the replacement."""
    holder = f"{OTHER_HOLDER}:1"
    look = store.ask.look_after_401(token.generation, holder, f"{OTHER_HOLDER}:", 60.0, 30.0)
    _, outcome = store.send(look)
    assert outcome == 1
    looked = store.load()
    assert looked is not None
    assert looked.refused


def test_a_token_another_process_met_a_401_with_is_replaced_bearing_that_route(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    """Another process's 401 on /ping marked a token refused on its first use, then that
    process died before its exchange. A call here finds it refused and replaces it: the
    replacement's record names /ping (from the refused record), so that its own 401 there
    holds that route back, with no pause over the credentials. Before, it named no route,
    and that 401 read as two tokens refused on two routes: a fleet-wide pause for what one
    route's permission explains (the flaky fault row, issue 36)."""
    first = stored(store, clock, left=7190.0, age=10.0)  # never accepted: its first use
    look = store.ask.look_after_401(
        first.generation, f"{OTHER_HOLDER}:1", f"{OTHER_HOLDER}:", 60.0, 30.0, route="ping"
    )
    assert store.send(look)[1] == 1  # marked refused on ping, the lock taken
    refused = store.load()
    assert refused is not None
    assert refused.refused
    assert refused.refused_route == "ping"
    store.redis.delete(store.keys.lock)  # its holder died: the lease ends

    second = manager.token(PING)  # replaced by this process, which met no 401 itself
    assert second.replaces(first, clock.now)
    assert (second.retry_route, second.first_use_refusals) == ("ping", 1)
    with pytest.raises(PathForbidden, match="in a row"):
        manager.refused(second, PING)
    assert store.records.load_breaker() is None  # the route's, not the credentials'
    assert len(exchange.calls) == 1


def test_a_route_held_back_again_says_how_many_tokens_it_refused_in_a_row(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    """/ping refuses every token on its first use: the second is held back for the first
    back-off, the third (tried after it) for the next; each error counts them."""
    first = stored(store, clock, left=7190.0, age=10.0)
    second = manager.refused(first, PING)  # the first in a row: replaced at once
    with pytest.raises(PathForbidden, match="refused 2 tokens in a row on /open-api/v1/ping"):
        manager.refused(second, PING)
    clock.now += REFUSED_BACKOFF
    assert manager.token(PING).generation == second.generation  # its hold is over: tried again
    third = manager.refused(second, PING)
    assert third.first_use_refusals == 2
    with pytest.raises(PathForbidden, match="refused 3 tokens in a row") as caught:
        manager.refused(third, PING)
    assert caught.value.retry_after is not None
    assert caught.value.retry_after > REFUSED_BACKOFF  # the next back-off is longer
    assert len(exchange.calls) == 2


def test_a_token_refused_after_its_routes_hold_is_replaced_by_a_process_that_met_no_401(
    manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    """/ping's hold is over; another process's 401 there marks the token refused (its
    replacement is due, not a pause) and that process dies. A call here finds it refused and
    replaces it, judging it on the route its record names: not as two tokens refused with no
    route named, which is the credentials' fleet-wide pause."""
    first = stored(store, clock, left=7190.0, age=10.0)
    second = manager.refused(first, PING)
    with pytest.raises(PathForbidden, match="2 tokens in a row"):
        manager.refused(second, PING)
    clock.now += REFUSED_BACKOFF
    look = store.ask.look_after_401(
        second.generation,
        f"{OTHER_HOLDER}:1",
        f"{OTHER_HOLDER}:",
        60.0,
        30.0,
        route="ping",
        judged=True,  # its hold is over: the token's fault
    )
    assert store.send(look)[1] == 1
    store.redis.delete(store.keys.lock)  # its holder died

    third = manager.token(PING)
    assert third.replaces(second, clock.now)
    assert (third.retry_route, third.first_use_refusals) == ("ping", 2)
    assert store.records.load_breaker() is None
    assert len(exchange.calls) == 2


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
    before reaching it (here Redis fails the renewal's first read under the lock), the
    holding is released, not left to its heartbeat."""
    manager = make_manager(store, exchange, clock=clock, exchange_timeout=0.1)
    refused = stored(store, clock, left=3600.0)
    manager.accepted(refused)
    failed: list[bool] = []

    def redis_fails_once(send: Callable[[], Any]) -> Any:
        if store.lock_holder() is not None and not failed:  # under the 401's holding
            failed.append(True)
            raise StoreUnavailable("token store (Redis at test) unavailable: ConnectionError")
        return send()

    when_sent(store, store.ask.load_breaker(), redis_fails_once)
    with pytest.raises(StoreUnavailable):
        manager.renew(stale_token=refused)
    assert failed == [True]
    assert store.lock_holder() is None
    assert exchange.calls == []
