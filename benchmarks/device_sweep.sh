#!/usr/bin/env bash
# One machine lease: calibrate, run a sweep, bring back the run folder's files.
# Usage (on the GPU machine, from the repo root): benchmarks/device_sweep.sh SWEEP_FILE [mokbench sweep args...]
# Env: OUT (where the files go), MB_ROOT (run folders' root, default /tmp/mb), SWEEP_LIMIT_S,
# SNAPSHOT (default 1: run from a copy of the tree, benchmarks/tree_snapshot.sh; 0: from the tree).
# Writes to $OUT: sweep.log and run.tgz (the whole run folder: rows, env.json, sweep file, cell logs).
# te rows need TransformerEngine, megatron_alltoall and hybridep_megatron rows Megatron-Core too:
# install them there first (without a package index: benchmarks/offline_wheels.sh, README Set up).
set -uo pipefail
sweep=$1; shift
out=${OUT:-/tmp/out}
root=${MB_ROOT:-/tmp/mb}  # one root per concurrent sweep; one sweep over all GPUs: pass --parallel N
mkdir -p "$out" "$root" && out=$(cd "$out" && pwd) && root=$(cd "$root" && pwd)
# shellcheck source=benchmarks/tree_snapshot.sh
. "$(dirname "${BASH_SOURCE[0]}")/tree_snapshot.sh"
snapshot_tree || { echo "device_sweep.sh: cannot copy the tree" >&2; exit 2; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 COLUMNS=200
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout -s INT "${SWEEP_LIMIT_S:-540}" python -m mokbench.cli sweep "$sweep" --calibrate --out "$root" "$@" 2>&1 | tee "$out/sweep.log" \
  | grep -v "━" | tail -60
run=$(ls -d "$root"/*/ | tail -1)  # a run stopped by the limit can be completed with --resume
tar czf "$out/run.tgz" -C "$(dirname "$run")" "$(basename "$run")"
