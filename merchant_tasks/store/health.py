"""The token store's start-up check: one round trip that tells whether the fleet can use it.

Workers and beat run it at start (``worker.store_check``): a Redis that is unreachable,
refuses the account's keys to its ACL user, or is a read-only replica is named at once,
rather than by the first call that needs a token.
"""

from __future__ import annotations

from merchant_tasks.store.keys import redis_address, unavailable_as_error
from merchant_tasks.store.token_store import TokenStore

CHECK_KEY = "start-check"  # under the account's namespace; never written, only deleted


def check_store(store: TokenStore) -> None:
    """StoreUnavailable naming the Redis (host:port, no password) and the cause, unless it
    answers, and takes a write on the account's keys: the DEL of a key that never exists,
    which a read-only replica or an ACL without the account's key pattern refuses."""
    with unavailable_as_error(redis_address(store.redis)):
        store.redis.ping()
        store.redis.delete(f"{store.namespace}:{CHECK_KEY}")
