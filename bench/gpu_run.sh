#!/usr/bin/env bash
# The GPU benchmark on the device machine, from the repository root, with .gpu/ carried along
# (made here by `make gpu-wheels`). Installs the wheels into /tmp/site (once per machine), runs
# `python -m bench --device cuda ARGS...` with PYTHONPATH=/tmp/site:$PWD and writes the report,
# the benchmark's log and the servers' logs under $OUT (the device's folder that comes back;
# default .cache/bench/out), the report as $OUT/BENCHMARKS-gpu.md unless --output says.
#
# Rehearse first, here on the CPU (the same runs on tiny models, 40 s; a test runs it too):
#   .venv/bin/python -m bench --device cuda --rehearse
# Then there, one call each:
#   bash bench/gpu_run.sh --only encoder --output "$OUT/gpu-encoder.md"   # fp32, then fp16
#   bash bench/gpu_run.sh --only generation --output "$OUT/gpu-generation.md"
#   bash bench/gpu_run.sh --only generation --server-arg=--torch_compile \
#       --output "$OUT/gpu-generation-compiled.md"   # the decode step compiled inside the graphs
#   bash bench/gpu_run.sh --only lora --output "$OUT/gpu-lora.md"   # adapter rows in the graphs
#   bash bench/gpu_run.sh --tests     # the `gpu`-marked tests instead, log in $OUT/gpu-tests.log
set -euo pipefail
OUT=${OUT:-.cache/bench/out}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
SITE=/tmp/site
CACHE=${BENCH_CACHE:-.cache/bench}

if [ ! -f "$SITE/.installed" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .gpu/whl/*.whl
    touch "$SITE/.installed"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

if [ "${1:-}" = "--tests" ]; then  # the files that hold them: the others need the CPU's tools
    files=$(grep -rl --include='*.py' 'mark.gpu' tests | sort)
    status=0
    # shellcheck disable=SC2086
    "$PYTHON" -m pytest -p no:cacheprovider -m gpu -rA $files 2>&1 \
        | tee "$OUT/gpu-tests.log" || status=$?
    exit "$status"
fi

case " $* " in
    *" --output "*|*" --output="*) output=() ;;
    *) output=(--output "$OUT/BENCHMARKS-gpu.md") ;;
esac
status=0
"$PYTHON" -m bench --device cuda --cache "$CACHE" "${output[@]}" "$@" 2>&1 \
    | tee "$OUT/bench-$(date +%H%M%S).log" || status=$?
tar -czf "$OUT/server-logs-$(date +%H%M%S).tar.gz" -C "$CACHE" logs 2>/dev/null || true
exit "$status"
