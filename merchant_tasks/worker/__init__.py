"""How Celery runs it: the tasks, ``install(app)``, the package's own app, routing, pool
sizing, completion records, and a caller's send bounded in time (``sending``).

The only folder that imports Celery (with the command-line tools and the sandbox above it).
Imports everything below: accounts, api, renewal, store and the top-level modules.
"""
