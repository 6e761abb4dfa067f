"""Redis Sentinel: the token store and Celery follow a failover of the master.

Each test starts a master, a replica and three sentinels of its own (``redis-server
--sentinel`` with a generated config file) on free loopback ports, with passwords for the
master and for the sentinels, and stops them all at the end. The machine's Redis is never
touched. MERCHANT_REDIS_URL is Celery's own Sentinel form, and it alone configures the
token store, the broker and the result backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest
import redis

from merchant_tasks.accounts import client_for, close_client
from merchant_tasks.aio import async_client_from_env
from merchant_tasks.exceptions import StoreUnavailable
from merchant_tasks.renewal import life
from merchant_tasks.sandbox.emulator import TOKEN_PATH, SandboxApp, SandboxConfig
from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.sandbox.processes import RedisServer, redis_answers, wait_until
from merchant_tasks.settings import Settings
from merchant_tasks.store.topology import redis_from_url
from support.celery_fleet import (
    ECHO,
    Fleet,
)
from support.fault_harness import CallLoop, Evidence
from support.routes import PING

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

pytestmark = pytest.mark.integration

MASTER = "mymaster"
MASTER_PASSWORD = "master-pw-5d0c8e"  # the data nodes' requirepass (default user)
SENTINEL_PASSWORD = "sentinel-pw-93b1aa"  # the sentinels' own requirepass
REPLICATION_PASSWORD = "repl-pw-1f7e42"  # the replica's user on the master, to cut the link
DOWN_AFTER_MS = 1000  # sentinels call the master down after 1 s of silence (default 30 s)
FAILOVER_TIMEOUT_MS = 5000
FAILOVER_DEADLINE = 60.0  # seconds for the sentinels to agree and promote, on a busy machine
CALLER_THREADS = 3
CALLER_PAUSE = 0.1  # seconds between two calls of one in-process caller
TASK_PERIOD = 0.1  # seconds between two enqueued call_api tasks
LOAD_BEFORE = 1.0  # seconds of load before the master is killed
LOAD_AFTER = 2.0  # seconds of load once the old master is a replica of the new one
VISIBILITY_TIMEOUT = 10  # seconds; above any task here, so only a lost ack redelivers
# seconds after the kill by which a message delivered before it, whose acknowledgement was
# lost, has come back: one visibility timeout after its delivery, and as long again for a
# busy machine (what is not back by then was lost with the old master)
REDELIVERY_DEADLINE = 2 * VISIBILITY_TIMEOUT
RESULT_DEADLINE = 120.0  # a task caught in the failover may wait for a retry or redelivery
SLOW_EXCHANGE = 0.5  # seconds the token endpoint takes while the master is killed
WORKER = "worker"  # the caller name of calls without an X-Caller header
# a data node stopped at the end does not wait, as a master, for its replica's next
# acknowledgement (up to 1 s); the tests kill a master with SIGKILL
QUICK_STOP = ("--shutdown-on-sigterm", "now")


# -- servers -------------------------------------------------------------------------------


def admin(port: int, password: str) -> redis.Redis:
    return redis.Redis(port=port, password=password, socket_timeout=5.0, decode_responses=True)


def sentinel_servers(workdir: Path, master_port: int, replica_port: int) -> list[RedisServer]:
    """Three sentinels watching the master on ``master_port``; each one's config file is its
    state, and names the replica and the two other sentinels, which they would otherwise
    learn through the master only after their first hello (2 s, Redis's rule)."""
    servers = [RedisServer(workdir / f"sentinel-{n}") for n in range(3)]
    run_ids = [secrets.token_hex(20) for _ in servers]  # 40 hex digits, as Redis's own
    binary = shutil.which("redis-server")
    assert binary is not None
    for server, run_id in zip(servers, run_ids, strict=True):
        config = server.workdir / "sentinel.conf"
        config.write_text(
            f"port {server.port}\n"
            "bind 127.0.0.1\n"
            f"dir {server.workdir}\n"
            f"requirepass {SENTINEL_PASSWORD}\n"
            f"sentinel myid {run_id}\n"
            f"sentinel sentinel-pass {SENTINEL_PASSWORD}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {master_port} 2\n"
            f"sentinel auth-pass {MASTER} {MASTER_PASSWORD}\n"
            f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel known-replica {MASTER} 127.0.0.1 {replica_port}\n"
            + "".join(
                f"sentinel known-sentinel {MASTER} 127.0.0.1 {other.port} {other_id}\n"
                for other, other_id in zip(servers, run_ids, strict=True)
                if other is not server
            )
        )
        server.argv = [binary, str(config), "--sentinel"]
    return servers


@dataclass
class SentinelGroup:
    """A master, its replica and three sentinels, all on loopback."""

    master: RedisServer
    replica: RedisServer
    sentinels: list[RedisServer]

    @property
    def url(self) -> str:
        """MERCHANT_REDIS_URL in Celery's form: the master's password, every sentinel."""
        return ";".join(
            f"sentinel://:{MASTER_PASSWORD}@127.0.0.1:{s.port}/0" for s in self.sentinels
        )

    def master_ports(self) -> list[int | None]:
        """The master's port as each sentinel that answers sees it."""
        ports = []
        for server in self.sentinels:
            with contextlib.closing(admin(server.port, SENTINEL_PASSWORD)) as sentinel:
                try:
                    address = cast(
                        "tuple[str, int] | None", sentinel.sentinel_get_master_addr_by_name(MASTER)
                    )
                except redis.RedisError:
                    continue
                ports.append(int(address[1]) if address else None)
        return ports

    def settled_on(self, port: int) -> bool:
        """Whether every sentinel names the master on ``port``, sees it up, and holds no other
        sentinel's word that the master is down. Sentinel keeps those words, given about the
        old master, for 5 s after it switches (sentinel.c: ``sentinel_ask_period*5``) and
        counts them towards calling the new one down: a sentinel with no PONG from the new
        master within DOWN_AFTER_MS of the switch (it reconnects once a second) then fails
        over again at once, to whichever replica is up."""
        for server in self.sentinels:
            with contextlib.closing(admin(server.port, SENTINEL_PASSWORD)) as sentinel:
                state = cast("dict[str, Any]", sentinel.sentinel_master(MASTER))
                if state["port"] != port or state["flags"] != "master":
                    return False
                peers = cast(
                    "list[dict[str, Any]]",
                    sentinel.sentinel_sentinels(MASTER, return_responses=True),
                )
                if any("master_down" in peer["flags"] for peer in peers):
                    return False
        return True

    def in_sync(self) -> bool:
        """Whether the replica has applied everything the master wrote."""
        with (
            contextlib.closing(admin(self.master.port, MASTER_PASSWORD)) as master,
            contextlib.closing(admin(self.replica.port, MASTER_PASSWORD)) as replica,
        ):
            offset = master.info("replication")["master_repl_offset"]
            return bool(replica.info("replication").get("slave_repl_offset") == offset)

    def role(self, server: RedisServer) -> str:
        with contextlib.closing(admin(server.port, MASTER_PASSWORD)) as client:
            return str(client.info("replication")["role"])

    def logs(self, lines: int = 25) -> str:
        """How each sentinel's log ends: what it saw and decided."""
        return "\n".join(
            f"-- sentinel {server.port}:\n{server.child.log_tail(lines) if server.child else ''}"
            for server in self.sentinels
        )

    def cut_replication(self) -> None:
        """Disconnect the replica and keep it out: what the master writes next is not copied."""
        with contextlib.closing(admin(self.master.port, MASTER_PASSWORD)) as master:
            master.execute_command("ACL", "SETUSER", "repl", "off")  # type: ignore[no-untyped-call]
            master.execute_command("CLIENT", "KILL", "USER", "repl")  # type: ignore[no-untyped-call]

    def stop(self) -> None:
        for server in (*self.sentinels, self.replica, self.master):
            server.stop()


@pytest.fixture
def sentinel_group(tmp_path: Path) -> Iterator[SentinelGroup]:
    master = RedisServer(
        tmp_path / "master",
        "--requirepass", MASTER_PASSWORD,
        "--masterauth", MASTER_PASSWORD,
        # the replica's first sync starts at once, not after Redis's 5 s wait for more
        # replicas to share one transfer
        "--repl-diskless-sync-delay", "0",
        *QUICK_STOP,
    )  # fmt: skip
    group = SentinelGroup(master, master, [])
    try:
        master.start(ready=lambda: redis_answers(master.port, MASTER_PASSWORD))
        with contextlib.closing(admin(master.port, MASTER_PASSWORD)) as client:
            client.execute_command(  # type: ignore[no-untyped-call]
                "ACL", "SETUSER", "repl", "on", f">{REPLICATION_PASSWORD}",
                "+psync", "+replconf", "+ping",
            )  # fmt: skip
        group.replica = RedisServer(
            tmp_path / "replica",
            "--requirepass", MASTER_PASSWORD,
            "--masteruser", "repl",
            "--masterauth", REPLICATION_PASSWORD,
            "--replicaof", "127.0.0.1", str(master.port),
            *QUICK_STOP,
        )  # fmt: skip
        group.replica.start(ready=lambda: redis_answers(group.replica.port, MASTER_PASSWORD))
        wait_until(group.in_sync, "the replica in sync", 30.0)
        for sentinel in sentinel_servers(tmp_path, master.port, group.replica.port):
            group.sentinels.append(sentinel)
            sentinel.start(ready=functools.partial(redis_answers, sentinel.port, SENTINEL_PASSWORD))

        def all_known() -> bool:
            for server in group.sentinels:
                with contextlib.closing(admin(server.port, SENTINEL_PASSWORD)) as sentinel:
                    state = cast("dict[str, Any]", sentinel.sentinel_master(MASTER))
                    if state["num-slaves"] < 1 or state["num-other-sentinels"] < 2:
                        return False
            return True

        wait_until(all_known, "three sentinels knowing each other and the replica", 60.0)
        yield group
    finally:
        group.stop()


# -- the emulator, recording which token each caller used ----------------------------------


class RecordingSandbox(SandboxApp):
    """The emulator, noting in arrival order which token each caller's API call carried."""

    def __init__(self, config: SandboxConfig) -> None:
        super().__init__(config)
        self.uses: list[tuple[str, str]] = []  # (caller, token)
        self._uses_lock = threading.Lock()

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Any:
        authorization = environ.get("HTTP_AUTHORIZATION", "")
        if authorization.startswith("Bearer "):
            with self._uses_lock:
                self.uses.append((environ.get("HTTP_X_CALLER", WORKER), authorization[7:]))
        return super().__call__(environ, start_response)


@pytest.fixture
def merchant_sandbox_app(merchant_sandbox_config: SandboxConfig) -> RecordingSandbox:
    """Every emulator of this module records which token each caller used."""
    return RecordingSandbox(merchant_sandbox_config)


def _echo_calls(sandbox: MerchantSandbox) -> list[int]:
    counts = sandbox.app.counters()["endpoints"].get(f"POST {ECHO}", {})
    return list(counts.values())


def backward_steps(app: RecordingSandbox) -> list[str]:
    """Every place a caller used a token issued before one it had already used."""
    order = {token: n for n, token in enumerate(app.issued_tokens())}
    latest: dict[str, int] = {}
    steps = []
    for caller, token in list(app.uses):
        issued = order[token]
        if issued < latest.get(caller, -1):
            steps.append(f"{caller}: token #{issued} after #{latest[caller]}")
        latest[caller] = max(latest.get(caller, -1), issued)
    return steps


# -- load ------------------------------------------------------------------------------------


class Feeder:
    """Enqueues an echo every TASK_PERIOD, noting each result and when its sending began
    and ended."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.sent: list[tuple[float, float, int, Any]] = []
        self.publish_errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                result = self.fleet.call("POST", ECHO, json={"n": n})
                self.sent.append((started, time.monotonic(), n, result))
            except Exception as exc:  # the broker is down: the enqueuer's own error
                self.publish_errors.append(type(exc).__name__)
            n += 1
            time.sleep(TASK_PERIOD)

    def __enter__(self) -> Feeder:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60.0)


# -- the failover ----------------------------------------------------------------------------


@pytest.fixture
def fleet(
    tmp_path: Path,
    merchant_sandbox: MerchantSandbox,
    sentinel_group: SentinelGroup,
    merchant_key_prefix: str,
    merchant_secret_file: Path,
) -> Iterator[Fleet]:
    """A fleet whose token store, broker and results are all the group's, through one
    MERCHANT_REDIS_URL; long windows, so that no scheduled renewal interferes."""
    with Fleet(
        tmp_path, merchant_sandbox, sentinel_group.url, merchant_key_prefix, merchant_secret_file
    ) as fleet:
        fleet.env["MERCHANT_REDIS_SENTINEL_PASSWORD"] = SENTINEL_PASSWORD
        fleet.long_windows()
        yield fleet


def test_a_sentinel_failover_under_load_loses_no_call_and_no_token_generation_goes_back(
    merchant_sandbox: MerchantSandbox,
    sentinel_group: SentinelGroup,
    fleet: Fleet,
    merchant_key_prefix: str,
) -> None:
    app = merchant_sandbox.app
    assert isinstance(app, RecordingSandbox)
    evidence = Evidence()  # what the callers and the fleet showed; no password may be in it
    settings = Settings.from_env(fleet.env)
    client = client_for(settings)
    try:
        # a message whose acknowledgement the failover lost comes back within the test
        config_dir = fleet.short_visibility_dir(VISIBILITY_TIMEOUT)
        # one pool process: its calls reach the emulator in order
        fleet.start_worker("w", concurrency=1, cwd=config_dir)
        fleet.wait_ready()
        callers = CallLoop(client, CALLER_THREADS, evidence, "failover", pause=CALLER_PAUSE)
        with callers, Feeder(fleet) as feeder:
            time.sleep(LOAD_BEFORE)
            synced = time.monotonic()  # whatever was sent before this is on the replica
            wait_until(sentinel_group.in_sync, "the replica in sync", 30.0)
            before = client.manager.store.load()
            assert before is not None

            # what asynchronous replication loses: writes the replica has not received
            # when the master dies. Here the link is cut first, so that the lost writes are
            # known: a renewal, and whatever the fleet wrote in the same moments.
            sentinel_group.cut_replication()
            lost = client.manager.renew(force=True)
            assert lost.generation == before.generation + 1
            sentinel_group.master.kill()
            killed = time.monotonic()
            app.revoke_all()  # every call now needs the store to renew, while it is away

            new_master = sentinel_group.replica.port
            wait_until(  # as the first sentinel that answers sees it
                lambda: sentinel_group.master_ports()[:1] == [new_master],
                "the sentinels promoting the replica",
                FAILOVER_DEADLINE,
            )
            promoted = time.monotonic()

            # the old master comes back, empty, once the failover is over for every
            # sentinel: before that, a sentinel that misses the new master's first PONG may
            # fail over again and promote the old master, empty (see settled_on). The
            # sentinels make it a replica of the new one (not before it has said it is a
            # master for 8 s, Redis's rule: some 10 s of load), and nobody is sent to it
            # meanwhile
            wait_until(
                lambda: sentinel_group.settled_on(new_master),
                "every sentinel naming the new master, up, with no word left that it is down",
                FAILOVER_DEADLINE,
            )
            old_master = sentinel_group.master
            old_master.start(ready=lambda: redis_answers(old_master.port, MASTER_PASSWORD))
            try:
                wait_until(
                    lambda: sentinel_group.role(old_master) == "slave",
                    "the old master rejoining as a replica",
                    FAILOVER_DEADLINE,
                )
            except TimeoutError as exc:
                raise TimeoutError(
                    f"{exc}; the sentinels' logs:\n{sentinel_group.logs()}"
                ) from None
            time.sleep(LOAD_AFTER)
        settled = promoted + 1.0  # calls started after this meet the new master only

        # a task enqueued on the old master after the replica's last copy may be lost with
        # it (said in docs/reliability.md); every other one must complete
        kept = [(n, r) for start, end, n, r in feeder.sent if end < synced or start > killed]
        maybe_lost = [
            (n, r) for start, end, n, r in feeder.sent if not (end < synced or start > killed)
        ]
        answers = {n: fleet.get(r, RESULT_DEADLINE) for n, r in kept}
        with contextlib.suppress(TimeoutError):
            wait_until(
                lambda: all(r.ready() for _, r in maybe_lost),
                "",
                killed + REDELIVERY_DEADLINE - time.monotonic(),
            )
        lost_tasks = [n for n, r in maybe_lost if not r.ready()]
        answers.update({n: r.get() for n, r in maybe_lost if r.ready()})
    finally:
        fleet.close()  # before the checks: its logs complete
        close_client(client)  # here, not by the garbage collector during a later test
    executed = sum(_echo_calls(merchant_sandbox))
    print(
        f"failover took {promoted - killed:.1f} s; in-process calls: "
        f"{len(callers.of())}, outcomes {sorted(set(callers.of()))}; "
        f"tasks: {len(feeder.sent)}, enqueued in the lost moments: {len(maybe_lost)}, "
        f"lost: {lost_tasks}, echo calls executed: {executed}; "
        f"renewals: {merchant_sandbox.exchanges()}"
    )

    # calls that needed Redis meanwhile failed with StoreUnavailable, and with nothing else
    assert set(callers.of()) <= {"ok", StoreUnavailable.__name__}, callers.failures(killed)
    # once the failover is over, every call succeeds again
    assert set(callers.of(since=settled)) == {"ok"}, callers.failures(promoted)
    # every task enqueued outside the lost moments ran and reported its real result
    assert all(answer == {"echo": {"n": n}} for n, answer in answers.items()), answers
    assert not feeder.publish_errors

    # neither password shows in any failure or in the worker's DEBUG log
    for name, text in fleet.logs().items():
        evidence.add(name, text)
    evidence.needle("the master password", MASTER_PASSWORD)
    evidence.needle("the sentinel password", SENTINEL_PASSWORD)
    evidence.assert_no_leak()

    # a token generation never goes backwards in any process
    assert not backward_steps(app), backward_steps(app)
    store_now = redis_from_url(
        sentinel_group.url, sentinel_password=SENTINEL_PASSWORD, sentinel_master=MASTER
    )
    generation_key = client.manager.store.keys.generation
    assert int(store_now.get(generation_key) or 0) > lost.generation  # above the lost one
    store_now.close()

    # the first token, the lost renewal, the renewal after the revoke-all: and at most one
    # more for the failover
    assert merchant_sandbox.exchanges()["ok"] <= 3 + 1


def test_a_call_whose_retry_falls_in_the_failover_is_retried_not_dropped(
    merchant_sandbox: MerchantSandbox, sentinel_group: SentinelGroup, fleet: Fleet
) -> None:
    """The master dies while a task renews the token: saving it fails with StoreUnavailable,
    and the task's retry must be published while the broker (the same Redis) is away."""
    # short HTTP timeouts make a short renewal lock: the one held when the master dies
    # outlives it on the new master until its TTL, and the retried call waits for that
    fleet.env.update({"MERCHANT_CONNECT_TIMEOUT": "0.5", "MERCHANT_READ_TIMEOUT": "1"})
    fleet.start_worker("w", concurrency=1)
    fleet.wait_ready()
    merchant_sandbox.app.revoke_all()  # the next call gets a 401 and renews...
    merchant_sandbox.app.configure({"token_latency": SLOW_EXCHANGE})  # ... slowly
    result = fleet.call("POST", ECHO, json={"order": "retried"})
    wait_until(
        lambda: merchant_sandbox.app.arrived(TOKEN_PATH) == 2, "the renewal's exchange", 30.0
    )
    sentinel_group.master.kill()  # before the exchange answers: its token cannot be saved
    merchant_sandbox.app.configure({"token_latency": 0.0})

    answer = fleet.get(result, RESULT_DEADLINE)
    log = fleet.logs()["worker-w.log"]
    assert answer == {"echo": {"order": "retried"}}
    assert "StoreUnavailable" in log  # the case under test did happen: the task retried


def test_asyncio_calls_after_a_sentinel_failover_all_succeed(
    merchant_env: dict[str, str],
    merchant_sandbox: MerchantSandbox,
    sentinel_group: SentinelGroup,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An asyncio client on the group (redis.asyncio's Sentinel) makes calls; the master
    dies; once every sentinel names the replica, 8 concurrent calls each succeed: the
    client's pool asks the sentinels for the master and drops its connections to the dead
    one when the answer changes (the stale connections a plain Redis's restart leaves are
    test_async_client.py's)."""
    monkeypatch.setenv("MERCHANT_REDIS_URL", sentinel_group.url)
    monkeypatch.setenv("MERCHANT_REDIS_SENTINEL_PASSWORD", SENTINEL_PASSWORD)
    new_master = sentinel_group.replica.port

    def promoted() -> bool:
        return sentinel_group.master_ports() == [new_master] * 3

    async def scenario() -> list[Any]:
        async with async_client_from_env() as client:
            calls = [client.request("GET", PING) for _ in range(8)]
            assert await asyncio.gather(*calls) == [{"ok": True}] * 8
            sentinel_group.master.kill()
            await asyncio.to_thread(wait_until, promoted, "the replica promoted", FAILOVER_DEADLINE)
            await asyncio.sleep(life.LOCAL_COPY_TTL)  # the process's copy is read again
            calls = [client.request("GET", PING) for _ in range(8)]
            return await asyncio.gather(*calls, return_exceptions=True)

    assert asyncio.run(scenario()) == [{"ok": True}] * 8
