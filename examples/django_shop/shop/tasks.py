"""The shop's own tasks, found by ``app.autodiscover_tasks()`` beside merchant-tasks'."""

from typing import Any

from celery import shared_task


@shared_task
def receipt(payment: dict[str, Any]) -> str:
    """The line printed on the customer's receipt."""
    return f"payment {payment['id']}: {payment['amount'] / 100:.2f} EUR"
