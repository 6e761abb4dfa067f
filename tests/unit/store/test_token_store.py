"""The Redis token store (on fakeredis): generation compare-and-swap, TTLs, breaker, clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import pytest
import redis

from merchant_tasks.exceptions import StoreUnavailable
from merchant_tasks.store.token_store import (
    BREAKER_MEMORY,
    LOCK_WAIT_SECONDS,
    BreakerRecord,
    Histogram,
    RedisClock,
    TokenStore,
)
from merchant_tasks.token import BreakerKind, CounterName, Outcome, RenewalReason, Token
from support.account import UNIT_NAMESPACE
from support.redis_conditions import dead_redis
from support.tokens import make_token

# -- token and generation ----------------------------------------------------------------


def test_keys_are_namespaced_by_environment_and_api_key(store: TokenStore) -> None:
    assert UNIT_NAMESPACE == "mt-test:sandbox:app-id-1234"
    assert store.keys.token == f"{UNIT_NAMESPACE}:token"
    assert store.keys.generation == f"{UNIT_NAMESPACE}:generation"
    assert store.keys.lock == f"{UNIT_NAMESPACE}:lock"
    assert store.keys.breaker == f"{UNIT_NAMESPACE}:breaker"
    assert store.keys.counters == f"{UNIT_NAMESPACE}:counters"
    assert repr(store) == f"TokenStore(namespace={UNIT_NAMESPACE!r})"


def test_an_empty_store_has_no_token_and_generation_zero(store: TokenStore) -> None:
    assert store.load() is None
    assert store.generation() == 0


def test_a_saved_token_loads_back_unchanged(store: TokenStore) -> None:
    token = make_token(1)
    assert store.save(token) == (True, 1)
    assert store.load() == token
    assert store.generation() == 1


def test_the_token_key_expires_with_the_token(store: TokenStore, fake_redis: redis.Redis) -> None:
    store.save(make_token(1, left=300.0))
    ttl_ms = fake_redis.pttl(store.keys.token)
    assert 299_000 <= ttl_ms <= 300_000


def test_the_generation_key_does_not_expire(store: TokenStore, fake_redis: redis.Redis) -> None:
    store.save(make_token(1, left=300.0))
    assert fake_redis.ttl(store.keys.generation) == -1


def test_a_save_naming_a_stale_generation_is_refused_and_returns_the_current_one(
    store: TokenStore,
) -> None:
    second = make_token(2)
    store.save(make_token(1))
    store.save(second)
    assert store.save(make_token(2, value="tok-from-a-slow-renewer")) == (False, 2)
    assert store.load() == second


def test_an_older_token_never_overwrites_a_newer_one(store: TokenStore) -> None:
    newer = make_token(1, left=7200.0, value="tok-newer")
    store.save(newer)
    older = make_token(1, left=7000.0, value="tok-older")  # also claims to follow generation 0
    assert store.save(older) == (False, 1)
    assert store.load() == newer


def test_a_save_skipping_a_generation_is_refused(store: TokenStore) -> None:
    first = make_token(1)
    store.save(first)
    assert store.save(make_token(3)) == (False, 1)
    assert store.load() == first


def test_an_already_expired_token_is_not_saved(store: TokenStore) -> None:
    assert store.save(make_token(1, left=-1.0)) == (False, 0)
    assert store.load() is None
    assert store.generation() == 0


def test_the_generation_survives_the_token_key_expiring(
    store: TokenStore, fake_redis: redis.Redis
) -> None:
    store.save(make_token(1))
    fake_redis.delete(store.keys.token)  # what the key's TTL does when the token expires
    assert store.load() is None
    assert store.generation() == 1
    assert store.save(make_token(1, value="tok-replayed")) == (False, 1)
    assert store.save(make_token(2)) == (True, 2)


def test_load_sees_a_token_written_by_another_process(
    store: TokenStore, fake_redis: redis.Redis
) -> None:
    first, second = make_token(1), make_token(2)
    store.save(first)
    assert store.load() == first
    TokenStore(fake_redis, UNIT_NAMESPACE).save(second)
    assert store.load() == second


def test_two_namespaces_do_not_see_each_other(fake_redis: redis.Redis) -> None:
    sandbox = TokenStore(fake_redis, TokenStore.namespace_for("p", "sandbox", "key"))
    production = TokenStore(fake_redis, TokenStore.namespace_for("p", "production", "key"))
    sandbox.save(make_token(1))
    assert production.load() is None
    assert production.generation() == 0


def test_time_is_redis_time(store: TokenStore) -> None:
    assert abs(store.time() - time.time()) < 1.0


# -- lock, breaker, counters -------------------------------------------------------------


def test_the_lock_names_its_holder_and_is_exclusive(
    store: TokenStore, fake_redis: redis.Redis
) -> None:
    assert store.lock_holder() is None
    assert store.take_lock("host-a:123:abcd1234:1", "host-a:123:abcd1234:", 10.0)
    assert store.lock_holder() == "host-a:123:abcd1234:1"
    assert 9_000 <= fake_redis.pttl(store.keys.lock) <= 10_000
    assert not store.take_lock("host-b:456:ef012345:1", "host-b:456:ef012345:", 10.0)
    assert not store.release_lock("host-a:123:abcd1234:2")  # another holding's value
    assert store.release_lock("host-a:123:abcd1234:1")
    assert store.lock_holder() is None


def test_a_lock_naming_this_process_is_taken_over_by_its_next_holding(
    store: TokenStore,
) -> None:
    """A lock command that ran late (its caller gave up) names the process: not a holder."""
    assert store.take_lock("host-a:1:aa:1", "host-a:1:aa:", 10.0)
    assert store.take_lock("host-a:1:aa:2", "host-a:1:aa:", 10.0)
    assert not store.extend_lock("host-a:1:aa:1", 10.0)  # the late holding lost it
    assert store.extend_lock("host-a:1:aa:2", 10.0)
    assert store.lock_holder() == "host-a:1:aa:2"


def test_a_lock_value_without_a_ttl_is_garbage_and_is_taken(
    store: TokenStore, fake_redis: redis.Redis
) -> None:
    fake_redis.set(store.keys.lock, "garbage")
    assert store.take_lock("host-a:1:aa:1", "host-a:1:aa:", 10.0)
    fake_redis.delete(store.keys.lock)
    fake_redis.hset(store.keys.lock, "x", "1")
    assert store.lock_holder() is None
    assert store.take_lock("host-a:1:aa:2", "host-a:1:aa:", 10.0)


def _look_after_401(store: TokenStore) -> tuple[Token | None, int]:
    """Host a's look after a 401 on generation 1 (``TokenCommands.look_after_401``)."""
    return store.send(store.ask.look_after_401(1, "host-a:1:aa:1", "host-a:1:aa:", 10.0, 30.0))


