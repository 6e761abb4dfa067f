"""The asyncio driver of the token's life: ``AsyncTokenManager`` runs ``renewal.life``'s
flows with redis.asyncio (``store.async_store``), an async token exchange
(``api.async_client``), tasks and ``asyncio.sleep``, in one event loop, never blocking it.

It decides nothing: every step is a flow's, the same flows the blocking driver
(``renewal.manager``) runs, so an asyncio process and a blocking one on one account share
the token, its records, the lock, the pauses and the exchange rate. What is here is how a
step is awaited: a command, an exchange, a sleep, an announcement heard by this process's
subscriber task, this process's renewal led by one task while the others await its future
(``Fly``), a lock holding kept alive by a heartbeat task.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from merchant_tasks.flows import Clock, Flow, Moment, Redis, Sleep, drive_async
from merchant_tasks.renewal import life
from merchant_tasks.renewal.manager import process_owner
from merchant_tasks.store.async_store import AsyncRenewalSignal, AsyncTokenStore
from merchant_tasks.store.exchange_rate import ExchangeRate
from merchant_tasks.token import IssuedToken, RenewalPolicy, Token

T = TypeVar("T")


RESUMED_PER_TURN = 16  # tasks that go on per turn of the event loop once what they waited
# for is in: 200 waiters going on in one turn each send their request in it, and held the
# loop ~290 ms (bench scenario 9); in turns of 16, a turn holds it a few ms


class _Turns:
    """Tasks that waited for one thing go on in turns of RESUMED_PER_TURN, each turn in its
    own pass of the event loop, so other tasks (and timers) run between them."""

    def __init__(self) -> None:
        self._taken = itertools.count()

    async def take(self) -> None:
        for _ in range(next(self._taken) // RESUMED_PER_TURN):
            await asyncio.sleep(0)


class _Flight:
    """A task's place in this process's renewal of an account (``life.Fly``): the leader's
    future is every joiner's, and so are its turns."""

    def __init__(
        self, replacing: int, leader: bool, landing: asyncio.Future[Any], turns: _Turns
    ) -> None:
        self.replacing = replacing
        self.leader = leader
        self.landing = landing
        self.turns = turns


