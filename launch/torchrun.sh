#!/usr/bin/env bash
# torchrun, one node or several.
# One node (NNODES unset or 1): as launch/single_node.sh, `pretrain run`: tokenizer and shards (once, on rank 0,
# where they do not exist yet), training, and the export to <run_dir>/hf.
#   launch/torchrun.sh NUM_PROCS CONFIG [key=value ...]
#   launch/torchrun.sh 8 bert-base
# Several nodes: `pretrain train`, as the other multi-node launchers, on a tokenizer and shards prepared once on a
# file system every node mounts (`pretrain tokenizer`, `pretrain shards`; README.md, "Several processes, nodes,
# clusters") and named by data.tokenizer / data.shards. On each node set NNODES, NODE_RANK (0 on the node at
# MASTER_ADDR) and MASTER_ADDR (an address of node 0 every node reaches), the same MASTER_PORT everywhere, and where
# a node has several network interfaces GLOO_SOCKET_IFNAME (CPU ranks, and GPUs too: the trainer's control group is
# gloo) and NCCL_SOCKET_IFNAME (GPUs).
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 GLOO_SOCKET_IFNAME=eth0 launch/torchrun.sh 1 tiny data.shards=... data.tokenizer=...
# SIGTERM or SIGINT (^C): the workers finish the step, save a checkpoint and exit 75. torchrun exits 1 whenever a
# worker exits non-zero (its report names exitcode 75 for each), and so does this script.
set -euo pipefail
nproc_per_node=${1:?usage: $0 NUM_PROCS CONFIG [key=value ...]}; shift
if ! command -v nvidia-smi >/dev/null 2>&1; then export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}; fi
nnodes=${NNODES:-1}
command=run
if [ "$nnodes" != 1 ]; then
  if [ -z "${MASTER_ADDR:-}" ]; then  # 127.0.0.1 would leave the other nodes waiting on themselves, without a word
    echo "$0: NNODES=$nnodes needs MASTER_ADDR, an address of node 0 (NODE_RANK=0) that every node reaches" >&2
    exit 2
  fi
  if [ -z "${NODE_RANK:-}" ]; then  # 0 on every node: each would take the same ranks
    echo "$0: NNODES=$nnodes needs NODE_RANK on each node: 0 on the node at MASTER_ADDR, 1..$((nnodes - 1)) on the others" >&2
    exit 2
  fi
  command=train
fi
source "$(dirname "${BASH_SOURCE[0]}")/forward_signals.sh"
# torchrun starts each worker in a session of its own; signalled itself, it kills them 30 s later, maybe during the
# checkpoint, and ends in a SignalException: the signal goes to the workers
ranks_of() { pgrep -d' ' -P "$1" || true; }
# one node: a port free here (two jobs on a node each take one); several: the same everywhere, 29500 unless set
port=${MASTER_PORT:-29500}
if [ "$nnodes" = 1 ] && [ -z "${MASTER_PORT:-}" ]; then port=$(free_port); fi
run_forwarding torchrun --nproc_per_node "$nproc_per_node" --nnodes "$nnodes" --node_rank "${NODE_RANK:-0}" \
  --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "$port" -m pretrain.cli "$command" "$@"
