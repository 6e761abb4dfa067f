"""Single flight and this process's copy of the token (renewal/life.py's flows: the fleet
lock, a process's flight, the copy), through a TokenManager on fakeredis with an injected
clock, sleep and exchange: one renewal for the fleet while the others wait, threads of one
process in turn, the copy trusted a second."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import redis

from merchant_tasks.exceptions import RenewalTimeout, TokenRejected
from merchant_tasks.renewal.life import POLL_INITIAL, POLL_MAX, Limits
from merchant_tasks.renewal.manager import TokenManager
from merchant_tasks.sandbox.processes import wait_until
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.token import Token
from support.clock import ManualClock, Sleeper
from support.renewal import (
    FakeExchange,
    Renewal,
    SiblingWaits,
    hold_lock,
    holder_writes_at_poll,
    renewing_in_a_thread,
    shorten_limits,
    when_sent,
)
from support.tokens import LIFETIME, OTHER_HOLDER, stored

RENEW_MANDATORY = 120.0


# -- single flight -----------------------------------------------------------------------


def test_a_caller_with_a_still_valid_token_gets_it_while_another_process_renews(
    renewal: Renewal,
) -> None:
    token = stored(renewal.store, renewal.clock, left=3600.0)
    renewal.clock.now += 3600.0 - 60.0  # mandatory window, a minute left
    hold_lock(renewal.store)
    assert renewal.manager.token() == token
    assert renewal.exchange.calls == []
    assert renewal.sleep.waits == []


def test_a_caller_without_a_token_waits_for_the_renewal_held_elsewhere(renewal: Renewal) -> None:
    hold_lock(renewal.store)
    written = holder_writes_at_poll(3, renewal.sleep, renewal.store, renewal.clock)
    assert renewal.manager.token() == written[0]
    assert renewal.exchange.calls == []
    assert len(renewal.sleep.waits) == 3
    assert all(0 < wait <= POLL_MAX for wait in renewal.sleep.waits)
    assert renewal.store.records.counters() == {"lock_waits": 1}


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
    shorten_limits(manager)  # the rule is the same for any limit; the real one is 4330 looks
    hold_lock(store)
    with pytest.raises(RenewalTimeout, match=OTHER_HOLDER) as caught:
        manager.token()
    assert caught.value.retryable
    assert exchange.calls == []
    assert len(sleep.waits) == manager.limits.looks - 1
    assert store.records.counters() == {"lock_waits": 1}


def test_a_waiter_outlasts_a_dead_holder_and_the_whole_renewal_of_the_next_one(
    manager: TokenManager, store: TokenStore, clock: ManualClock, sleep: Sleeper
) -> None:
    """The caller arrives just after a holder took the lock and died; when that lock
    expires another process takes it first and needs its whole lock TTL. The caller still
    gets that process's token instead of a RenewalTimeout (CI once saw one in fault row 6)."""
    shorten_limits(manager)  # 90 looks of 100 instead of 4320 of 4330: the same scenario
    hold_lock(store)
    one_lock_ttl = math.ceil(manager.limits.renewal / POLL_INITIAL)
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


# -- this process's copy of the token ----------------------------------------------------


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
    newer: list[Token] = []
    read_once = [True]

    def slow_read(send: Callable[[], Any]) -> Any:
        snapshot = send()  # thread A's read: the old token
        if read_once.pop() if read_once else False:
            newer.append(stored(store, clock, left=3600.0, value="tok-renewed-elsewhere"))
            assert copying_manager.renew(stale_token=old) == newer[0]  # thread B
        return snapshot

    when_sent(store, store.ask.load(), slow_read)
    assert copying_manager.token() == old  # what thread A read, and may use once
    assert copying_manager.token() == newer[0]  # the copy, within its second


def test_threads_of_one_process_wait_for_its_renewal_in_turn_without_polling_redis(
    renewal: Renewal, copying_manager: TokenManager
) -> None:
    """A 401 storm in one process: eight threads hold the revoked token. One renews; the
    others wait for their turn in the process, not by polling the Redis lock, and then take
    the new token from the process's copy."""
    old = stored(renewal.store, renewal.clock, left=3600.0)
    copying_manager.accepted(old)  # in use before the revocation
    waiting = SiblingWaits(copying_manager)
    renewal.exchange.during = lambda: waiting.reach(7)  # the others arrive while it exchanges
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
    assert len(renewal.exchange.calls) == 1
    assert len({token.value for token in got}) == 1
    assert got[0].value != old.value
    assert renewal.sleep.waits == []  # nobody polled the Redis lock
    # one 401 per process reaches Redis; its siblings take the copy it kept (a storm's
    # Redis commands do not grow with the threads)
    assert renewal.store.records.counters()["unauthorized"] == 1


def test_a_thread_with_a_valid_token_does_not_queue_behind_another_threads_renewal(
    copying_manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    old = stored(store, clock, left=RENEW_MANDATORY / 2)  # due for renewal, still valid
    with renewing_in_a_thread(exchange, copying_manager.token) as renewer_got:
        assert copying_manager.token() == old  # at once, while the other thread exchanges
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
    proceed = threading.Event()

    def a_polls(polls: int) -> None:
        if polls == 3:  # A sits in its third wait until B is done (at most 10 s)
            proceed.wait(10)

    sleep.on_sleep = a_polls
    outcome: list[Token] = []
    waiting = threading.Thread(target=lambda: outcome.append(manager.renew(force=True)))
    waiting.start()
    try:
        wait_until(lambda: len(sleep.waits) >= 3, "thread A polling", 10.0)
        assert manager.renew(stale_token=revoked) == valid
        assert waiting.is_alive()  # B did not wait for A, who still sits in its third wait
    finally:
        newer = stored(store, clock, left=3600.0, value="tok-newer")
        proceed.set()
        waiting.join(timeout=30)
    assert outcome == [newer]


def test_threads_meeting_a_refusal_in_a_back_off_share_its_token_rejected(
    copying_manager: TokenManager, store: TokenStore, clock: ManualClock, exchange: FakeExchange
) -> None:
    """Eight threads meet a 401 on a token refused on its first use right after another:
    one asks the store and opens the ``refused`` pause; the others get its TokenRejected
    instead of trying again themselves (no second opening, nothing exchanged)."""
    old = stored(store, clock, left=3600.0, in_a_row=1)
    waiting = SiblingWaits(copying_manager)

    def slow_load(send: Callable[[], Any]) -> Any:
        waiting.reach(7)  # the siblings arrive while it decides
        return send()

    when_sent(store, store.ask.load_breaker(), slow_load)
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
    copying_manager.life.limits = Limits(renewal=0.1, wait=0.2)
    renewing = partial(copying_manager.renew, stale_token=old)
    with (
        renewing_in_a_thread(exchange, renewing) as renewer_got,
        pytest.raises(RenewalTimeout, match="another thread of this process"),
    ):
        copying_manager.renew(stale_token=old)
    assert renewer_got[0].replaces(old, clock.now)
    assert len(exchange.calls) == 1
