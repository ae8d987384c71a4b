#!/usr/bin/env bash
# The GPU measurement table of the issue, in stages of under 10 minutes each on one H100, and the markdown report.
#
#   bash benchmarks/gpu_suite.sh [--tiny] STAGE...        # stages run in the order given, each timed
#   bash benchmarks/gpu_suite.sh --tiny all               # the CPU rehearsal: every stage at tiny shapes, then report
#   bash benchmarks/gpu_suite.sh report                   # the markdown table from what the stages wrote
#   bash benchmarks/gpu_suite.sh [--tiny] collect DIR     # here, what a call sent back (DIR: the run's files_at)
#
# Stages (results in gpu-results/, or where $OUT is set in $GPU_SUITE_WORK/results, sent back as $OUT/results.tgz
# and $OUT/report.md; scratch runs in $GPU_SUITE_WORK, default /tmp/gpu-suite):
#   syncs      benchmarks/step_syncs.py on the device: host reads, syncs, copies in the non-logging steps (CUDA:
#              under torch.cuda.set_sync_debug_mode("error"))
#   base128    BERT-base, seq 128, batch 128: ours vs transformers' Trainer (eager); our MFU from metrics.jsonl
#   base128c   the same vs the Trainer under torch.compile
#   step       our trainer vs its own model step alone: benchmarks/train_throughput.py, base, batch 128
#   base512    BERT-base, seq 512, batch 32: ours vs the Trainer
#   rtd        rtd vs mlm tokens/s, BERT-mini, batch 1024
#   nsp        NSP segment pairs (padded) vs packed MLM, BERT-base, batch 128
#   fp8        train.precision=fp8 vs bf16, BERT-base, seq 128, batch 128: tokens/s and final loss (the CPU's
#              fp8 kernel is torch's reference one: the --tiny rehearsal takes a minute)
#   varlen     the unpadded encoder on flash attention's variable-length kernel: its parity tests against the padded
#              encoder and its attention dropout on CUDA (tests/test_varlen_attention.py), then padded vs unpadded at
#              40% padding, with and without attention dropout, and compiled (train_throughput.py --shapes padding)
#   graphs     our model step compiled with CUDA graphs (model.compile_mode=reduce-overhead) vs the default compile,
#              BERT-mini, batch 128, MLM+NSP (where kernel launches, not the device, set the pace; the GPU demo
#              trains BERT-mini at batch 128 too, MLM on an 8192 vocabulary)
#   local      sliding-window (window 128, every 3rd layer global) vs global attention, ModernBERT-style base
#              encoder at seq 1024: benchmarks/local_attention.py
#   demo       `make demo` (= pretrain run default-gpu where nvidia-smi finds a GPU), timed, its training held to
#              4 minutes (train.max_minutes) so that eval and finetune fit the call; its MLM loss against the unigram
#              entropy, on its corpus and on held-out text (en-mix.valid)
#   eval       pretrain eval of the demo's export on en-mix.valid, timed (runs the demo first if it is missing)
#   finetune   pretrain finetune of the demo's export on the mr task, 3 seeds, timed (likewise)
#   ablate     one chunk of `pretrain ablate configs/ablation-gpu.yaml` (runs/ablation-gpu): the runs that fit in
#              GPU_SUITE_ABLATE_MINUTES (default 7; stopped a minute later), then the record of every finished run,
#              without weights, as ONE archive, $OUT/ablation.tgz. `collect FILES_AT` here unpacks it as
#              runs/ablation-gpu; carried to the next machine, it is where the next chunk goes on from
# On a GPU machine (see ../shared/gpu/README.md) it sources .gpu/env.sh and reads the data under .gpu/data/: fill .gpu
# with `bash benchmarks/gpu_prepare.sh` on the machine that prepares the run.
#
# Calls: a session has 15 device minutes, the machine's start included, so one call of at most ~9 minutes. Each call
# carries .gpu (and runs/ablation-gpu for ablate), runs `bash benchmarks/gpu_suite.sh STAGES report` with
# timeout_s=600, and the suite stops itself at GPU_SUITE_DEADLINE (560 s; see below); then, here, `bash
# benchmarks/gpu_suite.sh collect FILES_AT`. Minutes are estimates for an H100 from the stages' step counts; measured
# on 2026-11-27 (before the bf16 fix): base128 4.9 (its first repeat ~3: ours 122 s, the Trainer 54 s), step 1.5,
# syncs ~3.5 for its 11 runs (~19 s each; more now that each run compiles from empty caches). The others: base128c,
# base512, nsp, fp8 ~5 each: 2 repeats of 2 runs, ours compiled; rtd ~4; varlen ~2.5; graphs ~1.5; local ~1.5; demo
# ~5.5, eval ~0.5, finetune ~1.5. In this order:
#   1. base128 step          ~6.5  the headline: ours vs the Trainer, and the trainer vs its own model step
#   2. syncs varlen graphs   ~7.5-9
#   3. rtd nsp               ~9    (nsp's second repeat may meet the deadline: its first is reported)
#   4. demo eval finetune    ~7.5  (one call: eval and finetune read the demo the same machine made)
#   5. fp8 local             ~6.5
#   6. base128c              ~5
#   7. base512               ~5    (apart: after base128c, base512's Trainer run would meet the deadline)
#   then `ablate` chunks until the record holds report.md. Only finished runs travel between machines, and one
#   pretrained run (start, 1.1-1.9 min of training, export, 3 tasks' fine-tunings and probes: ~4-5 min by the
#   estimates in configs/ablation-gpu.yaml, not yet timed) is about what a chunk holds: ~16-20 calls for its 20 runs
#   (the first chunk's timings will say). Where its log says a run took under ~3 minutes alone, the next chunks
#   try GPU_SUITE_ABLATE_JOBS=2: two runs side by side on the GPU (launch.jobs), whose fine-tunings and probes
#   (tiny batches) leave it mostly idle; its log's times say whether two fit a chunk
set -uo pipefail
suite_start=$(date +%s%3N)  # the deadline counts from here, or from the call's shell (below)
# On a lent machine ($OUT set) a call's 600 s start with its shell, and `source .gpu/env.sh` installs wheels before
# this script runs: where the parent is that shell, started within two minutes, the deadline counts from its start
if [ -n "${OUT:-}" ] && [[ "$(ps -o comm= -p "$PPID" 2>/dev/null)" =~ ^(bash|sh|dash)$ ]]; then
  parent_s=$(ps -o etimes= -p "$PPID" 2>/dev/null | tr -d ' ')
  [[ "$parent_s" =~ ^[0-9]+$ ]] && [ "$parent_s" -le 120 ] && suite_start=$((suite_start - parent_s * 1000))
