"""merchant_tasks.store.async_store (on fakeredis): the tasks that GET one key in one turn
of the event loop share one GET; a GET asked later is sent after it was asked; a caller
cancelled or a Redis error leaves the others their own outcome."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from typing import Any

import fakeredis
import pytest
import redis

from merchant_tasks.exceptions import StoreUnavailable
from merchant_tasks.store.async_store import AsyncAccountRedis
from merchant_tasks.store.keys import AccountKeys, Command
from support.account import UNIT_NAMESPACE


class CountingRedis(fakeredis.FakeAsyncRedis):
    """fakeredis for asyncio, counting the commands it is sent; ``hold`` keeps each GET
    waiting until it is set."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(server=fakeredis.FakeServer(), **kwargs)
        self.sent: Counter[str] = Counter()
        self.hold: asyncio.Event | None = None
        self.fail_with: Exception | None = None

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        self.sent[str(args[0])] += 1
        if args[0] == "GET" and self.hold is not None:
            await self.hold.wait()
        if args[0] == "GET" and self.fail_with is not None:
            raise self.fail_with
        return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]


KEYS = AccountKeys.of(UNIT_NAMESPACE)


def get(key: str) -> Command[bytes | None]:
    return Command.get(key, lambda raw: raw, None)


async def held_get(
    client: CountingRedis, sender: AsyncAccountRedis, callers: int
) -> tuple[asyncio.Event, list[asyncio.Task[bytes | None]]]:
    """``callers`` tasks asking for the token in one turn, their shared GET sent to Redis
    and held there until the event returned is set."""
    hold = client.hold = asyncio.Event()
    asking = [asyncio.create_task(sender.send(get(KEYS.token))) for _ in range(callers)]
    while client.sent["GET"] == 0:
        await asyncio.sleep(0)
    client.hold = None  # the GETs sent from now on are not held
    return hold, asking


def test_the_tasks_asking_in_one_turn_share_one_get() -> None:
    async def scenario() -> tuple[list[bytes | None], Counter[str]]:
        client = CountingRedis()
        await client.set(KEYS.token, b"v1")
        sender = AsyncAccountRedis(client, KEYS)
        replies = await asyncio.gather(*(sender.send(get(KEYS.token)) for _ in range(500)))
        return replies, client.sent

    replies, sent = asyncio.run(scenario())
    assert replies == [b"v1"] * 500
    assert sent["GET"] == 1


def test_other_keys_and_other_commands_are_sent_as_they_come() -> None:
    async def scenario() -> tuple[Any, Counter[str]]:
        client = CountingRedis()
        await client.set(KEYS.token, b"t")
        await client.set(KEYS.generation, b"7")
        sender = AsyncAccountRedis(client, KEYS)
        replies = await asyncio.gather(
            sender.send(get(KEYS.token)),
            sender.send(get(KEYS.generation)),
            sender.send(Command(("INCR", KEYS.counters), int, KEYS.counters, 0)),
            sender.send(Command(("INCR", KEYS.counters), int, KEYS.counters, 0)),
        )
        return replies, client.sent

    replies, sent = asyncio.run(scenario())
    assert list(replies) == [b"t", b"7", 1, 2]
    assert (sent["GET"], sent["INCR"]) == (2, 2)


def test_a_get_asked_once_the_shared_one_is_sent_reads_after_it_was_asked() -> None:
    """A caller that wrote and then reads sees its write: its GET is never one sent before
    it asked."""

    async def scenario() -> tuple[bytes | None, bytes | None, Counter[str]]:
        client = CountingRedis()
        await client.set(KEYS.token, b"old")
        sender = AsyncAccountRedis(client, KEYS)
        async with asyncio.timeout(10):
            hold, [first] = await held_get(client, sender, 1)
            await client.set(KEYS.token, b"new")  # written after that GET was sent
            second = await sender.send(get(KEYS.token))
            hold.set()
            return await first, second, client.sent

    first, second, sent = asyncio.run(scenario())
    assert second == b"new"
    assert first in (b"old", b"new")
    assert sent["GET"] == 2


def test_a_cancelled_caller_leaves_the_others_their_reply() -> None:
    async def scenario() -> tuple[list[Any], bool]:
        client = CountingRedis()
        await client.set(KEYS.token, b"v")
        sender = AsyncAccountRedis(client, KEYS)
        async with asyncio.timeout(10):
            hold, callers = await held_get(client, sender, 3)
            callers[0].cancel()
            hold.set()
            outcomes = await asyncio.gather(*callers, return_exceptions=True)
        return outcomes, callers[0].cancelled()

    outcomes, cancelled = asyncio.run(scenario())
    assert cancelled
    assert outcomes[1:] == [b"v", b"v"]


def test_a_refused_shared_get_is_each_callers_typed_error() -> None:
    import redis

    async def scenario() -> list[Any]:
        client = CountingRedis()
        client.fail_with = redis.ConnectionError("Connection refused")
        sender = AsyncAccountRedis(client, KEYS)
        return await asyncio.gather(
            *(sender.send(get(KEYS.token)) for _ in range(3)), return_exceptions=True
        )

    outcomes = asyncio.run(scenario())
    assert all(isinstance(outcome, StoreUnavailable) for outcome in outcomes), outcomes


def test_a_shared_get_whose_askers_were_all_cancelled_logs_nothing_when_it_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import gc

    import redis

    async def scenario() -> None:
        client = CountingRedis()
        sender = AsyncAccountRedis(client, KEYS)
        async with asyncio.timeout(10):
            hold, callers = await held_get(client, sender, 2)
            for caller in callers:
                caller.cancel()
            await asyncio.gather(*callers, return_exceptions=True)
            client.fail_with = redis.ConnectionError("Connection refused")
            hold.set()
            for _ in range(5):  # the shared GET ends, failing, with nobody awaiting it
                await asyncio.sleep(0)

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(scenario())
        gc.collect()
    assert "never retrieved" not in caplog.text


def test_a_redis_that_never_answers_is_waited_for_once_on_one_connection() -> None:
    """The stale-connection retry (``store.topology``) sends a command again after a
    ConnectionError only: a command that timed out may have run, and a Redis that hangs
    would be waited for twice, on a second connection."""
    import socket
    import threading

    from merchant_tasks.store.topology import async_redis_from_url

    accepted: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:  # takes connections, answers none

        def accept() -> None:
            with contextlib.suppress(OSError):
                while True:
                    accepted.append(listener.accept()[0])

        threading.Thread(target=accept, daemon=True).start()
        port = listener.getsockname()[1]
        url = f"redis://127.0.0.1:{port}/0?socket_timeout=0.3&protocol=2"

        async def scenario() -> BaseException | None:
            client = async_redis_from_url(url)
            try:
                await client.get("k")
            except redis.RedisError as exc:
                return exc
            finally:
                await client.aclose()
            return None

        outcome = asyncio.run(scenario())
    for connection in accepted:
        connection.close()
    assert isinstance(outcome, redis.TimeoutError), outcome
    assert len(accepted) == 1
