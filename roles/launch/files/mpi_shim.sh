#!/bin/sh
# nodeops: map Open MPI rank variables to torch.distributed's env:// names, then run the rank.
export RANK="$OMPI_COMM_WORLD_RANK" WORLD_SIZE="$OMPI_COMM_WORLD_SIZE"
export LOCAL_RANK="$OMPI_COMM_WORLD_LOCAL_RANK" LOCAL_WORLD_SIZE="$OMPI_COMM_WORLD_LOCAL_SIZE"
# the run's stack hook and progress file on this node (`nodeops stacks`, the hang watchdog)
d="$HOME/.nodeops/runs/$NODEOPS_RUN_ID"
export PYTHONPATH="$d/hook${PYTHONPATH:+:$PYTHONPATH}" NODEOPS_PROGRESS_FILE="$d/progress"
# Not exec: a rank that fails says how and when (mpi_split.EXITED), so that nodeops can name the
# rank whose failure came first; mpirun names the first it heard of, often a rank that only lost
# its peer. Open MPI signals the whole process group (this shell and the rank): the traps keep
# the shell waiting for the rank, whose own exit is what counts (a trap's command runs once the
# rank has ended; the rank gets every signal with its default disposition), and SIGKILL ends both.
# The shell's own stderr goes to /dev/null, so its words about a rank a signal ended
# ("Terminated") are not the rank's output; the rank's stderr, and the line below, are fd 3.
trap : HUP INT QUIT TERM USR1 USR2 ALRM
exec 3>&2 2>/dev/null
(exec 2>&3 3>&-; exec "$@")
rc=$?
[ "$rc" -eq 0 ] || printf '@@nodeops-rank-exit %s %s\n' "$rc" "$(date +%s.%N)" >&3
exit "$rc"
