"""Everything nodeops ships to a node or a Slurm batch node and runs there with the node's own
python3, without nodeops installed: the per-host agent, the chief's supervisor and the protocol
they share with the controller, the ranks' stacks, the restart rules (``recovery``,
``slurm_failures``), mpirun's output splitter, the probes of ``setup`` and ``check``, the
check rules, the fabric probe and its gate, and Slurm's hang watch.

Stdlib only (Python 3.8+), under one import-linter contract (pyproject.toml): a module here
imports the standard library, other modules of this package and ``nodeops.errors`` (itself
stdlib-only), nothing else. Each is shipped as a file (read with ``Path(module.__file__)``) or,
with what it imports, as a package of its own in the run dir; this ``__init__`` is never shipped.
The launch role's files (``roles/launch/files/``) are linked here, so the collection and the
package carry the same bytes."""
