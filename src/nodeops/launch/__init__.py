"""Launch internals that run on the hosts: the per-host agent, the chief's supervisor and the
protocol they share with the controller. These three modules are stdlib only (Python 3.8+):
they are shipped into each run dir as files and run there with the node's python3."""
