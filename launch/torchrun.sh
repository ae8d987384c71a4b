#!/usr/bin/env bash
# torchrun, one node or several (set NNODES, NODE_RANK and MASTER_ADDR on each node).
#   launch/torchrun.sh NUM_PROCS CONFIG [key=value ...]
set -euo pipefail
nproc_per_node=${1:?usage: $0 NUM_PROCS CONFIG [key=value ...]}; shift
if ! command -v nvidia-smi >/dev/null 2>&1; then export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}; fi
exec torchrun --nproc_per_node "$nproc_per_node" --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
  --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
  -m pretrain.cli train "$@"
