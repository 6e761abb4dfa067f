"""Redis Cluster for the token store: one hash slot per account, several accounts on
several nodes.

Each test starts a cluster of three masters of its own (``redis-server --cluster-enabled
yes`` on free loopback ports, joined by ``redis-cli --cluster create``) and stops it at the
end. Which slot a key is in, and which node serves it, is asked of the cluster itself
(CLUSTER KEYSLOT, CLUSTER SLOTS), never computed here.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from merchant_tasks.accounts import AccountClients
from merchant_tasks.ops.status import account_status, account_statuses
from merchant_tasks.sandbox.emulator import SandboxApp, SandboxConfig, SandboxServer
from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.sandbox.processes import RedisServer, free_port, wait_until
from merchant_tasks.store.token_store import TokenStore
from support.account import TEST_SECRET
from support.routes import PING

pytestmark = pytest.mark.integration

MASTERS = 3
ACCOUNTS = [f"acct-{n}" for n in range(6)]  # API keys; the cluster spreads them over its nodes
STORM_THREADS = 6
CLUSTER_BUS_OFFSET = 10000  # Redis's cluster bus listens on the port plus this
MAX_PORT = 65535
CLUSTER_READY = 60.0  # seconds for the nodes to agree on the slot map, on a busy machine


def cluster_port() -> int:
    """A free port whose cluster bus port (10000 above it, Redis's rule) is free too."""
    while True:
        port = free_port()
        if port + CLUSTER_BUS_OFFSET <= MAX_PORT:
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))
                except OSError:
                    continue
            return port


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[RedisServer]]:
    """Three masters sharing the 16384 slots, no replicas."""
    options = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
    nodes = [
        RedisServer(tmp_path / f"node-{n}", *options, port=cluster_port()) for n in range(MASTERS)
    ]
    try:
        for node in nodes:
            node.start()
        binary = shutil.which("redis-cli")
        assert binary is not None, "redis-cli is not on PATH"
        subprocess.run(
            [binary, "--cluster", "create", *(f"127.0.0.1:{node.port}" for node in nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip

        def ready() -> bool:
            for node in nodes:
                info = cast(dict[str, Any], node_client(node.port).cluster("INFO"))
                if info.get("cluster_state") != "ok":
                    return False
            return True

        wait_until(ready, "the cluster's slots all served", CLUSTER_READY)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def node_client(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=5.0)


def slot_owners(port: int) -> dict[int, int]:
    """Each slot's master port, from CLUSTER SLOTS as the node at ``port`` sees it."""
    owners = {}
    raw = node_client(port).execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
    for start, end, master, *_ in raw:
        for slot in range(int(start), int(end) + 1):
            owners[slot] = int(master[1])
    return owners


def keyslot(port: int, key: str) -> int:
    return int(node_client(port).execute_command("CLUSTER", "KEYSLOT", key))  # type: ignore[no-untyped-call]


def store_keys(store: TokenStore) -> list[str]:
    return [
        store.keys.token,
        store.keys.generation,
        store.keys.lock,
        store.keys.breaker,
        store.keys.counters,
        store.keys.exchange_log,
    ]


def test_every_key_of_an_account_is_in_one_slot_by_the_clusters_own_rule(
    cluster: list[RedisServer], merchant_key_prefix: str
) -> None:
    port = cluster[0].port
    owners = slot_owners(port)
    nodes_used = set()
    for api_key in ACCOUNTS:
        tagged = TokenStore(node_client(port), TokenStore.namespace_for(
            merchant_key_prefix, "sandbox", api_key, hash_tag=True))  # fmt: skip
        slots = {keyslot(port, key) for key in store_keys(tagged)}
        assert len(slots) == 1, (api_key, slots)
        nodes_used.add(owners[slots.pop()])
        # control: without the tag, the same keys fall in several slots
        plain = TokenStore(node_client(port), TokenStore.namespace_for(
            merchant_key_prefix, "sandbox", api_key))  # fmt: skip
        assert len({keyslot(port, key) for key in store_keys(plain)}) > 1
    assert len(nodes_used) == MASTERS  # the accounts are spread over every node


@pytest.fixture
def sandboxes(merchant_secret_file: Path) -> Iterator[dict[str, MerchantSandbox]]:
    """One emulator per account (the emulator knows one API key), all with the suite's
    secret."""
    started: dict[str, MerchantSandbox] = {}
    servers = []
    try:
        for api_key in ACCOUNTS:
            app = SandboxApp(SandboxConfig(api_key=api_key, secret=TEST_SECRET))
            server = SandboxServer(app)
            servers.append(server)
            server.__enter__()
            started[api_key] = MerchantSandbox(app, server, api_key, merchant_secret_file)
        yield started
    finally:
        for server in servers:
            server.__exit__(None, None, None)


def test_accounts_on_different_nodes_call_renew_after_401_and_lock_through_the_cluster(
    cluster: list[RedisServer],
    sandboxes: dict[str, MerchantSandbox],
    merchant_key_prefix: str,
    merchant_secret_file: Path,
    tmp_path: Path,
) -> None:
    accounts_file = tmp_path / "accounts.toml"
    accounts_file.write_text(
        "".join(
            f'[accounts.{api_key}]\napi_key = "{api_key}"\nbase_url = "{sandbox.url}"\n'
            f'api_secret_file = "{merchant_secret_file}"\n\n'
            for api_key, sandbox in sandboxes.items()
        )
    )
    entry = cluster[1].port  # any node will do: the client learns the slot map from it
    fleet = AccountClients.from_env(
        {
            "MERCHANT_ACCOUNTS_FILE": str(accounts_file),
            "MERCHANT_REDIS_URL": f"redis://127.0.0.1:{entry}/0",
            "MERCHANT_REDIS_CLUSTER": "1",
            "MERCHANT_KEY_PREFIX": merchant_key_prefix,
        }
    )
    # beat's fleet-wide check reads and claims across the nodes in one pipeline each
    assert sorted(fleet.due()) == sorted(ACCOUNTS)  # no token yet: every account is due
    for api_key in ACCOUNTS:
        fleet.renewal_done(api_key)
        assert fleet.get(api_key).request("GET", PING) == {"ok": True}
    assert fleet.due() == []

    # a revoke-all on every account at once: each storm costs one exchange (the redis-py
    # lock and the save script run on the cluster client), every call succeeds
    for sandbox in sandboxes.values():
        sandbox.app.revoke_all()
    failures: list[BaseException] = []

    def storm(api_key: str) -> None:
        try:
            for _ in range(5):
                assert fleet.get(api_key).request("GET", PING) == {"ok": True}
        except BaseException as exc:  # reported by the test's thread
            failures.append(exc)

    threads = [
        threading.Thread(target=storm, args=(api_key,))
        for api_key in ACCOUNTS
        for _ in range(STORM_THREADS // 2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120.0)
    assert not failures, failures
    assert {k: s.exchanges()["ok"] for k, s in sandboxes.items()} == dict.fromkeys(ACCOUNTS, 2)

    # each account's token, generation and counters live on the node owning its slot
    owners = slot_owners(entry)
    nodes_used = set()
    for api_key in ACCOUNTS:
        store = fleet.get(api_key).manager.store
        owner = owners[keyslot(entry, store.keys.token)]
        nodes_used.add(owner)
        on_node = node_client(owner)
        assert on_node.get(store.keys.generation) == b"2"
        assert on_node.exists(store.keys.token, store.keys.counters, store.keys.exchange_log) == 3
        assert store.records.counters()["renewals:forced:ok"] == 1
    assert len(nodes_used) == MASTERS

    # status reads every account across the nodes in pipelines: what each store reads alone
    statuses = account_statuses(fleet)
    for api_key in ACCOUNTS:
        alone = account_status(api_key, fleet.accounts[api_key], fleet.get(api_key).manager.store)
        assert statuses[api_key].generation == alone.generation == 2
        assert statuses[api_key].counters == alone.counters
        assert statuses[api_key].exchanges_last_hour == alone.exchanges_last_hour == 2
