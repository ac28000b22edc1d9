"""The ssh backend: every host's job started over ssh (``backend``), and the run seen from the
controller while it runs (``run``: following logs, host states, stopping)."""
