"""Celery configuration for merchant-tasks: loaded by ``celery -A merchant_tasks ...``.

Every setting here overrides the package default of the same name (see
merchant_tasks/celery_app.py); delete a line to get the default back. CELERY_BROKER_URL and
CELERY_RESULT_BACKEND in the environment override the URLs below. Names are Celery's own:
https://docs.celeryq.dev/en/stable/userguide/configuration.html
"""

import os

_redis = os.environ.get("MERCHANT_REDIS_URL", "redis://localhost:6379/0")

# The broker and the result backend default to the token store's Redis.
broker_url = _redis
result_backend = _redis

# Delivery: at least once. A task is acknowledged after it ran; a worker killed mid-task
# puts it back; a call that succeeded is not run again (call_api's completion record).
# Calls to non-idempotent endpoints should still carry an idempotency key
# (call_api(..., idempotency_key=...)): a worker can die after the API answered.
task_acks_late = True
task_reject_on_worker_lost = True
worker_prefetch_multiplier = 1

# A message not acknowledged within this many seconds is delivered again. Keep it above
# the longest task and above every retry countdown (call_api's are at most 300 s).
broker_transport_options = {"visibility_timeout": 3600}

# JSON only: nothing that can execute code on load crosses the broker.
task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
result_expires = 3600
# A result written while Redis restarts is retried rather than lost.
result_backend_always_retry = True
result_backend_max_retries = 20

# Flower's live view needs task events.
worker_send_task_events = True
task_send_sent_event = True
