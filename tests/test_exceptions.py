"""Errors keep their fields wherever they are rebuilt: Celery's JSON results, pickle."""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from merchant_tasks import exceptions
from merchant_tasks.exceptions import ApiUnavailable, MerchantError

FIELDS: dict[str, Any] = {
    "status": 503,
    "code": "maintenance",
    "excerpt": '{"error": "x"}',
    "retry_after": 30.0,
}


def every_error_class() -> list[type[MerchantError]]:
    found = [MerchantError]
    for cls in found:
        found += [c for c in cls.__subclasses__() if c.__module__ == exceptions.__name__]
    return found


def test_the_tests_below_see_every_error_of_the_module() -> None:
    defined = {
        c for c in vars(exceptions).values() if isinstance(c, type) and issubclass(c, MerchantError)
    }
    assert set(every_error_class()) == defined
    assert len(defined) >= 13


@pytest.fixture
def celery_json_backend(merchant_redis_url: str) -> Iterator[Celery]:
    """A Celery app whose result backend is the real Redis, with JSON results."""
    app = Celery("errors-test", broker=merchant_redis_url, backend=merchant_redis_url)
    app.conf.update(result_serializer="json", accept_content=["json"], result_expires=60)
    yield app
    app.close()


# Celery's Redis backend writes results with setex, which redis-py 8 marks deprecated
@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
@pytest.mark.parametrize("cls", every_error_class(), ids=lambda c: c.__name__)
def test_every_error_comes_back_from_celerys_json_results_with_its_fields(
    celery_json_backend: Celery, cls: type[MerchantError]
) -> None:
    task_id = f"mt-test-{uuid.uuid4().hex}"
    backend = celery_json_backend.backend
    backend.mark_as_failure(task_id, cls("what happened", **FIELDS))
    try:
        back = celery_json_backend.AsyncResult(task_id).get(timeout=10, propagate=False)
    finally:
        backend.forget(task_id)
    assert type(back) is cls
    assert str(back) == "what happened"
    assert back.details() == FIELDS
    assert back.retryable is cls.retryable


@pytest.mark.parametrize("cls", every_error_class(), ids=lambda c: c.__name__)
def test_every_error_survives_pickle_with_its_fields(cls: type[MerchantError]) -> None:
    back = pickle.loads(pickle.dumps(cls("what happened", **FIELDS)))  # noqa: S301
    assert (type(back), str(back), back.details()) == (cls, "what happened", FIELDS)


def test_repr_shows_the_message_and_the_fields_that_are_set_but_never_the_excerpt() -> None:
    error = ApiUnavailable("gave up", status=503, excerpt="free text of the body", retry_after=2.0)
    assert repr(error) == "ApiUnavailable('gave up', status=503, retry_after=2.0)"
    assert repr(MerchantError("plain")) == "MerchantError('plain')"


def test_fields_default_to_none_or_empty() -> None:
    error = MerchantError("plain")
    assert (error.status, error.code, error.excerpt, error.retry_after) == (None, None, "", None)
    assert error.details() == {}
