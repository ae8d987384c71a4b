#!/usr/bin/env bash
# One node, several GPUs (or CPU ranks), through the DeepSpeed launcher: `pretrain run`, every stage of a run.
#   launch/single_node.sh NUM_PROCS CONFIG [key=value ...]
#   launch/single_node.sh 8 configs/bert-base.yaml train.micro_batch_size=64
# Data stages (tokenizer, shards) run once on rank 0, skipped where their output exists; the others wait at a
# barrier, for 30 minutes at most: prepare a corpus that takes longer first (`pretrain tokenizer`, `pretrain
# shards`, then data.tokenizer= data.shards=). Then training, and the export to <run_dir>/hf.
# SIGTERM or SIGINT (^C): the ranks finish the step, save a checkpoint and exit 75, and so does this script; the
# same command resumes.
set -euo pipefail
nproc_per_node=${1:?usage: $0 NUM_PROCS CONFIG [key=value ...]}; shift
if ! command -v nvidia-smi >/dev/null 2>&1; then export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}; fi
# The signal goes to the ranks, not to DeepSpeed's processes: its runner forwards none on one node, and its
# launch.py, signalled itself, kills the ranks 30 s later and exits 1. From a rank's 75 both exit 75. Until the
# ranks exist, it goes to launch.py or the runner ($!: set as soon as it is started); before that, this script ends.
forward() {
  local launch ranks=
  [ -n "${!:-}" ] || exit $((128 + $(kill -l "$1")))
  launch=$(pgrep -d, -P "$!" -f deepspeed.launcher.launch || true)
  if [ -n "$launch" ]; then ranks=$(pgrep -d' ' -P "$launch" || true); fi
  kill -s "$1" ${ranks:-${launch:-$!}} 2>/dev/null || true
}
trap 'forward TERM' TERM
trap 'forward INT' INT
set -m  # the launcher in a process group of its own: a terminal's ^C reaches this script alone, which forwards it
deepspeed --num_gpus "$nproc_per_node" --master_port "${MASTER_PORT:-29500}" \
  --module pretrain.cli run "$@" --no-demo &
launcher=$!
while :; do
  status=0
  wait "$launcher" || status=$?
  kill -0 "$launcher" 2>/dev/null || exit "$status"  # still running: the wait was cut short by a forwarded signal
done
