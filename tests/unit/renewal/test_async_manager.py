"""renewal/async_manager.py: the asyncio driver's own mechanics (the model's rules are
test_life*.py's): tasks that waited for one renewal go on in turns of the event loop."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import fakeredis

from merchant_tasks.renewal.async_manager import RESUMED_PER_TURN, AsyncTokenManager, _Turns
from merchant_tasks.renewal.life import Hold, Limits, Unhold
from merchant_tasks.store import scripts
from merchant_tasks.store.async_store import AsyncTokenStore
from merchant_tasks.store.keys import Command
from merchant_tasks.token import IssuedToken


def test_waiters_go_on_in_turns_so_the_loop_runs_between_them() -> None:
    """40 tasks woken by one landing: RESUMED_PER_TURN go on in the loop's pass they wake
    in, the next ones a pass later, and so on; a task counting passes runs between."""

    async def scenario() -> Counter[int]:
        passes = 0
        done = asyncio.Event()

        async def counting() -> None:
            nonlocal passes
            while not done.is_set():
                await asyncio.sleep(0)
                passes += 1

        turns = _Turns()
        landing: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        went_on: Counter[int] = Counter()

        async def waiter() -> None:
            await landing
            await turns.take()
            went_on[passes] += 1

        counter = asyncio.create_task(counting())
        waiters = [asyncio.create_task(waiter()) for _ in range(40)]
        await asyncio.sleep(0)
        landing.set_result(None)
        await asyncio.gather(*waiters)
        done.set()
        await counter
        return went_on

    went_on = asyncio.run(scenario())
    assert sorted(went_on.values(), reverse=True)[:2] == [RESUMED_PER_TURN] * 2
    assert sum(went_on.values()) == 40
    assert len(went_on) == 3  # 16, 16 and 8, each in its own pass of the loop


def test_aclose_waits_for_a_heartbeat_let_go_in_the_middle_of_a_command() -> None:
    """``TokenManager.close``'s rule, in the asyncio driver: a renewal just done with the
    lock (``Unhold``) while its heartbeat is in the middle of extending the lease, then
    ``aclose()``. The heartbeat task has ended when ``aclose()`` returns, its command
    cancelled, so that closing the Redis pool next pulls no connection from under it."""

    async def scenario() -> tuple[asyncio.Task[None], bool]:
        redis_client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
        store = AsyncTokenStore(redis_client, "test:async-heartbeat")
        limits = Limits(renewal=60.0, wait=120.0, lease=0.4, heartbeat=0.1)

        async def no_exchange() -> IssuedToken:
            raise AssertionError("no exchange in this test")

        async def credentials() -> str:
            return "fp"

        manager = AsyncTokenManager(
            store,
            no_exchange,
            credentials,
            renew_before=480.0,
            renew_mandatory=120.0,
            exchange_timeout=0.1,
            wake_ups=False,
            limits=limits,
        )
        sending, cancelled = asyncio.Event(), False
        send = store.send

        async def sending_slowly(command: Command[Any]) -> Any:
            nonlocal cancelled
            if command.args[:2] != ("EVAL", scripts.EXTEND_LOCK):
                return await send(command)
            sending.set()
            try:
                await asyncio.Event().wait()  # a Redis that does not answer
            except asyncio.CancelledError:
                cancelled = True
                raise

        store.send = sending_slowly  # type: ignore[method-assign]
        await manager.perform(Hold("holding"))
        [beat] = manager._beating.values()
        await asyncio.wait_for(sending.wait(), 5.0)  # the heartbeat is in the middle of it
        await manager.perform(Unhold("holding"))
        await manager.aclose()
        ended = beat.done()
        await redis_client.aclose()
        return beat, ended and cancelled

    beat, ended = asyncio.run(scenario())
    assert ended
    assert beat.cancelled()
