"""install(app): any Celery app runs merchant-tasks, and keeps every setting of its own."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from celery import Celery
from celery._state import get_current_app
from kombu import Exchange, Queue

import merchant_tasks
from merchant_tasks import ConfigurationError, tasks
from merchant_tasks.worker import install as install_module
from merchant_tasks.worker.app import app as package_app
from merchant_tasks.worker.install import (
    BEAT_ENTRY,
    DELIVERY_GUARANTEES,
    RENEWAL_TASKS,
    _prepare_worker,
    broken_guarantees,
    shared_bindings,
)
from merchant_tasks.worker.routing import CALLS_QUEUE, RENEWAL_QUEUE

TASK_NAMES = {f"merchant_tasks.{name}" for name in ("call_api", "renew_token", "renew_account")}
REDIS = "redis://127.0.0.1:6379/0"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [
        "MERCHANT_RENEW_INTERVAL",
        "MERCHANT_REDIS_URL",
        "MERCHANT_REDIS_URL_FILE",
        "CELERY_BROKER_URL",
    ]:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def own_app(monkeypatch: pytest.MonkeyPatch) -> Iterator[Celery]:
    """A shop's app, not made current; once the test ends, other tests' call_api resolves
    as before (install() remembers the last shop app it ran on: forgotten after the test)."""
    monkeypatch.setattr(install_module, "_shop_app", None)
    app = Celery("proj", set_as_current=False)
    yield app
    app.close()


def routing_of(app: Celery, name: str) -> dict[str, Any]:
    """Where a message of task ``name`` goes: queue, exchange and routing key."""
    route = app.amqp.router.route({}, name)
    queue: Queue = route["queue"]
    return {"queue": queue.name, "exchange": queue.exchange.name, "key": queue.routing_key}


def test_the_tasks_get_their_names_and_delivery_guarantees_whatever_the_apps_defaults(
    own_app: Celery,
) -> None:
    own_app.conf.update(task_acks_late=False, task_reject_on_worker_lost=False)
    merchant_tasks.install(own_app)
    assert set(own_app.tasks) >= TASK_NAMES
    for name in TASK_NAMES:
        for option, value in DELIVERY_GUARANTEES.items():
            assert getattr(own_app.tasks[name], option) is value, (name, option)
    assert own_app.tasks["merchant_tasks.call_api"].app is own_app


def test_only_the_installed_app_gets_the_tasks(own_app: Celery) -> None:
    merchant_tasks.install(own_app)
    other = Celery("other", set_as_current=False)
    assert not TASK_NAMES & set(other.tasks)


def test_renewal_queue_route_and_beat_entry_are_added_beside_the_users_own(
    own_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MERCHANT_RENEW_INTERVAL", "7.5")
    mine = {"nightly-report": {"task": "proj.report", "schedule": 86400.0}}
    own_app.conf.update(
        task_queues=(Queue("orders", Exchange("orders"), routing_key="orders"),),
        task_default_queue="orders",
        task_routes={"proj.*": {"queue": "orders"}},
        beat_schedule=mine,
        worker_prefetch_multiplier=4,
        task_serializer="pickle",
    )
    merchant_tasks.install(own_app)
    conf = own_app.conf
    assert [q.name for q in conf.task_queues] == ["orders", RENEWAL_QUEUE]
    for name in RENEWAL_TASKS:
        where = routing_of(own_app, name)
        assert where == {"queue": RENEWAL_QUEUE, "exchange": RENEWAL_QUEUE, "key": RENEWAL_QUEUE}
    assert routing_of(own_app, "proj.anything")["queue"] == "orders"
    assert routing_of(own_app, "merchant_tasks.call_api")["queue"] == "orders"  # the default
    assert conf.beat_schedule["nightly-report"] == mine["nightly-report"]
    entry = conf.beat_schedule[BEAT_ENTRY]
    assert entry["task"] == "merchant_tasks.renew_token"
    assert entry["schedule"] == entry["options"]["expires"] == 7.5
    assert (conf.worker_prefetch_multiplier, conf.task_serializer) == (4, "pickle")
    assert mine == {"nightly-report": mine["nightly-report"]}  # the user's dict not mutated


def test_an_app_without_queues_keeps_its_default_queue_as_celery_makes_it(
    own_app: Celery,
) -> None:
    plain = Celery("plain", set_as_current=False)
    merchant_tasks.install(own_app)
    queues = own_app.amqp.queues
    assert set(queues) == {CALLS_QUEUE, RENEWAL_QUEUE}
    assert queues[CALLS_QUEUE] == plain.amqp.queues[CALLS_QUEUE]
    assert routing_of(own_app, "proj.add")["queue"] == CALLS_QUEUE


def test_a_route_the_user_gave_a_renewal_task_by_name_is_kept(own_app: Celery) -> None:
    own_app.conf.task_routes = [{"merchant_tasks.renew_token": {"queue": "renewals-eu"}}]
    merchant_tasks.install(own_app)
    assert routing_of(own_app, "merchant_tasks.renew_token")["queue"] == "renewals-eu"
    assert routing_of(own_app, "merchant_tasks.renew_account")["queue"] == RENEWAL_QUEUE


class DjangoSettings:
    """What ``config_from_object("django.conf:settings", namespace="CELERY")`` reads."""

    CELERY_BROKER_URL = REDIS
    CELERY_TASK_ROUTES: ClassVar = {"shop.tasks.*": {"queue": "shop"}}
    CELERY_BEAT_SCHEDULE: ClassVar = {"cleanup": {"task": "shop.tasks.cleanup", "schedule": 3600.0}}


def test_install_before_the_configuration_is_loaded_survives_loading_and_reloading(
    own_app: Celery,
) -> None:
    merchant_tasks.install(own_app)  # proj/celery.py may call it first
    own_app.config_from_object(DjangoSettings, namespace="CELERY")
    conf = own_app.conf
    assert conf.broker_url == REDIS
    assert {BEAT_ENTRY, "cleanup"} <= set(conf.beat_schedule)
    assert routing_of(own_app, "shop.tasks.refund")["queue"] == "shop"
    assert routing_of(own_app, "merchant_tasks.renew_token")["queue"] == RENEWAL_QUEUE
    own_app.config_from_object(DjangoSettings, namespace="CELERY")  # a reload
    assert {BEAT_ENTRY, "cleanup"} <= set(own_app.conf.beat_schedule)
    assert RENEWAL_QUEUE in own_app.amqp.Queues(own_app.conf.task_queues)


def test_installing_twice_changes_nothing(own_app: Celery) -> None:
    merchant_tasks.install(own_app)
    conf = own_app.conf
    before = (conf.task_queues, conf.task_routes, dict(conf.beat_schedule))
    merchant_tasks.install(own_app)
    assert (conf.task_queues, conf.task_routes, dict(conf.beat_schedule)) == before
    assert len(conf.task_queues) == 2


def test_a_bad_renew_interval_stops_install_naming_the_variable(
    own_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MERCHANT_RENEW_INTERVAL", "soon")
    monkeypatch.delitem(sys.modules, "celery.bin.celery", raising=False)  # a library import
    with pytest.raises(ConfigurationError, match="MERCHANT_RENEW_INTERVAL"):
        merchant_tasks.install(own_app)


def test_the_package_app_is_built_through_install_and_breaks_no_guarantee() -> None:
    assert set(package_app.tasks) >= TASK_NAMES
    assert BEAT_ENTRY in package_app.conf.beat_schedule
    assert set(package_app.amqp.queues) == {CALLS_QUEUE, RENEWAL_QUEUE}
    assert broken_guarantees(package_app) == []


def test_each_setting_that_breaks_a_guarantee_is_named(own_app: Celery) -> None:
    own_app.conf.update(
        broker_url=REDIS,
        result_backend=REDIS,
        broker_transport_options={"visibility_timeout": 120},
        task_annotations={"merchant_tasks.call_api": {"acks_late": False}},
    )
    merchant_tasks.install(own_app)
    problems = broken_guarantees(own_app)
    assert len(problems) == 3, problems
    named = ["task_annotations", "broker_transport_options['visibility_timeout']"]
    named.append("result_backend_always_retry")
    for setting, problem in zip(named, problems, strict=True):
        assert problem.startswith(setting), problem
    assert "merchant_tasks.call_api" in problems[0]


def test_the_worker_start_check_logs_each_broken_guarantee(
    own_app: Celery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("merchant_tasks.worker.install.remove_stale_bindings", lambda app: None)
    own_app.conf.update(broker_url="memory://", result_backend="redis://127.0.0.1:6379/0")
    merchant_tasks.install(own_app)

    class Worker:
        app = own_app
        concurrency = 1
        pool_cls = "solo"

    with caplog.at_level(logging.WARNING, logger="merchant_tasks.worker.install"):
        _prepare_worker("celery@shop", Worker())
    assert [r.getMessage().split(" is off")[0] for r in caplog.records] == [
        "merchant-tasks: result_backend_always_retry"
    ]


def test_call_api_sends_through_the_current_app_when_it_has_the_tasks(own_app: Celery) -> None:
    merchant_tasks.install(own_app)
    previous = get_current_app()
    own_app.set_current()
    try:
        assert tasks.call_api.app is own_app
        assert tasks.renew_account.name == "merchant_tasks.renew_account"
    finally:
        previous.set_current()


def test_call_api_falls_back_to_the_package_app_under_an_app_without_install(
    own_app: Celery,
) -> None:
    previous = get_current_app()
    own_app.set_current()
    try:
        assert tasks.call_api.app is package_app
    finally:
        previous.set_current()


def test_call_api_sent_from_another_thread_goes_through_the_shops_app(own_app: Celery) -> None:
    """Celery's current app is per thread: a web server's request thread (Django's
    runserver, gunicorn's threads) sees Celery's default app, not the shop's. It sent
    through the package's app, whose broker the shop's workers never read."""
    merchant_tasks.install(own_app)
    previous = get_current_app()
    own_app.set_current()  # in this thread only, as Celery("proj") does where it is made
    try:
        seen: list[Any] = []
        thread = threading.Thread(
            target=lambda: seen.append((get_current_app(), tasks.call_api.app))
        )
        thread.start()
        thread.join()
        [(current_there, sent_through)] = seen
        assert current_there is not own_app  # the premise: another thread, another app
        assert sent_through is own_app
        assert tasks.call_api.app is own_app  # and here, as before
    finally:
        previous.set_current()


@pytest.mark.parametrize("as_mapping", [False, True], ids=["tuple", "mapping"])
def test_a_renewal_queue_listed_by_name_gets_its_own_binding_and_no_call_lands_twice(
    own_app: Celery, as_mapping: bool
) -> None:
    """Celery binds a queue listed by name alone to celery/celery, beside the calls' queue."""
    listed = (Queue(CALLS_QUEUE), Queue(RENEWAL_QUEUE, queue_arguments={"x-max-priority": 5}))
    own_app.conf.task_queues = {q.name: q for q in listed} if as_mapping else listed
    merchant_tasks.install(own_app)
    queues = own_app.amqp.queues
    renewal = queues[RENEWAL_QUEUE]
    assert (renewal.exchange.name, renewal.routing_key) == (RENEWAL_QUEUE, RENEWAL_QUEUE)
    assert renewal.queue_arguments == {"x-max-priority": 5}
    assert (queues[CALLS_QUEUE].exchange.name, queues[CALLS_QUEUE].routing_key) == (
        CALLS_QUEUE,
        CALLS_QUEUE,
    )
    assert shared_bindings(own_app) == []


def test_two_of_the_users_queues_on_the_calls_binding_are_named_as_unsafe(
    own_app: Celery,
) -> None:
    own_app.conf.task_queues = (Queue(CALLS_QUEUE), Queue("shop"))  # both on celery/celery
    merchant_tasks.install(own_app)
    [problem] = shared_bindings(own_app)
    assert "celery, shop" in problem
    assert "routing key 'celery'" in problem
    assert "Queue('shop', Exchange('shop'), routing_key='shop')" in problem


def test_a_fanout_or_topic_queue_on_the_calls_exchange_is_unsafe_and_own_bindings_are_safe(
    own_app: Celery,
) -> None:
    own_app.conf.task_queues = (
        Queue(CALLS_QUEUE),
        Queue("audit", Exchange(CALLS_QUEUE, type="topic"), routing_key="#"),
    )
    merchant_tasks.install(own_app)
    assert len(shared_bindings(own_app)) == 1
    safe = Celery("safe", set_as_current=False)
    safe.conf.task_queues = (Queue(CALLS_QUEUE), Queue("shop", Exchange("shop"), "shop"))
    merchant_tasks.install(safe)
    assert shared_bindings(safe) == []
    safe.close()


def test_installing_an_app_again_makes_it_the_one_other_threads_send_through(
    own_app: Celery,
) -> None:
    other = Celery("other", set_as_current=False)
    try:
        merchant_tasks.install(own_app)
        merchant_tasks.install(other)
        merchant_tasks.install(own_app)
        seen: list[Any] = []
        thread = threading.Thread(target=lambda: seen.append(tasks.call_api.app))
        thread.start()
        thread.join()
        assert seen == [own_app]
    finally:
        other.close()
