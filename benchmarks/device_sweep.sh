#!/usr/bin/env bash
# One machine lease: calibrate, run a sweep, bring back the run folder's files.
# Usage (on the GPU machine, from the repo root): benchmarks/device_sweep.sh SWEEP_FILE [mokbench sweep args...]
# Writes to $OUT: rows.jsonl env.json sweep.toml sweep.log cells.tgz (cell logs).
set -uo pipefail
sweep=$1; shift
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 COLUMNS=200
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp/out}
timeout -s INT "${SWEEP_LIMIT_S:-540}" python -m mokbench.cli sweep "$sweep" --calibrate --out /tmp/mb "$@" 2>&1 | tee "$out/sweep.log" \
  | grep -v "━" | tail -60
run=$(ls -d /tmp/mb/*/ | tail -1)  # a run stopped by the limit can be completed with --resume
cp "$run"/rows.jsonl "$run"/env.json "$run"/sweep.* "$out"/
tar czf "$out/cells.tgz" -C "$run" cells
