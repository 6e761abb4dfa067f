"""merchant_tasks.tasks: ``call_api`` is typed, sends the registered Celery task, and has an
awaitable send that leaves the event loop serving."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import merchant_tasks
from merchant_tasks.exceptions import BrokerUnavailable
from merchant_tasks.sandbox.processes import free_port
from merchant_tasks.tasks import call_api
from merchant_tasks.worker import install as install_module
from merchant_tasks.worker.task_bodies import CALL_API
from support.typecheck import mypy_strict

TICK = 0.01  # seconds between two ticks of the event loop's other task

MISSPELT = """\
from merchant_tasks.tasks import call_api


async def charge() -> None:
    call_api.delay("POST", "/open-api/v1/payments", json={"amount": 7}, idempotency_kee="o-1")
    await call_api.delay_async("GET", "/open-api/v1/ping", acount="eu-shop")
"""


@pytest.fixture
def shop_app(monkeypatch: pytest.MonkeyPatch) -> Iterator[Celery]:
    """A shop's app install() ran on, whose broker nobody listens on; forgotten after."""
    monkeypatch.setattr(install_module, "_shop_app", None)
    url = f"redis://127.0.0.1:{free_port()}/0"
    app = Celery("shop", broker=url, backend=url, set_as_current=False)
    merchant_tasks.install(app)
    yield app
    app.close()


def test_a_misspelt_argument_of_call_api_fails_the_users_mypy(tmp_path: Path) -> None:
    (tmp_path / "shop.py").write_text(MISSPELT, encoding="utf-8")
    done = mypy_strict(tmp_path / "shop.py")
    assert 'Unexpected keyword argument "idempotency_kee" for "delay"' in done.stdout, done.stdout
    assert 'Unexpected keyword argument "acount"' in done.stdout, done.stdout
    assert "Found 2 errors" in done.stdout, done.stdout


