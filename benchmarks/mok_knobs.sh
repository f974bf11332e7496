#!/usr/bin/env bash
# MoK knob study on the GPU machine: one scenario, the mok backend under several configurations
# (JSON for $MOKBENCH_MOK_CONFIG, one per argument after the first). Rows -> $OUT/knob_rows.jsonl.
# Usage: benchmarks/mok_knobs.sh "<mokbench run flags>" '{"fwd_comm_sms": 16}' ...
set -uo pipefail
flags=$1; shift
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 COLUMNS=200
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp/out}
for cfg in "$@"; do
  # shellcheck disable=SC2086
  MOKBENCH_MOK_CONFIG=$cfg timeout -s INT 120 python -m mokbench.cli run --backends mok \
    --passes forward --timeout-s 90 --out /tmp/knobs $flags 2>&1 | grep -E "^ +(ok|failed|timeout)"
done
cat /tmp/knobs/*/rows.jsonl > "$out/knob_rows.jsonl"
