"""renewal/async_manager.py: the asyncio driver's own mechanics (the model's rules are
test_life*.py's): tasks that waited for one renewal go on in turns of the event loop."""

from __future__ import annotations

import asyncio
from collections import Counter

from merchant_tasks.renewal.async_manager import RESUMED_PER_TURN, _Turns


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
