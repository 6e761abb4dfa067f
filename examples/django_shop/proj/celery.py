"""The shop's one Celery app: its own tasks and merchant-tasks', on one fleet.

celery -A proj worker --loglevel=INFO
celery -A proj beat --loglevel=INFO
"""

import os

from celery import Celery

import merchant_tasks

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")

app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
merchant_tasks.install(app)  # call_api, the renewal queue and beat's entry; nothing else
app.autodiscover_tasks()
