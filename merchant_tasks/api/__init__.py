"""The payment API over HTTP: the send loop of a call (``calls``, a flow every HTTP client
drives), the clients (requests, httpx) and the token exchange.

The only folder that imports requests and httpx. The clients take their token from a token
source (the renewal's flows, or a ``TokenSource`` of one's own), never from the store: the
Redis commands a source yields pass through. Imports settings, store and the top-level
modules; never renewal, worker or Celery.
"""