fi
cd "$(dirname "$0")/.."
self=$PWD/benchmarks/gpu_suite.sh
tiny=0
stages=()
from=""
inner=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) tiny=1 ;;
    --in-stage) inner=$2; shift ;;  # the suite's own: one stage's body, in a child that the deadline can stop
    all) stages+=(syncs base128 base128c step base512 rtd nsp fp8 varlen graphs local demo eval finetune ablate report) ;;
    syncs|base128|base128c|step|base512|rtd|nsp|fp8|varlen|graphs|local|demo|eval|finetune|ablate|report) stages+=("$1") ;;
    collect) from=${2:?collect needs the directory of what a call sent back}; shift ;;
    *) echo "unknown stage or option: $1 (see the top of $0)" >&2; exit 2 ;;
  esac
  shift
done
[ ${#stages[@]} -gt 0 ] || [ -n "$from$inner" ] || { awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 2; }

if [ -f .gpu/env.sh ] && command -v nvidia-smi >/dev/null && [[ ":${PYTHONPATH:-}:" != *":/tmp/site:"* ]]; then
  source .gpu/env.sh || exit 1
fi
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then gpu=1; else gpu=0; export DS_ACCELERATOR=cpu; fi
# each stage's status names its device: a report collected from several calls may mix an H100 and an H200
device_name=$([ $gpu = 1 ] && nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr -d '"\\')
device_name=${device_name:-CPU}
# and the commit it ran: stages collected from several calls must be of one code (.git may not travel: the call's
# command can pass GPU_SUITE_COMMIT, and gpu_prepare.sh leaves .gpu/commit)
commit=${GPU_SUITE_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || cat .gpu/commit 2>/dev/null || echo unknown)}
export WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
DATA=${GPU_SUITE_DATA:-$([ -d .gpu/data ] && echo .gpu/data || echo ../shared/data)}
WORK=${GPU_SUITE_WORK:-/tmp/gpu-suite}
# The stages' files (3 each) gather in RES; a call sends back $OUT/results.tgz, all of them in one archive, and
# $OUT/report.md: a call returns at most 8 files, and 3 stages' files were 9
RES=${GPU_SUITE_RESULTS:-$([ -n "${OUT:-}" ] && echo "$WORK/results" || echo gpu-results)}
mkdir -p "$RES" "$WORK" ${OUT:+"$OUT"}
RES=$(cd "$RES" && pwd)
WORK=$(cd "$WORK" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Every stage but the report needs DeepSpeed, the varlen stage pytest: on a machine without them, say so at once
# rather than after the first stage has spent its minutes
if [ -z "$from$inner" ] && [[ " ${stages[*]} " != " report " ]] && ! missing=$($PY -c "import deepspeed, pytest" 2>&1 >/dev/null); then
  echo "[gpu_suite] $PY cannot import what the stages need: ${missing##*$'\n'}" >&2
  echo "[gpu_suite] (a lent GPU machine gets them from .gpu: run 'bash benchmarks/gpu_prepare.sh' here before carrying it)" >&2
  exit 2
fi

# Shapes: the issue's on a GPU; --tiny the same stages in seconds on a CPU (no figure of it means anything)
if [ $tiny = 1 ]; then
  corpus=data/us-speeches.public-domain.jsonl
  tvh=(--vocab 1024 --steps 6 --warm 2 --repeats 1)
  base=(--shape tiny --batch 8 --seq 64); base512=(--shape tiny --batch 4 --seq 128); mini=(--shape tiny --batch 16 --seq 64)
  step=(--shapes tiny --batch 8 --steps 1 --warmup 1 --repeats 2)
  demo=(tiny); finetune=(--seeds 1 --max-train 200 --epochs 1); eval=(--max-samples 64)
  local=(--shape tiny --seq 256 --batch 2 --repeats 2 --warmup 1 --unpadded)
  varlen=(--shapes padding --batch 8 --steps 1 --warmup 1 --repeats 2 --precision bf16)
  graphs=(--shapes tiny --batch 8 --steps 1 --warmup 1 --repeats 2 --precision bf16)
  ablation_dir=$WORK/ablation
  ablate=(configs/ablation-tiny.yaml "output_dir=$ablation_dir" launch.threads=1); ablate_minutes=${GPU_SUITE_ABLATE_MINUTES:-5}
  ablate_grace=600  # a loaded CPU: the stop is for a GPU call's limit
else
  corpus=$DATA/corpus/en-mix.train.jsonl
  # GPU_SUITE_REPEATS: alternated repeats of each trainer_vs_hf.py stage (2: a call of ~9 minutes holds 2 such
  # stages; 3 gives a true median where a call has the time)
  tvh=(--vocab 30522 --steps 150 --warm 50 --repeats "${GPU_SUITE_REPEATS:-2}")
  # gpu_prepare.sh's tokenizer of the corpus, carried in .gpu: not trained again on every bare machine
  [ -f .gpu/tokenizer-30522/tokenizer.json ] && tvh+=(--tokenizer .gpu/tokenizer-30522)
  base=(--shape base --batch 128 --seq 128); base512=(--shape base --batch 32 --seq 512); mini=(--shape mini --batch 1024 --seq 128)
  step=(--shapes base --batch 128 --repeats 5)
  # the demo's training stops at 4 minutes (its 4000 steps take ~2 on an H100, by the config's estimate): export,
  # its held-out loss, eval and 3 fine-tunings still fit the call; 7 left them 2 minutes of a 560-second call
  demo=(default-gpu train.max_minutes=4); finetune=(--seeds 3); eval=()
  # unpadded, as modernbert-base trains: on CUDA both arms run flash's variable-length kernel (the sliding arm with
  # its window), where padded local layers would take a banded, masked, slower path that no GPU preset trains with
  local=(--shape base --seq 1024 --batch 16 --repeats 7 --unpadded)
  varlen=(--shapes padding --repeats 5)
  graphs=(--shapes mini --repeats 5 --device cuda)
  ablation_dir=runs/ablation-gpu  # the config's output_dir
  ablate=(configs/ablation-gpu.yaml); ablate_minutes=${GPU_SUITE_ABLATE_MINUTES:-7}; ablate_grace=60
fi
# GPU_SUITE_ABLATE_JOBS: runs of the chunk at a time on the one GPU (launch.jobs; 1 by default: the first chunk times
# a run alone, and two that do not both finish in the chunk send nothing back)
ablate+=("launch.jobs=${GPU_SUITE_ABLATE_JOBS:-1}")
[ $gpu = 1 ] && step+=(--device cuda --compile) || step+=(--precision bf16)  # on a GPU the trainer compiles
[ $gpu = 1 ] && varlen+=(--device cuda --compile)  # compiled as the trainer runs there

# GPU_SUITE_DEADLINE: seconds from the suite's start after which no stage runs (by default, on a GPU with $OUT set,
# 560: a lent machine's command stops at 600 s, and whatever is still running then sends nothing back). A stage
# starts only if what is left covers its first figure on an H100 (an estimate: the first repeat, or the whole of a
# stage with none), else it is skipped, and the report says so; one that started is stopped (SIGTERM) before the
# deadline, so that the files it wrote after each repeat go back with the report. Where the call's limit is under
# 600 s (the device tool cuts it to the session's device time left: `status`'s budget_left_s), give the command
# GPU_SUITE_DEADLINE=<that limit - 40>: at 560 the call would be killed first, and send back only its last pack
deadline=${GPU_SUITE_DEADLINE:-$([ $gpu = 1 ] && [ -n "${OUT:-}" ] && echo 560 || echo 0)}
declare -A first=([syncs]=60 [base128]=180 [base128c]=180 [step]=120 [base512]=150 [rtd]=90 [nsp]=120 [fp8]=120
  [varlen]=90 [graphs]=90 [local]=60 [demo]=330 [eval]=45 [finetune]=90 [ablate]=180)
[ $tiny = 1 ] && for k in "${!first[@]}"; do first[$k]=5; done  # a tiny stage's figures take seconds
pack_s=25  # a stage's stop (SIGTERM, then 10 s to SIGKILL) and the archive and report after it

now() { date +%s%3N; }  # milliseconds
since() { local ms=$(( $(now) - $1 )); printf '%d.%03d' $((ms / 1000)) $((ms % 1000)); }  # seconds since $1

tvh() {  # tvh STAGE ARGS...: benchmarks/trainer_vs_hf.py into $RES/STAGE.json, sharing one tokenizer and shards
  local stage=$1; shift
  rm -rf "$WORK/tvh/runs-$stage"
  $PY benchmarks/trainer_vs_hf.py --work "$WORK/tvh" --tag "$stage" --corpus "$corpus" "${tvh[@]}" "$@" \
    --json "$RES/$stage.json"
}

demo_dir() { $PY -c "from pretrain.train.setup import load_config as l; print(l('${demo[0]}', ['output_dir=$WORK/demo']).run_dir)"; }

run_demo() {
  rm -rf "$WORK/demo"
  local start; start=$(now)
  $PY -m pretrain.cli run "${demo[@]}" "output_dir=$WORK/demo" || return $?
  local seconds; seconds=$(since "$start")
  $PY benchmarks/gpu_suite.py demo-summary --run "$(demo_dir)" --heldout "$DATA/corpus/en-mix.valid.jsonl" \
    --seconds "$seconds" "${eval[@]}" --json "$RES/demo.json"
}

need_demo() {  # the demo's export; run first where this invocation ran no demo stage (a failed one is not rerun)
  [ -f "$(demo_dir)/hf/config.json" ] && return 0
  if [ "${GPU_SUITE_DEMO_RAN:-0}" = 1 ]; then
    echo "[gpu_suite] the demo stage of this call made no export (see demo.log): nothing to run on" >&2
    return 1
  fi
  echo "[gpu_suite] no demo run here: running it first" >&2
  run_demo
}

send_record() {  # the ablation's record as ONE archive in $OUT: a call returns at most 8 files, 2 folders down,
  # with names of letters, digits, '.', '_', '-' alone; the record has dozens, 3 deep, named after arms (mlm+sop)
  [ -n "${OUT:-}" ] || { echo "[gpu_suite] no \$OUT: the record stays in $ablation_dir"; return 0; }
  tar czf "$OUT/.ablation.tgz.part" -C "$WORK/ablation-record" . || return 1
  mv -f "$OUT/.ablation.tgz.part" "$OUT/ablation.tgz" || return 1
  local bytes; bytes=$(stat -c %s "$OUT/ablation.tgz")
  echo "[gpu_suite] the record of $ablation_dir: \$OUT/ablation.tgz, $bytes bytes"
  [ "$bytes" -le $((16 * 1024 * 1024)) ] || { echo "[gpu_suite] over 16 MiB: it would not come back" >&2; return 1; }
}

pack() {  # RES as ONE archive in $OUT, and the report beside it, after every stage: what a cut call sends back
  [ -n "${OUT:-}" ] || return 0
  tar czf "$OUT/.results.tgz.part" -C "$RES" . && mv -f "$OUT/.results.tgz.part" "$OUT/results.tgz"
  $PY benchmarks/gpu_suite.py report "$RES" > "$OUT/.report.md.part" 2>&1
  mv -f "$OUT/.report.md.part" "$OUT/report.md"
}

collect() {  # collect DIR: what a call sent back (DIR: its files_at), unpacked here: its results join RES (a stage
  # it ran replaces that stage's earlier files), its ablation record becomes $ablation_dir, which the next call
  # carries and its ablate stage goes on from; then the report of every call collected so far
  local from=$1
  [ -d "$from" ] || { echo "[gpu_suite] collect: no directory $from" >&2; return 2; }
  if [ -f "$from/results.tgz" ]; then
    local tmp; tmp=$(mktemp -d)
    tar xzf "$from/results.tgz" -C "$tmp" || return 1
    local st name
    for st in "$tmp"/*.stage.json; do
      [ -e "$st" ] || continue
      name=$(basename "$st" .stage.json)
      # a stage this call skipped, or failed where an earlier call's finished, leaves the earlier files as they are
      if [ -f "$RES/$name.stage.json" ] && ! grep -q '"skipped"' "$RES/$name.stage.json" &&
        grep -q '"rc": 0,' "$RES/$name.stage.json" && { grep -q '"skipped"' "$st" || ! grep -q '"rc": 0,' "$st"; }; then
        echo "[gpu_suite] collect: $name kept from the earlier call (this one: $(cat "$st"))" >&2
        rm -f "$tmp/$name".*
        continue
      fi
      rm -f "$RES/$name".*
    done
    cp -R "$tmp"/. "$RES"/ && rm -rf "$tmp" || return 1
  fi
  if [ -f "$from/ablation.tgz" ]; then
    rm -rf "$ablation_dir" && mkdir -p "$ablation_dir" && tar xzf "$from/ablation.tgz" -C "$ablation_dir" || return 1
    echo "[gpu_suite] the ablation record is in $ablation_dir: carry it with .gpu to the next ablate call" >&2
  fi
  $PY benchmarks/gpu_suite.py report "$RES" | tee "$RES/report.md"
}

stage() {
  case "$1" in
    syncs)
      $PY benchmarks/step_syncs.py prepare --work "$WORK/syncs" &&
      rm -rf "$WORK/syncs/runs" &&
      TORCH_LOGS=recompiles $PY benchmarks/step_syncs.py run --work "$WORK/syncs" --json "$RES/syncs.json" \
        --runs mlm-fp32,mlm-bf16,span,rtd,plm,sop,unpadded,lamb,fp8,timers-on,allreduce-on ;;
    base128) tvh base128 "${base[@]}" --peers eager ;;
    base128c) tvh base128c "${base[@]}" --peers compile ;;
    step) $PY benchmarks/train_throughput.py "${step[@]}" --json "$RES/step.json" ;;
    base512) tvh base512 "${base512[@]}" --peers eager ;;
    rtd) tvh rtd "${mini[@]}" --objectives mlm,rtd --peers none ;;
    nsp) tvh nsp "${base[@]}" --objectives mlm,mlm+nsp --peers none ;;
    fp8) tvh fp8 "${base[@]}" --peers none --fp8 ;;
    varlen)  # the measurement runs whatever the tests say (its rates stay in the log); the stage fails with them,
      # and on a GPU with a skip too: a CUDA test skipped (a torch without the kernel's window support) checked nothing
      $PY -m pytest -q -rs -p no:cacheprovider tests/test_varlen_attention.py | tee "$WORK/varlen-tests.txt"
      local tests=${PIPESTATUS[0]}
      tail -1 "$WORK/varlen-tests.txt" | sed 's/^=* *//; s/ *=*$//' > "$RES/varlen.tests.txt"  # "6 passed, 5 skipped"
      if [ $gpu = 1 ] && grep -q skipped "$RES/varlen.tests.txt"; then
        echo "[gpu_suite] varlen: tests skipped on a GPU (reasons above): the stage fails" >&2
        tests=1
      fi
      $PY benchmarks/train_throughput.py "${varlen[@]}" --json "$RES/varlen.json" || return $?
      return $tests ;;
    graphs) $PY benchmarks/train_throughput.py "${graphs[@]}" --compile --cuda-graphs \
      --variants "ours + compile,ours + CUDA graphs" --json "$RES/graphs.json" ;;
    local) $PY benchmarks/local_attention.py "${local[@]}" --window 128 --json "$RES/local.json" ;;
    demo) run_demo ;;
    eval)
      need_demo || return $?
      local start; start=$(now)
      $PY -m pretrain.cli eval "$(demo_dir)/hf" --corpus "$DATA/corpus/en-mix.valid.jsonl" "${eval[@]}" \
        --json "$RES/eval.json" || return $?
      $PY benchmarks/gpu_suite.py add-seconds "$RES/eval.json" "$(since "$start")" ;;
    finetune)
      need_demo || return $?
      local start; start=$(now)
      $PY -m pretrain.cli finetune "$(demo_dir)/hf" "$DATA/tasks/mr" --mode full "${finetune[@]}" --json "$RES/finetune.json" \
        || return $?
      $PY benchmarks/gpu_suite.py add-seconds "$RES/finetune.json" "$(since "$start")" ;;
    ablate)  # a chunk: the runs that fit, then the record of every finished run (whatever the chunk's exit). A run
      # that overruns its estimate by $ablate_grace s is stopped (SIGTERM), so that the record goes back in the call
      $PY benchmarks/gpu_suite.py ablation-progress --json "$WORK/ablate-before.json" "${ablate[@]}" || return $?
      local minutes=$ablate_minutes limit=${GPU_SUITE_STAGE_LIMIT:-0} stop
      stop=$(awk "BEGIN {print $minutes * 60 + $ablate_grace}")
      if [ "$limit" -gt 0 ]; then  # the chunk, its grace and the record's copy (a minute) before the deadline
        minutes=$(awk "BEGIN {m = ($limit - $ablate_grace - 60) / 60; m = m < $minutes ? m : $minutes;
          print m > 0.1 ? m : 0.1}")
        stop=$(awk "BEGIN {s = $stop < $limit - 60 ? $stop : $limit - 60; print s > 1 ? s : 1}")
      fi
      timeout "$stop" $PY -m pretrain.cli ablate "${ablate[@]}" --within-minutes "$minutes"
      local rc=$?
      rm -rf "$WORK/ablation-record"
      $PY -m pretrain.cli ablate "${ablate[@]}" --copy-record "$WORK/ablation-record" || return $?
      send_record || return $?
      $PY benchmarks/gpu_suite.py ablation-progress --before "$WORK/ablate-before.json" --json "$RES/ablate.json" \
        "${ablate[@]}" || return $?
      return $rc ;;
    report) $PY benchmarks/gpu_suite.py report "$RES" 2>&1 | tee "${OUT:-$RES}/report.md" ;;
  esac
}

