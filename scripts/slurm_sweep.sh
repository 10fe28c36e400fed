#!/usr/bin/env bash
# A trainprof sweep (or max-batch search) as one SLURM job. The sweep runs on the job's first node and
# launches each cell there with torchrun; a cell with nnodes > 1 is started with srun across the
# allocation (one torchrun per node, c10d rendezvous on the first node).
#
#   sbatch scripts/slurm_sweep.sh recipes/sweeps/pretrain_methods_gpu.yaml --out runs/sweeps/pretrain-a800
#   sbatch scripts/slurm_sweep.sh maxbatch recipes/sweeps/pretrain_maxbatch_gpu.yaml --out runs/maxbatch/a800
#
# Resumable: if the job is preempted or runs out of time (SLURM sends SIGTERM first, which the sweep
# treats like Ctrl-C), submit the same command again; finished cells are not run again.
#SBATCH --job-name=trainprof-sweep
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --time=12:00:00
#SBATCH --signal=B:TERM@120
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: sbatch $0 [sweep|maxbatch] SWEEP.yaml [--out DIR] [more trainprof options]" >&2
  exit 2
fi
COMMAND=sweep
if [[ "$1" == "sweep" || "$1" == "maxbatch" ]]; then
  COMMAND=$1
  shift
fi
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
# `exec` so that SLURM's SIGTERM (--signal=B:TERM) reaches trainprof, which stops the running cell,
# records it as interrupted and writes the tables of everything finished.
exec trainprof "$COMMAND" "$@"
