"""Settings of the example shop: only what the example needs.

merchant-tasks reads its own MERCHANT_* variables (the account, the token store's Redis);
Celery reads the CELERY_* settings below, as in any Django project.
"""

import os

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-shop-not-for-production")
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
INSTALLED_APPS = ["shop"]
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "proj.urls"
DATABASES: dict[str, dict[str, str]] = {}  # the example keeps no data of its own
USE_TZ = True

REDIS_URL = os.environ.get("SHOP_REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = REDIS_URL
# the shop's own choices; install() leaves them alone and warns where one breaks a
# guarantee (result_backend_always_retry off, a visibility timeout shorter than a retry)
CELERY_RESULT_BACKEND_ALWAYS_RETRY = True
CELERY_RESULT_BACKEND_MAX_RETRIES = 20
CELERY_TASK_DEFAULT_QUEUE = "shop"
# SHOP_CELERY_KEY_PREFIX keeps the example's queues apart on a shared Redis (its tests)
_transport = {"global_keyprefix": os.environ.get("SHOP_CELERY_KEY_PREFIX", "shop:")}
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 3600, **_transport}
CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = _transport