def test_the_look_after_a_401_counts_it_and_takes_the_lock_when_the_refused_token_is_stored(
    store: TokenStore,
) -> None:
    refused = make_token(1)
    assert store.save(refused) == (True, 1)
    looked, outcome = _look_after_401(store)
    assert outcome == 1
    assert looked is not None
    assert looked.refused  # recorded in its own record, by the same command
    assert looked == replace(refused, refused_at=looked.refused_at)
    assert store.lock_holder() == "host-a:1:aa:1"
    assert store.release_lock("host-a:1:aa:1")
    assert store.records.counters() == {CounterName.UNAUTHORIZED: 1}


def test_the_look_after_a_401_leaves_the_lock_when_a_newer_token_is_stored(
    store: TokenStore,
) -> None:
    store.save(make_token(1))
    newer = make_token(2)
    store.save(newer)
    assert _look_after_401(store) == (newer, 0)
    assert store.lock_holder() is None


def test_the_look_after_a_401_counts_a_wait_when_another_holds_the_lock(
    store: TokenStore,
) -> None:
    assert store.take_lock("host-b:2:bb:1", "host-b:2:bb:", 10.0)
    assert _look_after_401(store) == (None, -1)
    assert store.lock_holder() == "host-b:2:bb:1"
    assert store.records.counters() == {CounterName.UNAUTHORIZED: 1, CounterName.LOCK_WAITS: 1}


def _lock_waits(store: TokenStore) -> tuple[int, int]:
    """How many waits the lock-wait histogram holds, and their sum in microseconds."""
    fields = store.records.histograms()
    count = sum(v for k, v in fields.items() if k.startswith(f"{LOCK_WAIT_SECONDS}:le:"))
    return count, fields.get(f"{LOCK_WAIT_SECONDS}:sum_us", 0)


