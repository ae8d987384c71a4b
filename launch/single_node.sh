#!/usr/bin/env bash
# One node, several GPUs (or CPU ranks), through the DeepSpeed launcher: `pretrain run`, every stage of a run.
#   launch/single_node.sh NUM_PROCS CONFIG [key=value ...]
#   launch/single_node.sh 8 configs/bert-base.yaml train.micro_batch_size=64
# Data stages (tokenizer, shards) run once on rank 0, skipped where their output exists; the others wait for it,
# however long it takes (they poll the process group's store, outside any collective's timeout). Then training, and
# the export to <run_dir>/hf.
# SIGTERM or SIGINT (^C): the ranks finish the step, save a checkpoint and exit 75, and so does this script; the
# same command resumes.
set -euo pipefail
nproc_per_node=${1:?usage: $0 NUM_PROCS CONFIG [key=value ...]}; shift
if ! command -v nvidia-smi >/dev/null 2>&1; then export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}; fi
source "$(dirname "${BASH_SOURCE[0]}")/forward_signals.sh"
ranks_of() { deepspeed_ranks "$1"; }
run_forwarding deepspeed --num_gpus "$nproc_per_node" --master_port "${MASTER_PORT:-$(free_port)}" \
  --module pretrain.cli run "$@" --no-demo
