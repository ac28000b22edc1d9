"""What each host runs to start training, worked out on the controller (pure, no I/O): the launch
plan (``plan``, the collection's ``module_utils/nodeops_launch.py``) and the spec's side of it
(``launchers``). Starting it is the backends' job; what runs on the hosts is in ``nodeops.node``."""
