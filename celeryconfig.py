"""Celery configuration of merchant-tasks' own app: the place to override its defaults.

``celery -A merchant_tasks worker|beat|flower`` started from this directory imports this
file, and so does the container image (docker-compose.yml). Every setting here overrides
the package default of the same name (merchant_tasks/worker/app.py: acknowledgement after
the task ran, prefetch 1, JSON only, results for an hour and retried through a Redis
restart, task events for Flower, the broker and result backend from MERCHANT_REDIS_URL or
MERCHANT_REDIS_URL_FILE). CELERY_BROKER_URL and CELERY_RESULT_BACKEND in the environment
override the URLs. The tasks, the renewal queue, its route and beat's entry are added by
``install(app)`` beside what this file sets. Names are Celery's own:
https://docs.celeryq.dev/en/stable/userguide/configuration.html

Your own Celery app (Django's proj/celery.py, ...) does not read this file: see
docs/celery-app.md. The demo and the tests write their own.

Nothing is set here, so the package defaults apply; uncomment what you want to change.
"""

# Delivery (package defaults): at least once. A task is acknowledged after it ran; a worker
# killed mid-task puts it back; a call that succeeded is not run again (call_api's
# completion record). Calls to non-idempotent endpoints should still carry an idempotency
# key (call_api(..., idempotency_key=...)): a worker can die after the API answered.
# task_acks_late = True
# task_reject_on_worker_lost = True
# worker_prefetch_multiplier = 1

# A message not acknowledged within this many seconds is delivered again. Keep it above
# the longest task and above every retry countdown (call_api's are at most 300 s).
# broker_transport_options = {"visibility_timeout": 3600}

# How long results are kept for callers waiting on them.
# result_expires = 3600

# Time zone of beat's schedule and of the timestamps in Flower.
# timezone = "UTC"
