"""The local sandbox clusters: real sshd containers (``cluster``), optionally a real Slurm
cluster in them (``slurm``)."""
