#!/usr/bin/env bash
# Fill .gpu/ for a lent GPU machine (no package registry there; see ../shared/gpu/README.md), from the project root
# after `make setup`:
#
#   bash benchmarks/gpu_prepare.sh
#
# It runs ../shared/gpu/prepare.sh (DeepSpeed's wheel, pydantic and hjson, the shared data, the Trainer peer), then
# carries in .gpu/extra, for Python 3.12, what the suite needs there and a machine may lack: the rest of DeepSpeed's
# own requirements, read from its wheel (`import deepspeed` fails without einops: the lent machines' image has it,
# the machine ../shared/gpu/README.md describes does not), and pytest (the varlen stage's CUDA parity tests). `source
# .gpu/env.sh` there installs, after prepare.sh's wheels, only those of .gpu/extra that the machine has no version
# of: the machine's own packages (pytest and its plugins among them) are never shadowed. It also makes the suite's
# tokenizer of en-mix (.gpu/tokenizer-30522, 0.7 MB), which a bare machine would train again in every call.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED_GPU=${SHARED_GPU:-../shared/gpu}
# this script's own output: made again below, so nothing of an earlier run is left
rm -rf .gpu/wheels .gpu/extra .gpu/tokenizer-30522
bash "$SHARED_GPU/prepare.sh"

on_machine='^(torch|numpy|tqdm|psutil|packaging)$'  # what every lent machine has: never shadowed from /tmp/site
ds_wheel=$(ls .gpu/wheels/deepspeed-*.whl)
mapfile -t ds_needs < <(
  unzip -p "$ds_wheel" '*.dist-info/METADATA' | grep '^Requires-Dist:' | grep -v 'extra ==' |
    sed 's/^Requires-Dist: \([A-Za-z0-9_.-]*\).*/\1/' | sort -u | grep -Evi "$on_machine" || true
)
needs=()
for name in "${ds_needs[@]}" pytest iniconfig pluggy pygments; do
  # a wheel prepare.sh already put there (pydantic, hjson) stays as it chose it
  compgen -G ".gpu/wheels/$(echo "${name//-/_}" | tr '[:upper:]' '[:lower:]')-*.whl" >/dev/null || needs+=("$name")
done
mkdir -p .gpu/extra
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .gpu/extra "${needs[@]}" 2> >(grep -v 'is ignored' >&2)
cat >> .gpu/env.sh <<'ENV'
# benchmarks/gpu_prepare.sh: the wheels of .gpu/extra whose package this Python has no version of
python3 - <<'PY' | xargs -r python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site || return 1
import importlib.metadata as metadata, pathlib
for wheel in sorted(pathlib.Path(".gpu/extra").glob("*.whl")):
    try:
        metadata.distribution(wheel.name.split("-")[0])
    except metadata.PackageNotFoundError:
        print(wheel)
PY
ENV
# The Trainer peer that prepare.sh copies, in its best configuration: logging_nan_inf_filter (default True) reads the
# loss back to the host at every step to test it for nan/inf, a device sync per step that ours does not make
peer=.gpu/peer_hf_trainer.py
if [ -f "$peer" ] && ! grep -q logging_nan_inf_filter "$peer"; then
  chmod u+w "$peer"
  sed -i 's/dataloader_pin_memory=cuda)/dataloader_pin_memory=cuda, logging_nan_inf_filter=False)/' "$peer"
  grep -q logging_nan_inf_filter=False "$peer" || echo "[gpu_prepare] $peer: logging_nan_inf_filter not set" >&2
fi
# The suite's 30522-word tokenizer of en-mix, made here once: on a bare machine every call trained it again (13 s)
"${PY:-.venv/bin/python}" -m pretrain.cli tokenizer .gpu/data/corpus/en-mix.train.jsonl --out .gpu/tokenizer-30522 \
  --vocab-size 30522 >/dev/null
# The commit the suite's stage files record (.git may not travel with a call): run this again after a commit
git rev-parse --short=12 HEAD > .gpu/commit 2>/dev/null || rm -f .gpu/commit
echo "[gpu_prepare] .gpu/extra (installed there where missing): ${needs[*]}; .gpu/tokenizer-30522"
du -sh .gpu