status_json() {  # status_json STAGE RC SECONDS [EXTRA]: the stage's status file, which the report reads
  printf '{"stage": "%s", "rc": %d, "seconds": %.1f, "tiny": %s, "gpu": %s, "device": "%s", "commit": "%s"%s}\n' \
    "$1" "$2" "$3" "$([ $tiny = 1 ] && echo true || echo false)" "$([ $gpu = 1 ] && echo true || echo false)" \
    "$device_name" "$commit" "${4:-}" > "$RES/$1.stage.json"
}

run_stage() {  # run_stage STAGE: its body in a child, within what the deadline leaves; its log and status
  local s=$1 limit=0 left rc start seconds cut=false
  rm -f "$RES/$s".*  # an earlier run's files of this stage would read as this run's
  if [ "$deadline" -gt 0 ]; then
    left=$(( deadline - ($(now) - suite_start) / 1000 - pack_s ))
    if [ "$left" -lt "${first[$s]}" ]; then
      local why="$((left > 0 ? left : 0)) s left before the deadline (GPU_SUITE_DEADLINE=$deadline)"
      why+=", it needs about ${first[$s]} s"
      echo "[gpu_suite] stage $s skipped: $why" >&2
      status_json "$s" 0 0 ", \"skipped\": \"$why\""
      return 1
    fi
    limit=$left
  fi
  echo "[gpu_suite] stage $s ($([ $tiny = 1 ] && echo tiny || echo full), $([ $gpu = 1 ] && echo GPU || echo CPU))" \
    "$([ $limit -gt 0 ] && echo "within $limit s")" >&2
  start=$(now)
  local child=(bash "$self" $([ $tiny = 1 ] && echo --tiny) --in-stage "$s")
  if [ $limit -gt 0 ]; then
    GPU_SUITE_DEMO_RAN=$demo_ran GPU_SUITE_STAGE_LIMIT=$limit timeout -k 10 "$limit" "${child[@]}" > "$RES/$s.log" 2>&1
  else
    GPU_SUITE_DEMO_RAN=$demo_ran "${child[@]}" > "$RES/$s.log" 2>&1
  fi
  rc=$?
  if [ "$s" = demo ]; then demo_ran=1; fi  # it started: eval and finetune after it take its export, or nothing
  seconds=$(since "$start")
  [ $limit -gt 0 ] && { [ $rc = 124 ] || [ $rc = 137 ]; } && cut=true
  status_json "$s" $rc "$seconds" ", \"deadline\": $cut"
  echo "[gpu_suite] stage $s: exit $rc in ${seconds%.*} s$($cut && echo ", stopped at the deadline")" \
    "(log: $RES/$s.log)" >&2
  [ $rc = 0 ] || { tail -20 "$RES/$s.log" >&2; return 1; }
}

demo_ran=0
if [ -n "$inner" ]; then stage "$inner"; exit $?; fi
if [ -n "$from" ]; then collect "$from"; exit $?; fi
status=0
for s in "${stages[@]}"; do
  if [ "$s" = report ]; then stage report || status=1; continue; fi
  run_stage "$s" || status=1
  pack
done
exit $status
