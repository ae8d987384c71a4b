#!/usr/bin/env bash
# Several nodes from a hostfile (one line per node: "hostname slots=8"), through the DeepSpeed launcher, running
# `pretrain train` on a tokenizer and shards prepared once on a file system every node mounts (`pretrain tokenizer`,
# `pretrain shards`; README.md, "Several processes, nodes, clusters"), named by data.tokenizer and data.shards; the
# run directory (output_dir) belongs there too.
# Over ssh (the default): run it on the first node of the hostfile; it starts the ranks on every node over
# passwordless ssh (pdsh).
#   launch/multi_node.sh HOSTFILE CONFIG data.tokenizer=/shared/tok data.shards=/shared/shards [key=value ...]
# Without ssh: run it on every node yourself (or from a scheduler) with NODE_RANK set, 0 on the first node of the
# hostfile, 1 on the next, ...; every node reads the same hostfile.
#   NODE_RANK=1 launch/multi_node.sh HOSTFILE CONFIG [key=value ...]
# MASTER_ADDR (default: the first host of the hostfile) and MASTER_PORT (default 29500) must be reachable from
# every node; where a node has several network interfaces, name the one to use with GLOO_SOCKET_IFNAME (CPU ranks,
# and GPUs too: the trainer's control group is gloo) and NCCL_SOCKET_IFNAME (GPUs). README.md, "Several processes,
# nodes, clusters", says how to check them.
# Over ssh, the ranks get the variables of this environment named GLOO_*, NCCL_*, TORCH_*, WANDB_*, HF_*,
# DS_ACCELERATOR and OMP_NUM_THREADS, but not those whose names hold KEY, TOKEN, SECRET or PASSWORD (DeepSpeed prints
# the command it runs: log in on a shared home instead, or use .deepspeed_env), then the lines of ~/.deepspeed_env and
# ./.deepspeed_env (DeepSpeed's file, untouched; a name set there wins). Without ssh each node's environment is its own.
# SIGTERM or SIGINT (^C): without ssh, the ranks of this node finish the step, save a checkpoint and exit 75, and so
# does this script. Over ssh, DeepSpeed's runner stops the ranks through pdsh (`pkill -f` of its launcher on every
# node, which gives them 30 s to save) and exits 1.
set -euo pipefail
hostfile=${1:?usage: [NODE_RANK=N] $0 HOSTFILE CONFIG [key=value ...]}; shift
if ! command -v nvidia-smi >/dev/null 2>&1; then export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}; fi
first_host=$(awk '!/^[[:space:]]*(#|$)/ {print $1; exit}' "$hostfile")
per_node=()
if [ -n "${NODE_RANK:-}" ]; then
  per_node=(--no_ssh --node_rank "$NODE_RANK")
else
  # DeepSpeed's runner exports to the other nodes only PYTHON*, NCCL* (on GPUs) and a few more, and the lines of
  # DS_ENV_FILE (.deepspeed_env) in ~ and in the current directory: a file of our own holds the variables the ranks
  # read, then the lines of the user's files, and DS_ENV_FILE names it to the runner.
  env_file=$(mktemp "${TMPDIR:-/tmp}/deepspeed_env.XXXXXX")
  trap 'rm -f "$env_file"' EXIT
  for name in ${!GLOO_@} ${!NCCL_@} ${!TORCH_@} ${!WANDB_@} ${!HF_@} DS_ACCELERATOR OMP_NUM_THREADS; do
    case $name in *KEY* | *TOKEN* | *SECRET* | *PASSWORD*) continue ;; esac  # DeepSpeed logs the command it runs
    if [ -z "${!name+set}" ]; then continue; fi
    case ${!name} in  # DeepSpeed puts the value in a shell command, in double quotes where it needs quoting
      *[$'\n'\"\$\`\\]*) echo "$0: $name not passed on: a newline, \", \$, \` or \\ in its value" >&2 ;;
      *) printf '%s=%s\n' "$name" "${!name}" ;;
    esac
  done >"$env_file"
  for dir in ~ .; do  # the runner reads os.path.join(dir, DS_ENV_FILE)
    f=${DS_ENV_FILE:-.deepspeed_env}
    case $f in /*) ;; *) f=$dir/$f ;; esac
    if [ -f "$f" ]; then awk NF "$f" >>"$env_file"; fi  # a blank line would stop the runner
  done
  export DS_ENV_FILE=$env_file
  # With two hosts or more, pdsh runs the command on each node through a shell, which reads the arguments again:
  # DeepSpeed's runner puts one holding a space in double quotes (where $, ` and \ still act), and leaves any other
  # bare ($HOME expanded, a quote or ; a syntax error, {a,b} two arguments, a tab a split). Those are single-quoted
  # here; the others are refused. One host runs without pdsh or a shell: the arguments go as they are.
  if [ "$(awk '!/^[[:space:]]*(#|$)/' "$hostfile" | wc -l)" -gt 1 ]; then
    quoted=()
    for arg in "$@"; do
      case $arg in
        *" "*)
          case $arg in *[\$\`\\]*)
            echo "$0: over ssh, an argument with a space cannot hold \$, \` or \\ (the nodes' shell reads it in" \
              "double quotes): $arg" >&2
            exit 2 ;;
          esac
          quoted+=("$arg") ;;
        *) quoted+=("'${arg//\'/\'\\\'\'}'") ;;
      esac
    done
    set -- ${quoted[@]+"${quoted[@]}"}
  fi
fi
source "$(dirname "${BASH_SOURCE[0]}")/forward_signals.sh"
ranks_of() { deepspeed_ranks "$1"; }
run_forwarding deepspeed --hostfile "$hostfile" ${per_node[@]+"${per_node[@]}"} --master_addr "${MASTER_ADDR:-$first_host}" \
  --master_port "${MASTER_PORT:-29500}" --module pretrain.cli train "$@"
