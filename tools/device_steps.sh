#!/bin/bash
# One call on the H200 (the device tool): the CuTe DSL environment, then each line of a steps file
# as `step SECONDS NAME COMMAND...`, each under its own time limit with its log under $OUT (runs/
# unless set; the bench scripts write their JSON there too), the logs' tails and a line per step
# last. The device copy has no .git: pass the commit. BUNDLE=1 packs $OUT into one runs.tgz at the
# end, for a caller that takes back only a few files (a timeline step alone writes three).
# KERNELS=archive.tar.xz: the kernel cache (FLASHMASK3_KERNEL_CACHE) filled on a machine without a
# GPU, so that the steps load their kernels instead of compiling them, packed small for the trip:
#
#   FLASHMASK3_KERNEL_CACHE=/tmp/kernels python scripts/bench_bwd.py check --compile-only
#   tar cJf kernels.tar.xz -C /tmp/kernels .
#
#   COMMIT=$(git rev-parse --short HEAD) BUNDLE=1 bash tools/device_steps.sh steps.txt
#
# steps.txt, e.g.:
#   step 60 fwd_check python scripts/bench_fwd.py check
#   step 200 fwd_ablate python scripts/bench_fwd.py ablate --masks full,causal --variants tree_max=true
#   step 110 ncu_bwd $NCU --clock-control none -k regex:FlashMaskBackward -c 1 --section SpeedOfLight python scripts/bench_bwd.py profile --masks full
set -u
steps=${1:?usage: COMMIT=<sha> bash tools/device_steps.sh STEPS_FILE}
bash .dsl/dsl-env.sh >/dev/null
# The copy is not pip-installed: import the package from a link tree of its installed layout.
python3 "$(dirname "$0")/package_tree.py" build/package >/dev/null
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/build/package PYTHONUNBUFFERED=1
export FLASHMASK3_COMMIT=${COMMIT:?set COMMIT to the commit being run}
export OUT=${OUT:-runs}
if [ -n "${KERNELS:-}" ]; then
    mkdir -p /tmp/kernels && tar xJf "$KERNELS" -C /tmp/kernels && export FLASHMASK3_KERNEL_CACHE=/tmp/kernels
fi
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
export NCU
step() {
    local limit=$1 name=$2 start
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name rc=$? $(( $(date +%s) - start ))s" >> "$OUT/steps.txt"
}
source "$steps"
for log in "$OUT"/*.log; do echo "##### $log"; tail -"${TAILN:-25}" "$log"; done
cat "$OUT/steps.txt"
if [ "${BUNDLE:-0}" = 1 ]; then
    bundle=$(mktemp -d)/runs.tgz
    tar czf "$bundle" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$bundle" "$OUT/"
fi
