"""`nodeops setup`'s machinery below the lifecycle: rendering a spec into an inventory and
variables (``render``, ``workdir``), the ansible-runner boundary (``runner``), the fast path's
record and comparison (``state``, ``fast``), and ``gpus: auto`` discovery (``gpus``)."""
