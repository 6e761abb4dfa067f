"""Where a store is, as errors and warnings name it (store/keys.py, ``redis_address``): host
and port or a Sentinel master and its sentinels, never a password."""

from __future__ import annotations

import pytest
import redis

from merchant_tasks.exceptions import StoreUnavailable
from merchant_tasks.store.keys import redis_address
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.store.topology import redis_from_url


def test_an_unreachable_store_is_named_by_host_and_port_never_by_its_password() -> None:
    client = redis.Redis.from_url("redis://ops:hunter2-pw@127.0.0.1:1/0", socket_connect_timeout=1)
    store = TokenStore(client, "mt-test-unreachable")
    with pytest.raises(StoreUnavailable) as caught:
        store.load()
    assert "Redis at 127.0.0.1:1" in str(caught.value)
    assert "hunter2-pw" not in str(caught.value) + repr(caught.value)


def test_a_sentinel_store_is_named_by_its_master_and_sentinels_never_its_passwords() -> None:
    """Errors and the start-up warning name where the store is: a Sentinel client's pool has
    no host of its own (it was named localhost:6379)."""
    url = "sentinel://:master-pw@127.0.0.1:26379/0;sentinel://:master-pw@127.0.0.1:26380/0"
    client = redis_from_url(url, sentinel_master="shop", sentinel_password="sentinel-pw")
    try:
        where = redis_address(client)
    finally:
        client.close()
    assert where == "master shop via sentinels 127.0.0.1:26379,127.0.0.1:26380"
    assert "pw" not in where


def test_a_command_saving_a_token_never_shows_it_in_its_repr(store: TokenStore) -> None:
    """A token without a key is saved in clear: the command (and the flow's step that
    carries it) is printed by error trackers and debuggers, its arguments never."""
    from merchant_tasks.flows import Redis
    from support.tokens import make_token

    token = make_token(value="bearer-3f9a1c-secret")
    command = store.ask.save(token)
    assert "bearer-3f9a1c-secret" in str(command.args)  # what it sends: the token is there
    assert "bearer-3f9a1c-secret" not in repr(command)
    assert "bearer-3f9a1c-secret" not in repr(Redis(command))
