#!/usr/bin/env bash
# Run one trainprof recipe on several nodes with plain torchrun (no scheduler). Start this script on
# every node, with the same settings; the nodes meet at MASTER_ADDR:MASTER_PORT (c10d rendezvous):
#
#   node0$ MASTER_ADDR=node0 NNODES=2 NPROC_PER_NODE=8 scripts/multinode_torchrun.sh recipes/llama7b_zero3.yaml
#   node1$ MASTER_ADDR=node0 NNODES=2 NPROC_PER_NODE=8 scripts/multinode_torchrun.sh recipes/llama7b_zero3.yaml
#
# Extra arguments after the recipe are key=value overrides. output.dir should be on a filesystem all
# nodes share (rank 0 makes the run dir; every rank writes its rank<N>.json into it). The profile.json
# is gathered to rank 0 over the network either way. To get a scaling report from such runs, run the
# recipe at each node count, collect the run dirs in one place and:
#   trainprof scale --runs runs/llama7b_zero3-2026...-1node runs/llama7b_zero3-2026...-2nodes
#
# NCCL over the right network: set e.g. NCCL_SOCKET_IFNAME=ib0 (or eth0) and, with InfiniBand,
# NCCL_IB_HCA=mlx5; NCCL_DEBUG=INFO prints what NCCL picked.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: MASTER_ADDR=<first node> NNODES=<n> NPROC_PER_NODE=<gpus> $0 RECIPE [key=value ...]" >&2
  exit 2
fi
: "${MASTER_ADDR:?set MASTER_ADDR to the hostname or IP of the first node, the same on every node}"
NNODES=${NNODES:-2}                        # nodes taking part
NPROC_PER_NODE=${NPROC_PER_NODE:-8}        # ranks (GPUs) per node
MASTER_PORT=${MASTER_PORT:-29500}          # a free TCP port on MASTER_ADDR
RDZV_ID=${RDZV_ID:-trainprof-${USER:-user}-${NNODES}x${NPROC_PER_NODE}}   # same on every node, new per job

exec python -m torch.distributed.run \
  --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RDZV_ID" \
  -m trainprof.run "$@"
