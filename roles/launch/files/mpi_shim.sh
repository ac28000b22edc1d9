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
# the shell waiting for the rank, whose own exit is what counts, and note that a signal came
# from outside (a trap's command runs once the rank has ended; the rank gets every signal with
# its default disposition). SIGKILL ends both.
# The shell's own stderr goes to /dev/null, so its words about a rank a signal ended
# ("Terminated") are not the rank's output; the rank's stderr, and the mark below, are fd 3.
sig=-
for s in HUP INT QUIT TERM USR1 USR2 ALRM ABRT; do
  # shellcheck disable=SC2064  # $s now, $sig when the trap runs
  trap "[ \"\$sig\" != - ] || sig=$s" "$s"
done
exec 3>&2 2>/dev/null
(exec 2>&3 3>&-; exec "$@")
rc=$?
[ "$rc" -ne 0 ] || exit 0
# the time, with the group's signals ignored (a teardown's SIGTERM must not cut the mark short)
t=$(trap '' HUP INT QUIT TERM USR1 USR2 ALRM ABRT; date +%s.%N)
case $t in '' | *[!0-9.]*) t=- ;; esac
printf '@@nodeops-rank-exit %s %s %s\n' "$rc" "$t" "$sig" >&3
# A rank a signal ended: the shell ends by the same signal (no core file of its own), so mpirun
# reports it as before ("exited on signal N") and aborts the job as it would.
if [ "$rc" -gt 128 ] && [ "$rc" -lt 160 ]; then
  # shellcheck disable=SC3045  # not POSIX, but dash, bash and busybox sh have it (an error otherwise goes to /dev/null)
  ulimit -c 0
  trap - "$((rc - 128))"
  kill -s "$((rc - 128))" "$$"
fi
exit "$rc"
