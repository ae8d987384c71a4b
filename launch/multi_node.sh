#!/usr/bin/env bash
# Several nodes from a hostfile (one line per node: "hostname slots=8"), through the DeepSpeed launcher,
# which starts the ranks over passwordless ssh. Run it on the first node of the hostfile.
#   launch/multi_node.sh HOSTFILE CONFIG [key=value ...]
# Build the tokenizer and shards first (`pretrain tokenizer`, `pretrain shards`) on a shared file system,
# and point data.tokenizer / data.shards at them.
set -euo pipefail
hostfile=${1:?usage: $0 HOSTFILE CONFIG [key=value ...]}; shift
exec deepspeed --hostfile "$hostfile" --master_addr "${MASTER_ADDR:-$(head -n1 "$hostfile" | cut -d' ' -f1)}" \
  --master_port "${MASTER_PORT:-29500}" --module pretrain.cli train "$@"
