"""Tools that exercise the core without an account: the emulator of the payment API, the
local child processes (Redis, emulator, workers) and the pytest plugin.

Apart from the core: nothing below ``ops`` imports this folder.
"""
