"""The token store's start-up check: one round trip that tells whether the fleet can use it.

Workers and beat run it at start (``worker.store_check``): a Redis that is unreachable,
refuses the account's keys to its ACL user, is a read-only replica or out of memory is
named at once, rather than by the first call that needs a token. Tasks that end while the
store refuses writes ask it again until it takes them (``worker.task_bodies``).
"""

from __future__ import annotations

from merchant_tasks.store.keys import redis_address, unavailable_as_error
from merchant_tasks.store.token_store import TokenStore

CHECK_KEY = "start-check"  # under the account's namespace; written to expire at once


def check_store(store: TokenStore) -> None:
    """StoreUnavailable naming the Redis (host:port, no password) and the cause, unless it
    answers, and takes a write on the account's keys: a SET of an empty value that expires
    after a millisecond, which a read-only replica, a Redis out of memory (``noeviction``)
    or an ACL without the account's key pattern refuses (StoreRefusingWrites for the first
    two)."""
    with unavailable_as_error(redis_address(store.redis)):
        store.redis.ping()
        store.redis.set(f"{store.namespace}:{CHECK_KEY}", b"", px=1)
