"""Flows: decisions written once, as generators that yield the next step and do no I/O.

A flow (``renewal.life``'s token life, ``api.calls``' send loop) yields a step as a value
and is sent back what carrying it out gave, or has its error thrown in: the pattern of
httpx's ``Auth.auth_flow``, which ``Client`` and ``AsyncClient`` both drive. A driver is a
loop of ``advance`` and its own way of doing each step: blocking (redis-py, requests,
threads) or asyncio (redis.asyncio, httpx, tasks). The steps every flow may yield are here;
a flow's own steps are its module's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

if TYPE_CHECKING:
    from tenacity import Retrying

    from merchant_tasks.store.keys import Command

T = TypeVar("T")

Flow = Generator[Any, Any, T]


@dataclass(frozen=True)
class Redis(Generic[T]):
    """Send ``command`` (``store.keys.Command``) to the account's Redis: its reply as the
    command reads it (``StoreUnavailable`` thrown in on any Redis error)."""

    command: Command[T]


@dataclass(frozen=True)
class Sleep:
    seconds: float


class Clock:
    """Now, as a ``Moment``."""


@dataclass(frozen=True)
class Moment:
    now: float  # the store's clock (Redis TIME, estimated between reads): the fleet's
    mono: float  # this process's monotonic clock


CLOCK = Clock()


@dataclass(frozen=True)
class Done(Generic[T]):
    """A flow's end: what it returned."""

    value: T


def advance(flow: Flow[T], reply: Any, error: BaseException | None) -> Any:
    """Move ``flow`` on with what its last step gave (``reply``) or raised (``error``,
    thrown in): its next step, or ``Done``. A driver's loop is this and its steps."""
    try:
        return flow.throw(error) if error is not None else flow.send(reply)
    except StopIteration as stop:
        return Done(stop.value)


def next_try(
    policy: Retrying, attempt: int, started: float, now: float, exc: BaseException
) -> float | None:
    """Seconds to wait before attempt ``attempt`` + 1 under ``policy`` (a tenacity
    ``Retrying`` built from its pieces: retry, wait, stop), after ``exc`` at ``now`` in a
    run begun at ``started`` (monotonic times, the driver's); None: stop. Tenacity decides,
    the flow's driver sleeps."""
    from tenacity import Future, RetryCallState  # only where a retry is decided: reading
    # the store (`status`) imports flows too, and loads no retry library

    state = RetryCallState(policy, None, (), {})
    state.start_time, state.attempt_number = started, attempt
    outcome = Future(attempt)
    outcome.set_exception(exc)
    state.outcome, state.outcome_timestamp = outcome, now
    if not policy.retry(state):
        return None
    state.upcoming_sleep = policy.wait(state)
    return None if policy.stop(state) else state.upcoming_sleep


def drive(flow: Flow[T], perform: Callable[[Any], Any]) -> T:
    """Run ``flow`` to its end, each step carried out by ``perform`` (blocking); whatever a
    step raises is thrown into the flow, which decides (and cleans up)."""
    done = run_until(flow, None, None, perform, ())
    return cast(T, done.value)


def run_until(
    flow: Flow[Any],
    reply: Any,
    error: BaseException | None,
    perform: Callable[[Any], Any],
    stop: type | tuple[type, ...],
) -> Any:
    """Move ``flow`` on from ``reply`` (or ``error``), carrying out its steps with
    ``perform``, until it yields a step of type ``stop`` (returned, not carried out: the
    caller does it, as an HTTP client's auth hook sends a request) or ends (``Done``)."""
    ends = (Done, *(stop if isinstance(stop, tuple) else (stop,)))
    step = advance(flow, reply, error)
    while not isinstance(step, ends):
        try:
            reply, error = perform(step), None
        except BaseException as exc:  # back into the flow
            reply, error = None, exc
        step = advance(flow, reply, error)
    return step


async def drive_async(flow: Flow[T], perform: Callable[[Any], Awaitable[Any]]) -> T:
    """``drive``, each step awaited."""
    done = await run_until_async(flow, None, None, perform, ())
    return cast(T, done.value)


async def run_until_async(
    flow: Flow[Any],
    reply: Any,
    error: BaseException | None,
    perform: Callable[[Any], Awaitable[Any]],
    stop: type | tuple[type, ...],
) -> Any:
    """``run_until``, each step awaited (cancellation too goes into the flow, which releases
    what it holds before it ends)."""
    step = advance(flow, reply, error)
    while not isinstance(step, (Done, *(stop if isinstance(stop, tuple) else (stop,)))):
        error = None
        try:
            reply = await perform(step)
        except BaseException as exc:
            reply, error = None, exc
        step = advance(flow, reply, error)
    return step
