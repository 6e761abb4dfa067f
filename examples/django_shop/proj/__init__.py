"""The shop's Django project; its Celery app is loaded with it, so ``call_api.delay`` in a
view sends through that app."""

from .celery import app as celery_app

__all__ = ("celery_app",)
