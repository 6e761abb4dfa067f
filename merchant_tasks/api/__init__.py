"""The payment API over HTTP: the business client and the token exchange.

The only folder that imports requests. Imports the top-level modules only: the client takes
its token from a ``TokenSource`` (the renewal manager), never from the store directly.
"""