def test_a_noted_wait_is_recorded_by_the_write_that_ends_it(
    store: TokenStore, fake_redis: redis.Redis
) -> None:
    store.save(make_token(1))
    assert store.take_lock("host-b:2:bb:1", "host-b:2:bb:", 10.0)
    assert _look_after_401(store)[1] == -1
    assert store.note_wait(1, 30.0)  # a second process, waiting the other way
    assert _lock_waits(store) == (0, 0)  # nothing recorded while they wait
    store.save(make_token(2))
    count, sum_us = _lock_waits(store)
    assert count == 2
    assert 0 <= sum_us < 30_000_000
    assert not fake_redis.exists(store.keys.waits)
    assert store.records.counters()[CounterName.LOCK_WAITS] == 2
    store.save(make_token(3))
    assert _lock_waits(store)[0] == 2  # each wait is recorded once


def test_a_duration_goes_into_the_first_bucket_that_holds_it_from_either_writer(
    store: TokenStore, fake_redis: redis.Redis
) -> None:
    for seconds in (0.05, 0.3, 31.0, -1.0):  # a bound holds itself; below 0 counts as 0
        store.send(store.ask.observe("exchange_seconds", seconds))
    fields = store.records.histograms()
    assert fields == {
        "exchange_seconds:le:0.05": 2,
        "exchange_seconds:le:0.5": 1,
        "exchange_seconds:le:+Inf": 1,
        "exchange_seconds:sum_us": 31_350_000,
    }
    buckets, total = Histogram("exchange_seconds").cumulative(fields)
    assert (buckets[0], buckets[2], buckets[-1], total) == (
        ("0.05", 2),
        ("0.25", 2),
        ("+Inf", 4),
        31.35,
    )
    seconds, micros = fake_redis.time()
    began = seconds * 1_000_000 + micros - 1_500_000  # a wait that began 1.5 s ago
    fake_redis.rpush(store.keys.waits, f"{began}:30000")
    store.save(make_token(1))  # the write that ends it records it, in the same layout
    waits = {k: v for k, v in store.records.histograms().items() if k not in fields}
    assert waits.keys() == {f"{LOCK_WAIT_SECONDS}:le:2.5", f"{LOCK_WAIT_SECONDS}:sum_us"}
    assert waits[f"{LOCK_WAIT_SECONDS}:le:2.5"] == 1
    assert 1_500_000 <= waits[f"{LOCK_WAIT_SECONDS}:sum_us"] < 2_500_000


def test_a_wait_that_outlasted_its_limit_is_not_recorded(
    store: TokenStore, fake_redis: redis.Redis
) -> None:
    store.save(make_token(1))
    fake_redis.rpush(store.keys.waits, "1000000000:5")  # began long ago; its caller gave up
    store.save(make_token(2))
    assert _lock_waits(store) == (0, 0)
    assert not fake_redis.exists(store.keys.waits)


def test_no_wait_is_noted_once_a_newer_generation_is_stored(
    store: TokenStore, fake_redis: redis.Redis
) -> None:
    store.save(make_token(1))
    store.save(make_token(2))
    assert not store.note_wait(1, 30.0)  # the renewal ended before the wait
    assert store.records.counters() == {}
    assert not fake_redis.exists(store.keys.waits)
    assert store.note_wait(2, 30.0)
    assert 0 < fake_redis.pttl(store.keys.waits) <= 30_000
    fake_redis.delete(store.keys.token)  # expired: a process that saw nothing still waits
    assert store.note_wait(0, 30.0)


def test_acceptance_only_ever_rises(store: TokenStore) -> None:
    assert store.accepted_generation() == 0
    store.mark_accepted(3)
    store.mark_accepted(2)
    assert store.accepted_generation() == 3


def test_forced_renewals_are_counted_per_period(store: TokenStore) -> None:
    for at in (100.0, 150.0, 170.0):
        store.records.log_forced(at)
    assert store.records.forced_in_period(175.0, 60.0) == 2
    assert store.records.forced_in_period(231.0, 60.0) == 0


def test_the_probe_slot_is_given_once_per_interval(store: TokenStore) -> None:
    assert store.records.take_probe(10.0)
    assert not store.records.take_probe(10.0)


def test_no_breaker_is_open_at_first(store: TokenStore) -> None:
    assert store.records.load_breaker() is None


