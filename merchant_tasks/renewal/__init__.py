"""Who renews the token and when: the manager, what a 401 means, the fleet lock.

Single flight, the breaker and beat's due check live here too. Takes the token exchange as
an object and talks to Redis only through ``store``: imports store and the top-level
modules, never api, worker or Celery.
"""
