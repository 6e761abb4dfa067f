"""Wake-ups on a real Redis: a process waiting for another's renewal is woken when the new
token is stored, and falls back to polling when announcements are not heard."""

from __future__ import annotations

import gc
import threading

import pytest
import redis

from merchant_tasks.sandbox.processes import wait_until
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.store.wakeup import RenewalSignal
from merchant_tasks.token import IssuedToken, RenewalReason, Token
from support.redis_conditions import dead_redis
from support.renewal import make_manager

pytestmark = pytest.mark.integration


def listening(signal: RenewalSignal) -> RenewalSignal:
    signal.start()
    wait_until(lambda: signal.listening, "the subscription to be confirmed", 10.0)
    return signal


def test_an_announcement_wakes_a_waiting_thread_at_once(redis_store: TokenStore) -> None:
    signal = listening(RenewalSignal(redis_store))
    heard = signal.heard
    timer = threading.Timer(0.05, redis_store.send, args=(redis_store.ask.announce(7),))
    timer.start()
    assert signal.wait(heard, timeout=30.0)
    timer.join()


def test_a_wait_without_an_announcement_ends_at_its_timeout(redis_store: TokenStore) -> None:
    signal = listening(RenewalSignal(redis_store))
    assert not signal.wait(signal.heard, timeout=0.05)


def test_an_announcement_heard_before_the_wait_is_not_missed(redis_store: TokenStore) -> None:
    """The waiter notes what it heard before looking at the store: a renewal announced
    between that look and its wait ends the wait at once."""
    signal = listening(RenewalSignal(redis_store))
    heard = signal.heard
    redis_store.send(redis_store.ask.announce(1))
    wait_until(lambda: signal.heard > heard, "the announcement", 10.0)
    assert signal.wait(heard, timeout=0.0)


def test_the_subscriber_thread_ends_with_its_signal(redis_store: TokenStore) -> None:
    signal = listening(RenewalSignal(redis_store))
    thread = signal.subscriber_thread
    assert thread is not None
    del signal
    gc.collect()
    thread.join(timeout=10.0)
    assert not thread.is_alive()


def test_accounts_of_one_process_share_one_subscriber_and_hear_only_their_own_renewals(
    redis_client: redis.Redis, merchant_key_prefix: str
) -> None:
    """A worker serving many accounts holds one listening connection, not one per account."""
    stores = [
        TokenStore(
            redis_client, TokenStore.namespace_for(merchant_key_prefix, "sandbox", f"app-{n}")
        )
        for n in range(20)
    ]
    signals = [RenewalSignal(store) for store in stores]
    for signal in signals:  # all at once: the subscriber takes up new channels each tick
        signal.start()
    wait_until(lambda: all(s.listening for s in signals), "every subscription confirmed", 10.0)
    threads = {signal.subscriber_thread for signal in signals}
    assert len(threads) == 1
    assert None not in threads
    before = [signal.heard for signal in signals]
    stores[7].send(stores[7].ask.announce(2))
    wait_until(lambda: signals[7].heard > before[7], "the announcement", 10.0)
    assert [signal.heard - seen for signal, seen in zip(signals, before, strict=True)] == [
        1 if n == 7 else 0 for n in range(20)
    ]


def test_without_redis_the_signal_is_not_listening_and_callers_poll(
    merchant_key_prefix: str,
) -> None:
    dead = dead_redis()
    signal = RenewalSignal(TokenStore(dead, merchant_key_prefix))
    signal.start()
    wait_until(lambda: signal.subscriber_thread is None, "the subscriber to give up", 10.0)
    assert not signal.listening


def _never_issues() -> IssuedToken:
    return IssuedToken("tok-never", 3600.0)


def test_a_process_waiting_for_another_processs_renewal_is_woken_without_polling(
    redis_store: TokenStore, redis_client: redis.Redis
) -> None:
    """Two managers stand for two processes of one account. A renews after a 401 with a
    slow exchange; B meets the same 401 meanwhile, finds the lock held and waits: it is
    woken by A's announcement, never sleeping a poll."""
    store_a, store_b = redis_store, TokenStore(redis_client, redis_store.namespace)
    exchanging = threading.Event()

    def slow_exchange() -> IssuedToken:
        exchanging.set()
        wait_until(  # A's exchange ends once B has found the lock held and recorded its wait
            lambda: store_a.records.counters().get("lock_waits") == 1, "B waiting", 10.0
        )
        return IssuedToken("tok-renewed-by-a", 3600.0)

    sleeps_a: list[float] = []
    sleeps_b: list[float] = []
    a = make_manager(
        store_a, slow_exchange, exchange_timeout=1.0, sleep=sleeps_a.append, wake_ups=True
    )
    b = make_manager(
        store_b, _never_issues, exchange_timeout=1.0, sleep=sleeps_b.append, wake_ups=True
    )
    now = store_a.time()
    revoked = Token("tok-revoked", now - 10, now + 3600, 1, "x", RenewalReason.SCHEDULED)
    assert store_a.save(revoked) == (True, 1)
    store_a.mark_accepted(1)
    for manager in (a, b):
        assert manager.token().value == revoked.value  # each starts hearing announcements
        assert manager.signal is not None
        listening(manager.signal)

    renewed: list[Token] = []
    renewer = threading.Thread(target=lambda: renewed.append(a.renew(stale_token=revoked)))
    renewer.start()
    assert exchanging.wait(10.0)
    token_b = b.renew(stale_token=revoked)
    renewer.join(10.0)
    assert renewed[0].value == token_b.value == "tok-renewed-by-a"
    assert sleeps_b == []  # woken, not polling
    assert store_a.records.counters()["lock_waits"] == 1
