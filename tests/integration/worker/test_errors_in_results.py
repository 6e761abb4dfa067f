"""Errors keep their fields through Celery's JSON results, on the real Redis."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from celery import Celery

from merchant_tasks.exceptions import MerchantError
from support.errors import FIELDS, every_error_class

pytestmark = pytest.mark.integration


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
