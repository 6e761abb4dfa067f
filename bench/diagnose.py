"""Where the time goes: attributions behind two of run.py's figures.

    python bench/diagnose.py hot-path [--server tornado|werkzeug] [--rounds 8] [--calls 1000]
    python bench/diagnose.py storm [--rounds 3]

``hot-path`` splits MerchantClient.request's cost against the raw session, in interleaved
rounds on one thread (wall and this thread's CPU time per call, medians):

- raw requests.Session with a fixed bearer header (run.py's baseline);
- the same GET with per-request headers and json=None/params=None, as the client sends it;
- ``client._send`` alone: the token lookup, the request and the decoding, no send loop;
- ``client.request``: the above inside the send loop (``api.calls``);
- ``client.manager.token()`` alone.

``storm`` repeats run.py's 401 storm with timers around the pieces of a stormy call: the
HTTP requests, each Redis round trip of the token's life (``manager.store.send``), the
exchange, the sleeps of callers waiting for the lock holder, the Redis commands (INFO
commandstats) and the connections in the client's Redis pool afterwards.

Both use a private redis-server and the emulator in its own process, and stop them at the
end. These are diagnostics that read private attributes (``_send``); they are not part of
the quick run.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import redis
import requests

from harness import (
    API_KEY,
    PING,
    SandboxControl,
    commands_processed,
    concurrent_calls,
    median,
    percentile,
    private_redis,
    sandbox_process,
    timed,
)
from merchant_tasks.accounts import FleetClient, client_for
from merchant_tasks.api.calls import Call
from merchant_tasks.api.client import new_session
from merchant_tasks.settings import DEFAULT_TIMEOUTS, FleetSettings, Secret, Settings


@contextlib.contextmanager
def servers(kind: str) -> Iterator[tuple[str, str, Path]]:
    """A private Redis and the emulator; yields (redis URL, emulator URL, secret file)."""
    with tempfile.TemporaryDirectory(prefix="mt-diagnose-") as tmp:
        workdir = Path(tmp)
        secret_file = workdir / "api-secret"
        secret_file.write_text(secrets.token_urlsafe(24))
        secret_file.chmod(0o600)
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("MERCHANT_")},
            "MERCHANT_API_KEY": API_KEY,
            "MERCHANT_API_SECRET_FILE": str(secret_file),
        }
        with (
            private_redis(workdir) as (redis_url, _),
            sandbox_process(workdir, env, kind) as (url, _),
        ):
            yield redis_url, url, secret_file


def new_client(redis_url: str, url: str, secret_file: Path) -> FleetClient:
    settings = Settings(
        api_key=API_KEY,
        secret=Secret(path=secret_file),
        base_url=url,
        fleet=FleetSettings(redis_url=redis_url, key_prefix=f"diagnose-{uuid.uuid4().hex[:8]}"),
    )
    return client_for(settings)


def hot_path(kind: str, rounds: int, calls: int) -> None:
    with servers(kind) as (redis_url, url, secret_file):
        client = new_client(redis_url, url, secret_file)
        token = client.manager.token().value
        headers = {"accept": "application/json", "authorization": f"Bearer {token}"}
        raw = requests.Session()
        raw.headers.update(headers)
        pooled = new_session()

        def raw_fixed_header() -> None:
            response = raw.get(url + PING, timeout=DEFAULT_TIMEOUTS, allow_redirects=False)
            response.raise_for_status()
            response.json()

        def raw_as_the_client_sends() -> None:
            response = pooled.request(
                "GET",
                url + PING,
                json=None,
                params=None,
                headers=dict(headers),
                timeout=DEFAULT_TIMEOUTS,
                allow_redirects=False,
            )
            response.raise_for_status()
            response.json()

        the_call = Call("GET", PING)

        def send_without_tenacity() -> None:
            client._send(client.manager.token(), the_call).json()

        def full_request() -> None:
            client.request("GET", PING)

        def token_only() -> None:
            client.manager.token()

        contenders: list[tuple[str, Callable[[], None]]] = [
            ("raw session, fixed bearer header", raw_fixed_header),
            ("raw, per-request headers as the client sends", raw_as_the_client_sends),
            ("client._send (no send loop)", send_without_tenacity),
            ("client.request", full_request),
            ("manager.token() alone", token_only),
        ]
        for _, call in contenders:
            for _ in range(100):
                call()
        wall: dict[str, list[float]] = {name: [] for name, _ in contenders}
        cpu: dict[str, list[float]] = {name: [] for name, _ in contenders}
        for i in range(rounds):
            for name, call in contenders if i % 2 == 0 else contenders[::-1]:
                cpu0, t0 = time.thread_time(), time.perf_counter()
                for _ in range(calls):
                    call()
                wall[name].append((time.perf_counter() - t0) / calls * 1e6)
                cpu[name].append((time.thread_time() - cpu0) / calls * 1e6)
        base_wall = median(wall[contenders[0][0]])
        base_cpu = median(cpu[contenders[0][0]])
        print(f"hot path, emulator served by {kind}: {rounds} rounds x {calls} calls, medians")
        print()
        print("| | wall us/call | vs raw | client CPU us/call | vs raw |")
        print("|---|---|---|---|---|")
        for name, _ in contenders:
            w, c = median(wall[name]), median(cpu[name])
            print(f"| {name} | {w:.1f} | {w - base_wall:+.1f} | {c:.1f} | {c - base_cpu:+.1f} |")


def storm(rounds: int) -> None:
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    with servers("werkzeug") as (redis_url, url, secret_file):
        control = SandboxControl(url)
        counted = redis.Redis.from_url(redis_url)
        print(
            "| round | phase | p50 ms | p99 ms | HTTP p50 / max ms | Redis p50 / max ms "
            "| waiter sleeps (n, total ms) | exchange ms | Redis commands | Redis connections |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for n in range(rounds):
            client = new_client(redis_url, url, secret_file)
            client.request("GET", PING)
            timers: dict[str, list[float]] = {"http": [], "redis": [], "sleep": [], "exchange": []}
            _instrument(client, timers)
            for phase in ("calm", "storm"):
                for values in timers.values():
                    values.clear()
                if phase == "storm":
                    control.revoke_all()
                pool = getattr(client.manager.store.redis, "connection_pool", None)
                commands = commands_processed(counted)
                latencies, _ = concurrent_calls([client], 64)
                commands = commands_processed(counted) - commands
                http, renew = timers["http"], timers["redis"]
                print(
                    f"| {n} | {phase} | {percentile(latencies, 0.5) * 1e3:.0f} "
                    f"| {percentile(latencies, 0.99) * 1e3:.0f} "
                    f"| {percentile(http, 0.5) * 1e3:.0f} / {max(http) * 1e3:.0f} "
                    f"| {_ms(renew, 0.5)} / {_ms(renew, 1.0)} "
                    f"| {len(timers['sleep'])}, {sum(timers['sleep']) * 1e3:.0f} "
                    f"| {', '.join(f'{x * 1e3:.0f}' for x in timers['exchange']) or '-'} "
                    f"| {commands} | {_connections(pool)} |"
                )
        counted.close()
        control.close()


def _connections(pool: Any) -> int:
    """Connections redis-py's pool has opened and kept (private attributes, diagnostics only)."""
    return len(getattr(pool, "_available_connections", [])) + len(
        getattr(pool, "_in_use_connections", [])
    )


def _ms(values: list[float], fraction: float) -> str:
    return f"{percentile(values, fraction) * 1e3:.0f}" if values else "-"


def _instrument(client: FleetClient, timers: dict[str, list[float]]) -> None:
    """Wrap the pieces of a call with timers (instance attributes only; nothing global)."""
    manager = client.manager
    client.session.request = timed(client.session.request, timers["http"])  # type: ignore[method-assign]
    manager.store.send = timed(manager.store.send, timers["redis"])  # type: ignore[method-assign]
    manager.exchange = timed(manager.exchange, timers["exchange"])
    sleep = manager.sleep

    def counted_sleep(seconds: float) -> None:
        timers["sleep"].append(seconds)
        sleep(seconds)

    manager.sleep = counted_sleep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    sub = parser.add_subparsers(dest="what", required=True)
    hot = sub.add_parser("hot-path")
    hot.add_argument("--server", choices=("tornado", "werkzeug"), default="tornado")
    hot.add_argument("--rounds", type=int, default=8)
    hot.add_argument("--calls", type=int, default=1000)
    st = sub.add_parser("storm")
    st.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.what == "hot-path":
        hot_path(args.server, args.rounds, args.calls)
    else:
        storm(args.rounds)


if __name__ == "__main__":
    main()
