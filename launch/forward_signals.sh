# Sourced by the launchers (not run): `run_forwarding LAUNCHER...` starts a launcher (DeepSpeed's runner, torchrun)
# in a process group of its own, so that a terminal's ^C reaches the calling script alone; forwards SIGTERM and
# SIGINT to the processes `ranks_of LAUNCHER_PID` prints (the sourcing script defines it: the ranks, which finish
# their step, save a checkpoint and exit 75), or to the launcher itself until they exist, and before it is started
# ends the script; and exits with the launcher's status. `free_port` prints a port free on this host now: the
# rendezvous of a one-node launch, where a fixed 29500 made a second job on the node fail with EADDRINUSE.
free_port() {
  python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}
forward() {
  local targets=
  [ -n "${!:-}" ] || exit $((128 + $(kill -l "$1")))
  targets=$(ranks_of "$!")
  kill -s "$1" ${targets:-$!} 2>/dev/null || true
}
run_forwarding() {
  local launcher status
  trap 'forward TERM' TERM
  trap 'forward INT' INT
  set -m
  "$@" &
  launcher=$!
  while :; do
    status=0
    wait "$launcher" || status=$?
    kill -0 "$launcher" 2>/dev/null || exit "$status"  # still running: the wait was cut short by a forwarded signal
  done
}
# DeepSpeed's ranks are the children of its launch.py (on this node); the runner forwards no signal on one node, and
# launch.py, signalled itself, kills the ranks 30 s later and exits 1. Over ssh there is no launch.py here: the
# runner gets the signal and stops the remote ranks through pdsh.
deepspeed_ranks() {
  local launch
  launch=$(pgrep -d, -P "$1" -f deepspeed.launcher.launch || true)
  if [ -n "$launch" ]; then pgrep -d' ' -P "$launch" || echo "${launch//,/ }"; fi
}
