"""The Slurm backend: the backend itself (``backend``), and the batch job: rendering the batch
script, submitting, watching and cancelling it (``job``). What runs on the batch node besides
the script is in ``nodeops.node``."""