class AsyncTokenManager:
    """Gives out the account's token to asyncio callers and renews it, once for the fleet."""

    def __init__(
        self,
        store: AsyncTokenStore,
        exchange: Callable[[], Awaitable[IssuedToken]],
        credentials: Callable[[], Awaitable[str]],
        *,
        renew_before: float,
        renew_mandatory: float,
        exchange_timeout: float,
        rate: ExchangeRate | None = None,
        endpoint: str = "",
        rng: random.Random | None = None,
        local_copy_ttl: float = life.LOCAL_COPY_TTL,
        wake_ups: bool = True,
        limits: life.Limits | None = None,
    ) -> None:
        self.store = store
        self.exchange = exchange
        self.credentials = credentials  # the fingerprint of the credentials in use
        self.signal = AsyncRenewalSignal(store) if wake_ups else None
        self.life = life.TokenLife(
            store.ask,
            RenewalPolicy(renew_before, renew_mandatory),
            limits or life.Limits.for_exchange(exchange_timeout),
            rate=rate,
            endpoint=endpoint,
            rng=rng,
            copy_ttl=local_copy_ttl,
        )
        self.life.after_fork(process_owner(), f"{process_owner()}:{uuid.uuid4().hex[:6]}:")
        self._pid = os.getpid()
        self._beating: dict[str, asyncio.Task[None]] = {}
        self._steps: dict[type, Callable[[Any], Awaitable[Any]]] = {
            Redis: lambda step: self.store.send(step.command),
            Clock: lambda _: self.moment(),
            Sleep: lambda step: asyncio.sleep(step.seconds),
            life.Exchange: lambda _: self.exchange(),
            life.Credentials: lambda _: self.credentials(),
            life.Heard: self._heard,
            life.Listen: self._listen,
            life.Fly: self._fly,
            life.Await: self._await,
            life.Land: self._land,
            life.Hold: self._hold,
            life.Unhold: self._unhold,
        }

    def __repr__(self) -> str:
        return f"AsyncTokenManager(store={self.store!r})"

    # -- callers -------------------------------------------------------------------------

    async def token(self, path: str = "") -> Token:
        """A token to call the API with (``TokenManager.token``, awaited): the flows the
        client's requests run, so a caller of this and a request wait and read alike."""
        token = self.life.ready(await self.moment())
        if token is not None and not token.routes:
            return token
        return await self.run(self.life.token_for(path) if path else self.life.token())

    async def refused(self, token: Token, path: str = "") -> Token:
        """A request on ``path`` with ``token`` got 401: its replacement, or why not."""
        return await self.run(self.life.refused(token, path))

    async def aclose(self) -> None:
        """Stop what this manager runs beside its callers (it hears no more announcements,
        its heartbeats end) and close the exchange's client."""
        if self.signal is not None:
            self.signal.stop()
        beating = list(self._beating.values())
        self._beating.clear()
        for task in beating:
            task.cancel()
        await asyncio.gather(*beating, return_exceptions=True)  # ended, not just told to
        close = getattr(self.exchange, "aclose", None)
        if close is not None:
            await close()

    async def moment(self) -> Moment:
        mono = time.monotonic()
        return Moment(await self.store.now(mono), mono)

    # -- the driver ----------------------------------------------------------------------

    async def run(self, flow: Flow[T]) -> T:
        """Carry out ``flow``'s steps, awaited, until it returns (or raises)."""
        if self._pid != os.getpid():  # a forked child: its own owner, no flight
            self._pid = os.getpid()
            self.life.after_fork(process_owner(), f"{process_owner()}:{uuid.uuid4().hex[:6]}:")
        return await drive_async(flow, self.perform)

    async def perform(self, step: Any) -> Any:
        """Await one step of a flow of the token's life (or the send loop's Redis, sleep
        and clock steps)."""
        return await self._steps[type(step)](step)

    async def _heard(self, _: life.Heard) -> int:
        if self.signal is None:
            return 0
        self.signal.start()
        return self.signal.heard

    async def _listen(self, step: life.Listen) -> None:
        if self.signal is not None and self.signal.listening:
            await self.signal.wait(step.heard, life.POLL_MAX)
        else:
            await asyncio.sleep(step.poll)

    async def _fly(self, step: life.Fly) -> _Flight:
        flight = self.life.flight
        if isinstance(flight, _Flight) and not flight.landing.done():
            return _Flight(flight.replacing, False, flight.landing, flight.turns)
        landing = asyncio.get_running_loop().create_future()
        seat = _Flight(step.replacing, True, landing, _Turns())
        self.life.flight = seat
        return seat

    async def _await(self, step: life.Await) -> Any:
        assert isinstance(step.flight, _Flight)
        try:
            landed = await asyncio.wait_for(asyncio.shield(step.flight.landing), step.timeout)
        except TimeoutError:
            return life.TIMED_OUT
        await step.flight.turns.take()
        return landed

    async def _land(self, step: life.Land) -> None:
        assert isinstance(step.flight, _Flight)
        if self.life.flight is step.flight:
            self.life.flight = None
        if not step.flight.landing.done():
            step.flight.landing.set_result(step.outcome)

    async def _hold(self, step: life.Hold) -> None:
        """Keep the holding alive beside the renewal: a task runs the heartbeat flow."""
        heartbeat = drive_async(self.life.heartbeat(step.value), self.perform)
        self._beating[step.value] = asyncio.get_running_loop().create_task(heartbeat)

    async def _unhold(self, step: life.Unhold) -> None:
        """End the holding's heartbeat: cancelled, and awaited until it has ended (in the
        middle of a command it would still be running when ``aclose`` closes the pool)."""
        task = self._beating.pop(step.value, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
