"""The token store for asyncio callers: the same commands (``TokenCommands``), sent with
redis.asyncio, the same clock and the same wake-ups, heard by a task instead of a thread.

Nothing of the store's rules is here: the keys, the scripts, how replies read and errors
are typed are the blocking store's (``store.keys``, ``store.token_store``); this module
only awaits where that one blocks. An asyncio process and a blocking one on one account
share every record.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any, TypeVar

from merchant_tasks.store.keys import REDIS_ERRORS, AccountKeys, ClientReplies, Command
from merchant_tasks.store.token_store import AccountStore, RedisClock
from merchant_tasks.store.topology import AsyncStoreClient
from merchant_tasks.store.wakeup import (
    LISTEN_TICK,
    LISTENING_ERRORS,
    _Subscriber,
    subscriber_for,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


class AsyncAccountRedis(ClientReplies[AsyncStoreClient]):
    """One account's Redis commands sent with redis.asyncio (errors typed and corrupt values
    read as ``Replies`` says, as for the blocking store).

    The tasks that GET one key in the same turn of the event loop share one GET, sent on
    the next turn: a burst of a thousand awaits of the token costs one read, not a thousand
    reads over as many new connections (whose connects, on a starved loop, ran past their
    timeout). Each reply is still read after its caller asked, so a caller sees its own
    writes; every other command is sent as it comes.
    """

    def __init__(self, client: AsyncStoreClient, keys: AccountKeys) -> None:
        super().__init__(client, keys)
        self._gets: dict[Any, asyncio.Task[Any]] = {}  # the GET each key's askers share

    async def send(self, command: Command[T]) -> T:
        """Send ``command`` and read its reply (see ``Command``)."""
        try:
            if command.args[0] == "GET":
                raw = await asyncio.shield(self._shared_get(command.args[1]))
            else:
                raw = await self.client.execute_command(*command.args)
        except REDIS_ERRORS as exc:
            raw = self.refused(exc)
        return self.reply(command.key, raw, command.parse, command.absent)

    def _shared_get(self, key: Any) -> asyncio.Task[Any]:
        shared = self._gets.get(key)
        if shared is None or shared.get_loop() is not asyncio.get_running_loop():
            shared = self._gets[key] = asyncio.ensure_future(self._get(key))
            shared.add_done_callback(_seen)  # its askers may all have been cancelled
        return shared

    async def _get(self, key: Any) -> Any:
        # runs from the next turn on: whoever asks from then on shares the next GET
        if self._gets.get(key) is asyncio.current_task():
            del self._gets[key]
        return await self.client.execute_command("GET", key)


def _seen(task: asyncio.Task[Any]) -> None:
    """Take a shared command's outcome, so that one nobody awaited any more is not
    logged as an exception never retrieved (its askers' errors reach them whole)."""
    if not task.cancelled():
        task.exception()


class AsyncTokenStore(AccountStore[AsyncStoreClient, AsyncAccountRedis]):
    """One account's token and records for asyncio callers: ``ask`` builds the commands,
    ``send`` awaits them, ``now`` is the store's clock."""

    _timing: asyncio.Future[None] | None = None  # the TIME reading under way

    def sender(self, client: AsyncStoreClient, keys: AccountKeys) -> AsyncAccountRedis:
        return AsyncAccountRedis(client, keys)

    @functools.cached_property
    def clock(self) -> RedisClock:
        return RedisClock()

    @property
    def redis(self) -> AsyncStoreClient:
        return self.commands.client

    async def send(self, command: Command[T]) -> T:
        return await self.commands.send(command)

    async def now(self, mono: float) -> float:
        """Redis's time at ``mono`` (this process's monotonic clock): TIME read once a
        minute, the local clock in between (``RedisClock``); the tasks that find it due at
        once share one reading."""
        if self.clock.due(mono):
            if self._timing is None or self._timing.done():
                self._timing = asyncio.ensure_future(self._read_time(mono))
            try:
                await asyncio.shield(self._timing)
            except Exception:
                with contextlib.suppress(Exception):
                    return self.clock.at(mono)  # a reading from before: still good
                raise
        return self.clock.at(mono)

    async def _read_time(self, mono: float) -> None:
        remote = await self.send(self.ask.time())
        self.clock.read(remote, mono, self.clock.monotonic())


class AsyncRenewalSignal:
    """``store.wakeup.RenewalSignal`` for asyncio: the renewals of one account this process
    has heard of, and a wait for the next that does not block the event loop."""

    def __init__(self, store: AsyncTokenStore) -> None:
        self._redis = store.redis
        self.channel = store.keys.renewed
        self.heard = 0
        self.listening = False
        self._next = asyncio.Event()

    def start(self) -> None:
        """Have this process's subscriber task listen for the account."""
        if not self.listening:
            subscriber_for(self._redis, _listening_task).add(self)

    def stop(self) -> None:
        """This process no longer listens for the account: the subscriber task drops its
        channel within LISTEN_TICK, and ends when none is left."""
        subscriber_for(self._redis, _listening_task).discard(self)
        self._subscribed(False)

    async def wait(self, heard: int, timeout: float) -> bool:
        """Wait up to ``timeout`` s for an announcement after ``heard``; True if one came."""
        if self.heard > heard:
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._next.wait(), timeout)
        return self.heard > heard

    def _heard(self) -> None:
        self.heard += 1
        self._next.set()
        self._next = asyncio.Event()

    def _subscribed(self, listening: bool) -> None:
        self.listening = listening
        self._next.set()  # waiters look at the store rather than trust a dead line
        self._next = asyncio.Event()


def _listening_task(subscriber: _Subscriber) -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_task(_listen(subscriber))


async def _listen(subscriber: _Subscriber) -> None:
    """The subscriber task: takes up new channels each tick, ends when none is wanted."""
    pubsub: Any = None
    try:
        pubsub = subscriber.client.pubsub()
        current: set[str] = set()
        while wanted := subscriber.wanted():
            if added := wanted - current:
                await pubsub.subscribe(*added)
            if dropped := current - wanted:
                await pubsub.unsubscribe(*dropped)
            current = wanted
            message = await pubsub.get_message(timeout=LISTEN_TICK)
            if message is not None:
                subscriber.deliver(message)
    except LISTENING_ERRORS as exc:
        # unwanted, the pool was closed under it (a client's aclose): nothing to say
        subscriber.stopped(exc if subscriber.wanted() else None)
    finally:
        if pubsub is not None:
            with contextlib.suppress(*REDIS_ERRORS, OSError):
                await pubsub.aclose()
