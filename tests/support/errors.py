"""Every error class of ``merchant_tasks.exceptions``, and the fields to build one with: for
the tests that rebuild errors (pickle, Celery's JSON results)."""

from __future__ import annotations

from typing import Any

from merchant_tasks import exceptions
from merchant_tasks.exceptions import MerchantError

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
