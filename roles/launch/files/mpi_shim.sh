#!/bin/sh
# nodeops: map Open MPI rank variables to torch.distributed's env:// names.
export RANK="$OMPI_COMM_WORLD_RANK" WORLD_SIZE="$OMPI_COMM_WORLD_SIZE"
export LOCAL_RANK="$OMPI_COMM_WORLD_LOCAL_RANK" LOCAL_WORLD_SIZE="$OMPI_COMM_WORLD_LOCAL_SIZE"
# the run's stack hook and progress file on this node (`nodeops stacks`, the hang watchdog)
d="$HOME/.nodeops/runs/$NODEOPS_RUN_ID"
export PYTHONPATH="$d/hook${PYTHONPATH:+:$PYTHONPATH}" NODEOPS_PROGRESS_FILE="$d/progress"
exec "$@"
