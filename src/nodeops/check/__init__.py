"""The controller side of `nodeops check`: the full-mesh preflight run from the chief
(``preflight``). What runs on the nodes (the probe, the rules, the fabric probe and gate) is in
``nodeops.node``."""
