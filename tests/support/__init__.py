"""What the tests share, written once: fakes (a clock, an HTTP transport, a token exchange),
token makers, the harnesses that run Celery fleets, fault callers and Prometheus, and the
programs tests start as processes (run by path or with ``celery -A support.<module>``).

Imported as ``support`` (pyproject's ``pythonpath`` puts ``tests/`` on the path); it imports
merchant_tasks and never a test module.
"""
