#!/usr/bin/env bash
# The GPU check as one call of the lent device machine, where nothing can be installed from a
# registry and the files that come back are few (8 at most, 2 folders down).
#
#   benchmarks/gpu_check_device.sh fetch   # here, once per checkout: submitit's and torchao's
#                                          # wheels into .whl/
#   benchmarks/gpu_check_device.sh run     # there: the device tool's command, with carry [".whl"]
#   benchmarks/gpu_check_device.sh run --only models parity   # a rerun of some parts
#
# `run` installs the carried wheels beside the machine's own torch, runs gpu_check.py (in a
# fresh work folder) with a time budget under a hard timeout, and leaves in $OUT:
# gpu_check.md, gpu_check.json, the log, nvidia-smi's view, and the records (results without
# traces) as one tar file. Its exit code is gpu_check.py's (1: a part failed).
set -uo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
fetch)
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
  # submitit is pure Python; its needs (cloudpickle, typing_extensions) are on the machine.
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp -d .whl 'submitit==1.5.4'
  # torchao's float8 path is Python; it declares no torch requirement (the compile part's
  # float8 runs need it).
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp -d .whl 'torchao==0.18.0'
  ls .whl
  ;;
run)
  : "${OUT:?run this on the device machine, where OUT is set}"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
  nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
  work=/tmp/gpu-check
  # A machine still up from an earlier call keeps its records; a rerun must measure again.
  rm -rf "$work"
  # 420 s of parts started, 540 s at most in all: the call's limit is 600 s.
  shift
  timeout -k 10 540 python3 benchmarks/gpu_check.py --out "$work" --budget-s 420 "$@" \
    2>&1 | tee "$OUT/gpu_check.log"
  status=${PIPESTATUS[0]}
  cp "$work"/gpu_check.md "$work"/gpu_check.json "$work"/allocator_history.json "$OUT"/ \
    2>/dev/null
  tar -czf "$OUT/records.tar.gz" -C "$work" --exclude=traces --exclude='*.pickle' results \
    2>/dev/null
  # rank 0's profiled CUDA steps, for tests that read a recorded trace (16 MiB a file back)
  tar -czf "$OUT/traces.tar.gz" -C "$work" --exclude='*.pickle' results/step_breakdown/traces \
    2>/dev/null
  [ "$(stat -c %s "$OUT/traces.tar.gz" 2>/dev/null || echo 0)" -lt 16000000 ] ||
    rm -f "$OUT/traces.tar.gz"
  exit "$status"
  ;;
*)
  echo "usage: $0 fetch|run" >&2
  exit 2
  ;;
esac
