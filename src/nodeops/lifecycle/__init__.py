"""The run lifecycle: launch (with its gates: sync, preflight, fabric), dry run, status, logs,
stop, runs and clean, over whichever backend a spec or run record names.

Nothing here prints or exits: events go to a :class:`~nodeops.backends.base.Sink`, outcomes are
returned or raised as :class:`~nodeops.errors.NodeopsError` (``ExitWith`` for a run's own code).
"""
