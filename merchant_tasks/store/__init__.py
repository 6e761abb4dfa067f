"""The token store: every Redis command of merchant-tasks (the broker's own Redis aside).

Keys and their names, the records kept beside each token, the Lua scripts, reading many
accounts at once, the Redis topologies (one server, Sentinel, Cluster), wake-ups, the
fleet's exchange permits and tokens sealed at rest. Imports only the top-level modules
(token, exceptions, telemetry, variable_files): never renewal, api, worker or Celery.
"""