def test_a_breaker_is_kept_a_while_past_until_and_closes(
    store: TokenStore, fake_redis: redis.Redis
) -> None:
    record = BreakerRecord(
        BreakerKind.REJECTED, until=1030.0, failures=2, secret_fingerprint="abc123"
    )
    store.records.open_breaker(record, now=1000.0)
    assert store.records.load_breaker() == record
    expected_ms = (30 + BREAKER_MEMORY) * 1000
    assert expected_ms - 1000 <= fake_redis.pttl(store.keys.breaker) <= expected_ms
    store.records.close_breaker()
    assert store.records.load_breaker() is None


def test_a_breaker_long_over_is_stored_with_the_shortest_ttl(
    store: TokenStore, fake_redis: redis.Redis
) -> None:
    store.records.open_breaker(
        BreakerRecord(BreakerKind.RATE_LIMITED, until=0.0), now=1000.0 + BREAKER_MEMORY
    )
    assert fake_redis.pttl(store.keys.breaker) <= 1


def test_counters_add_up_per_event(store: TokenStore) -> None:
    assert store.records.counters() == {}
    store.records.count("renewals:scheduled:ok", "lock_waits")
    store.records.count("lock_waits")
    assert store.records.counters() == {"renewals:scheduled:ok": 1, "lock_waits": 2}


# -- Redis down --------------------------------------------------------------------------

OPERATIONS: dict[str, Callable[[TokenStore], object]] = {
    "load": lambda s: s.load(),
    "save": lambda s: s.save(make_token(1)),
    "time": lambda s: s.time(),
    "generation": lambda s: s.generation(),
    "lock_holder": lambda s: s.lock_holder(),
    "load_breaker": lambda s: s.records.load_breaker(),
    "open_breaker": lambda s: s.records.open_breaker(
        BreakerRecord(BreakerKind.UNAVAILABLE, 2.0), 1.0
    ),
    "close_breaker": lambda s: s.records.close_breaker(),
    "count": lambda s: s.records.count("x"),
    "counters": lambda s: s.records.counters(),
    "look_after_401": lambda s: s.send(s.ask.look_after_401(1, "o:1", "o:", 1.0, 1.0)),
    "note_wait": lambda s: s.note_wait(1, 1.0),
    "take_lock": lambda s: s.take_lock("o:1", "o:", 1.0),
    "extend_lock": lambda s: s.extend_lock("o:1", 1.0),
    "release_lock": lambda s: s.release_lock("o:1"),
    "record_attempt": lambda s: s.records.record_attempt(RenewalReason.MANUAL, Outcome.OK, 1.0),
    "exchanges_since": lambda s: s.records.exchanges_since(1.0),
    "load_completion": lambda s: s.records.load_completion("t"),
    "mark_accepted": lambda s: s.mark_accepted(1),
    "accepted_generation": lambda s: s.accepted_generation(),
    "forced_in_period": lambda s: s.records.forced_in_period(1.0, 1.0),
    "log_forced": lambda s: s.records.log_forced(1.0),
    "take_probe": lambda s: s.records.take_probe(1.0),
}


@pytest.mark.parametrize("operation", OPERATIONS.values(), ids=OPERATIONS.keys())
def test_every_operation_raises_store_unavailable_when_redis_is_down(
    operation: Callable[[TokenStore], object],
) -> None:
    store = TokenStore(dead_redis(), UNIT_NAMESPACE)
    with pytest.raises(StoreUnavailable, match="MERCHANT_REDIS_URL") as caught:
        operation(store)
    assert caught.value.retryable


# -- RedisClock --------------------------------------------------------------------------


