#!/usr/bin/env bash
# GPU check for kvoffload's vLLM plug-in, for a lent device with no vLLM and no network.
#
#   scripts/gpu_check.sh prepare   # here, where vLLM 0.33 is installed in .venv:
#                                  # fills build/gpu_carry (git-ignored) with what the device lacks
#   scripts/gpu_check.sh           # on the device (carry build/gpu_carry): runs the checks
#   PYTHONPATH=src:build/gpu_carry python scripts/gpu_check.py --cpu-smoke   # dry run, no GPU
#
# On the device it runs, writing everything under $OUT (default ./gpu_check_out):
#   1. scripts/gpu_check.py: kvoffload's vLLM worker (KVOffloadWorker) on CUDA KV tensors with
#      pinned host memory, every byte compared after a store/load round trip; then
#      GPU<->pinned-CPU bandwidth of kvoffload's store/load jobs per block size against one bulk
#      cudaMemcpy of the same bytes (GB/s and ratio)  -> gpu_check.json, gpu_check.txt
#   2. pytest -m cuda on the test files that hold CUDA tests        -> pytest_cuda.txt
#
# build/gpu_carry holds, copied from the installed packages at prepare time (never committed):
# vLLM's vllm/v1/kv_offload/{base,config}.py and the three small modules they import (the
# worker's base classes), and the pure-Python test tools (pytest and its plugins, hypothesis).
# It goes last on PYTHONPATH, so the device's own packages win.
#
# Run from the device tool as, e.g.:
#   run(command="bash scripts/gpu_check.sh", carry=["build/gpu_carry"], timeout_s=420)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CARRY="$ROOT/build/gpu_carry"

prepare() {
    local py="$ROOT/.venv/bin/python"
    local site
    site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    rm -rf "$CARRY"
    mkdir -p "$CARRY"
    local f
    for f in vllm/v1/kv_offload/base.py vllm/v1/kv_offload/config.py \
             vllm/v1/kv_hints/__init__.py vllm/v1/kv_hints/protocol.py \
             vllm/v1/metrics/cache_hit_source.py; do
        mkdir -p "$CARRY/$(dirname "$f")"
        cp "$site/$f" "$CARRY/$f"
    done
    # Empty package markers: vllm/__init__.py would import all of vLLM.
    for d in vllm vllm/v1 vllm/v1/kv_offload vllm/v1/metrics; do
        : > "$CARRY/$d/__init__.py"
    done
    for p in _pytest pytest pluggy iniconfig packaging pytest_timeout.py msgspec \
             hypothesis attr attrs sortedcontainers; do
        [ -e "$site/$p" ] && cp -r "$site/$p" "$CARRY/"
    done
    find "$CARRY" -name __pycache__ -prune -exec rm -rf {} +
    du -sh "$CARRY"
}

run_checks() {
    local out="${OUT:-$ROOT/gpu_check_out}"
    mkdir -p "$out"
    local py="${PYTHON:-python3}"
    cd "$ROOT" || exit 1
    export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}:$CARRY"
    {
        echo "== $(date -u) on $(hostname)"
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
        "$py" -c 'import sys, torch, numpy; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
    } 2>&1 | tee "$out/env.txt"
    local rc=0
    timeout 300 "$py" scripts/gpu_check.py --out "$out" 2>&1 | tee "$out/gpu_check.txt"
    rc=${PIPESTATUS[0]}
    local files
    files="$(grep -rl 'pytest.mark.cuda' tests || true)"
    if [ -n "$files" ] && "$py" -c 'import pytest' 2>/dev/null; then
        # shellcheck disable=SC2086
        timeout 240 "$py" -m pytest -q -m cuda -p no:cacheprovider $files 2>&1 | tee "$out/pytest_cuda.txt"
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    else
        echo "pytest -m cuda not run (no pytest, or no CUDA test files)" | tee "$out/pytest_cuda.txt"
    fi
    echo "gpu_check rc=$rc" | tee -a "$out/gpu_check.txt"
    return "$rc"
}

case "${1:-run}" in
    prepare) prepare ;;
    run) run_checks ;;
    *) echo "usage: $0 [prepare|run]" >&2; exit 2 ;;
esac