def test_call_api_is_still_the_registered_celery_task_for_everything_else(
    shop_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = shop_app.tasks[CALL_API]
    assert call_api.app is shop_app
    assert call_api.name == task.name == CALL_API
    signature = call_api.s("GET", "/open-api/v1/ping", idempotency_key="o-1")
    assert (signature.task, signature.kwargs) == (CALL_API, {"idempotency_key": "o-1"})
    monkeypatch.setattr(task, "run", lambda *args, **kwargs: [args, kwargs])
    monkeypatch.setattr(shop_app.conf, "task_always_eager", True)
    paid = "/open-api/v1/payments"
    sent = call_api.delay("POST", paid, json={"amount": 7}, account="eu-shop").get()
    assert sent == [("POST", paid), {"json": {"amount": 7}, "account": "eu-shop"}]  # no Nones
    assert call_api("GET", "/p") == [("GET", "/p"), {}]  # the body, in this process


def test_delay_async_raises_what_delay_raises_and_the_event_loop_serves_meanwhile(
    shop_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MERCHANT_ENQUEUE_TIMEOUT", "1")
    ticks: list[float] = []

    async def tick() -> None:
        while True:
            await asyncio.sleep(TICK)
            ticks.append(asyncio.get_running_loop().time())

    async def enqueue() -> Any:
        ticker = asyncio.create_task(tick())
        started = asyncio.get_running_loop().time()
        try:
            return await call_api.delay_async("GET", "/open-api/v1/ping")
        finally:
            ticker.cancel()
            print(f"{len(ticks)} ticks in {ticks[-1] - started:.3f} s of waiting")

    with pytest.raises(BrokerUnavailable):
        asyncio.run(enqueue())
    assert len(ticks) > 10  # the loop was never held for the whole wait


def test_async_sends_waiting_for_a_thread_count_it_against_the_bound_and_leave_the_loops_executor(
    shop_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More async sends than enqueue threads, the broker away (each send returns a while
    after its bound, as kombu notices a passed deadline between reads): the sends that
    waited for a thread find their bound spent and raise BrokerUnavailable at once, never
    reaching the broker, so each ends by its own deadline, not after the sends before it;
    the loop's default executor serves meanwhile."""
    import time as clock
    from concurrent.futures import ThreadPoolExecutor

    from merchant_tasks import tasks

    bound, overrun = 0.5, 0.25
    monkeypatch.setenv("MERCHANT_ENQUEUE_TIMEOUT", str(bound))
    monkeypatch.setattr(tasks, "_threads", [ThreadPoolExecutor(2)])
    given: list[float] = []  # the bound each send that reached the broker was given

    def broker_away(task: Any, args: Any, kwargs: Any, options: Any, timeout: float) -> Any:
        given.append(timeout)
        clock.sleep(timeout + overrun)
        raise BrokerUnavailable(f"the broker did not take it within {timeout:g} s")

    monkeypatch.setattr(tasks, "send", broker_away)

    async def scenario() -> tuple[list[float], list[str], float]:
        async def one() -> tuple[float, str]:
            try:
                await call_api.delay_async("GET", "/open-api/v1/ping")
            except BrokerUnavailable as exc:
                return clock.monotonic(), str(exc)
            return clock.monotonic(), "sent"

        sends = [asyncio.create_task(one()) for _ in range(6)]
        await asyncio.sleep(0)
        answered = await asyncio.to_thread(clock.monotonic)  # the loop's own executor
        done = await asyncio.gather(*sends)
        return [t for t, _ in done], [m for _, m in done], answered

    finished, messages, answered = asyncio.run(scenario())
    assert len(given) == 2, given
    assert all(0 < timeout <= bound for timeout in given), given
    assert [m.startswith("the broker did not take it") for m in messages] == [True] * 2 + [
        False
    ] * 4, messages
    assert all("no enqueue thread came free within 0.5 s" in m for m in messages[2:]), messages
    assert answered < min(finished)  # the default executor did not wait behind the sends


def test_an_async_send_that_waited_for_a_thread_is_given_what_is_left_of_its_bound(
    shop_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one enqueue thread stays busy until ``busy`` seconds after the send was queued
    behind it: the send reaches the broker with at most ``bound - busy`` seconds (it waited
    at least ``busy``), never with a fresh bound."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from merchant_tasks import tasks

    bound, busy = 2.0, 0.5
    monkeypatch.setenv("MERCHANT_ENQUEUE_TIMEOUT", str(bound))
    threads = ThreadPoolExecutor(1)
    monkeypatch.setattr(tasks, "_threads", [threads])
    given: list[float] = []

    def broker_takes_it(task: Any, args: Any, kwargs: Any, options: Any, timeout: float) -> str:
        given.append(timeout)
        return "sent"

    monkeypatch.setattr(tasks, "send", broker_takes_it)
    release = threading.Event()
    threads.submit(release.wait, 30)

    async def queued_behind_it() -> Any:
        send = asyncio.ensure_future(call_api.delay_async("GET", "/open-api/v1/ping"))
        await asyncio.sleep(0)  # its first step: it takes the time and asks for a thread
        await asyncio.sleep(busy)
        release.set()
        return await send

    assert asyncio.run(queued_behind_it()) == "sent"
    assert len(given) == 1, given
    assert 0 < given[0] <= bound - busy, given


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("POST", "/open-api/v1/../../admin"), {}),
        (("GET", "/open-api/v1/ping"), {"headers": {"Authorization": "Bearer sk-live-77ab"}}),
        ((), {"method": "GET", "path": "/admin", "headers": None}),
    ],
)
def test_a_call_the_worker_would_refuse_is_refused_before_it_reaches_the_broker(
    shop_app: Celery, monkeypatch: pytest.MonkeyPatch, args: Any, kwargs: Any
) -> None:
    """A path off the API or a credential header would sit in the broker, Flower and the
    results (a caller's credential among them) and fail only in the worker."""
    from merchant_tasks import tasks

    sent: list[Any] = []
    monkeypatch.setattr(tasks, "send", lambda *given: sent.append(given))
    with pytest.raises(ValueError, match=r"path must be under|credentials") as refused:
        call_api.apply_async(args, kwargs)
    assert "sk-live-77ab" not in str(refused.value)
    assert not sent


def test_delay_async_reads_the_fleets_variables_off_the_event_loop(
    shop_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its bound is read from MERCHANT_ENQUEUE_TIMEOUT or the file that names it: on the
    send's thread, never on the loop's."""
    import threading

    from merchant_tasks import tasks
    from merchant_tasks.settings import FleetSettings

    read_on: list[int] = []
    from_env = FleetSettings.from_env

    def recorded() -> FleetSettings:
        read_on.append(threading.get_ident())
        return from_env()

    monkeypatch.setattr(FleetSettings, "from_env", staticmethod(recorded))
    monkeypatch.setattr(tasks, "send", lambda *given: "sent")

    async def send() -> tuple[Any, int]:
        return await call_api.delay_async("GET", "/open-api/v1/ping"), threading.get_ident()

    outcome, loop_thread = asyncio.run(send())
    assert outcome == "sent"
    assert read_on
    assert loop_thread not in read_on
