"""A clock and a sleep that the test moves by hand: no unit test waits for time to pass."""

from __future__ import annotations

import time
from collections.abc import Callable


class ManualClock:
    """The store's clock as the manager sees it; starts at real time, which Redis TIME follows."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


class Sleeper:
    """Records every wait instead of sleeping; ``on_sleep`` lets a test act meanwhile."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.waits: list[float] = []
        self.advance_clock = False
        self.on_sleep: Callable[[int], None] | None = None

    def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        if self.advance_clock:
            self.clock.now += seconds
        if self.on_sleep is not None:
            self.on_sleep(len(self.waits))