class FakeTime:
    """Redis TIME readings and a monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.mono = 100.0
        self.remote = 1_700_000_000.0
        self.reads = 0
        self.down = False

    def monotonic(self) -> float:
        return self.mono

    def read_time(self) -> float:
        self.reads += 1
        if self.down:
            raise StoreUnavailable("token store (Redis) unavailable")
        return self.remote


def test_the_clock_reads_redis_once_then_advances_with_the_monotonic_clock() -> None:
    fake = FakeTime()
    clock = RedisClock(fake.read_time, fake.monotonic, resync=60.0)
    assert clock() == 1_700_000_000.0
    fake.mono += 25.0
    assert clock() == 1_700_000_025.0
    fake.mono += 34.9
    assert clock() == pytest.approx(1_700_000_059.9)
    assert fake.reads == 1


def test_the_clock_resyncs_with_redis_after_the_interval() -> None:
    fake = FakeTime()
    clock = RedisClock(fake.read_time, fake.monotonic, resync=60.0)
    clock()
    fake.mono += 60.0
    fake.remote = 1_700_000_065.0  # Redis ran 5 s ahead of our monotonic estimate
    assert clock() == 1_700_000_065.0
    assert fake.reads == 2
    fake.mono += 1.0
    assert clock() == 1_700_000_066.0
    assert fake.reads == 2


def test_the_clock_reads_redis_time_about_mid_round_trip() -> None:
    fake = FakeTime()
    readings = iter([100.0, 100.0, 102.0])  # call, before the read, after the read

    def monotonic() -> float:
        return next(readings, 102.0)

    clock = RedisClock(fake.read_time, monotonic, resync=60.0)
    clock()
    assert clock() == 1_700_000_001.0  # 102 - mid-point 101


def test_the_clock_keeps_its_last_reading_when_a_resync_fails() -> None:
    fake = FakeTime()
    clock = RedisClock(fake.read_time, fake.monotonic, resync=60.0)
    clock()
    fake.down = True
    fake.mono += 61.0
    assert clock() == 1_700_000_061.0
    fake.mono += 10.0
    assert clock() == 1_700_000_071.0
    assert fake.reads == 2  # not retried on every call while Redis is down
    fake.down = False
    fake.remote = 1_700_000_200.0
    fake.mono += 60.0
    assert clock() == 1_700_000_200.0


def test_the_clock_raises_store_unavailable_when_redis_was_never_reached() -> None:
    fake = FakeTime()
    fake.down = True
    clock = RedisClock(fake.read_time, fake.monotonic, resync=60.0)
    with pytest.raises(StoreUnavailable):
        clock()
    fake.down = False
    assert clock() == 1_700_000_000.0  # tries again at once: it has nothing to go on


def test_the_clock_over_a_store_follows_redis_time(store: TokenStore) -> None:
    clock = RedisClock(store.time)
    assert abs(clock() - time.time()) < 1.0


def test_the_clock_over_a_dead_store_raises_store_unavailable() -> None:
    clock = RedisClock(TokenStore(dead_redis(), UNIT_NAMESPACE).time)
    with pytest.raises(StoreUnavailable):
        clock()


# -- Redis losing writes (a Sentinel failover, a restart without persistence) --------------


def lose_writes_back_to(fake_redis: redis.Redis, store: TokenStore, token: Token) -> None:
    """What a failover to a replica that missed the last writes leaves: ``token`` again."""
    fake_redis.set(store.keys.token, token.to_json())
    fake_redis.set(store.keys.generation, token.generation)


def test_a_token_older_than_one_this_process_saw_stored_is_not_used_again(
    store: TokenStore, fake_redis: redis.Redis
) -> None:
    first = make_token(1)
    store.save(first)
    assert store.load() == first
    store.save(make_token(2))
    lose_writes_back_to(fake_redis, store, first)

    assert store.load() is None  # renewed rather than used: generations never go back
    assert store.generation() == 2  # the next token is written above what was lost


def test_after_lost_writes_the_next_token_is_saved_above_them(
    store: TokenStore, fake_redis: redis.Redis
) -> None:
    first = make_token(1)
    store.save(first)
    store.save(make_token(2))
    lose_writes_back_to(fake_redis, store, first)

    third = make_token(store.generation() + 1, value="tok-after-failover")
    assert store.save(third) == (True, 3)
    assert store.load() == third


def test_another_process_that_never_saw_the_lost_write_keeps_the_strict_succession(
    fake_redis: redis.Redis,
) -> None:
    ours, theirs = TokenStore(fake_redis, UNIT_NAMESPACE), TokenStore(fake_redis, UNIT_NAMESPACE)
    first = make_token(1)
    ours.save(first)
    ours.save(make_token(2))
    lose_writes_back_to(fake_redis, ours, first)

    assert theirs.load() == first  # it never used generation 2: nothing goes back for it
    assert theirs.save(make_token(3)) == (False, 1)  # and it may not skip a generation
    assert ours.save(make_token(3, value="tok-from-the-process-that-saw-2")) == (True, 3)
    assert theirs.load() is not None
    assert theirs.load() == ours.load()


def test_with_a_hash_tag_every_key_of_an_account_names_the_same_tag() -> None:
    namespace = TokenStore.namespace_for("mt", "sandbox", "app-1", hash_tag=True)
    assert namespace == "mt:{sandbox:app-1}"
    assert TokenStore.namespace_for("mt", "sandbox", "app-1") == "mt:sandbox:app-1"
