#!/usr/bin/env bash
# Fill .gpu/ for a lent GPU machine (no package registry there; see ../shared/gpu/README.md), from the project root
# after `make setup`:
#
#   bash benchmarks/gpu_prepare.sh
#
# It runs ../shared/gpu/prepare.sh (DeepSpeed's wheel, pydantic and hjson, the shared data, the Trainer peer), then
# adds for Python 3.12 what that leaves out and the GPU suite needs there:
#   - the rest of DeepSpeed's own requirements, read from its wheel: `import deepspeed` fails without einops, which
#     such a machine lacks. What the machine has (torch, numpy, tqdm, psutil, packaging) is not shadowed.
#   - pytest and its requirements: the varlen stage runs the CUDA parity tests before measuring.
# On the GPU machine, `source .gpu/env.sh` installs every wheel of .gpu/wheels, these included.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED_GPU=${SHARED_GPU:-../shared/gpu}
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
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .gpu/wheels "${needs[@]}" 2> >(grep -v 'is ignored' >&2)
echo "[gpu_prepare] .gpu/wheels now also holds: ${needs[*]}"
du -sh .gpu
