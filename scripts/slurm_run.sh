#!/usr/bin/env bash
# One trainprof recipe on several nodes under SLURM: one torchrun per node (srun), c10d rendezvous on
# the allocation's first node.
#
#   sbatch --nodes=2 scripts/slurm_run.sh recipes/llama7b_zero3.yaml [key=value ...]
#
# Adjust the #SBATCH lines (partition, account, GPUs per node, time) to your cluster. output.dir
# (default runs/) must be on a filesystem every node sees.
#SBATCH --job-name=trainprof
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --time=01:00:00
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: sbatch [--nodes=N] $0 RECIPE [key=value ...]" >&2
  exit 2
fi
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_PER_NODE:-8}}
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${MASTER_PORT:-29500}

srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
  python -m torch.distributed.run \
    --nnodes "$SLURM_JOB_NUM_NODES" --nproc_per_node "$NPROC_PER_NODE" \
    --rdzv_backend c10d --rdzv_endpoint "$HEAD:$PORT" --rdzv_id "trainprof-$SLURM_JOB_ID" \
    -m trainprof.run "$@"
