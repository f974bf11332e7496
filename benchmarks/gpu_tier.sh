#!/usr/bin/env bash
# The GPU test tier (`python -m pytest -m gpu tests/gpu`) spread over every visible GPU.
# Usage (on the GPU machine, from anywhere): benchmarks/gpu_tier.sh [--workers N] [--timeout S]
#        [--dry-run] [pytest args...]
# Phase 1: the test files of tests/gpu/ are assigned greedily by weight (WEIGHTS below) to the
#   GPUs; one pytest per GPU runs at once with CUDA_VISIBLE_DEVICES=<that GPU>, N pytest-xdist
#   workers each (default 2; serial without pytest-xdist), the multi-GPU tests deselected.
# Phase 2: the multi-GPU tests, all GPUs visible, serially (those needing two GPUs skip on one).
#   Multi-GPU tests: every test (or module) marked skipif(...device_count() < 2...), found in the
#   source, plus ALL_GPU_TESTS below (tests meant to span all GPUs although one suffices).
# GPUs: `nvidia-smi -L` (torch.cuda.device_count() without nvidia-smi); a set
#   CUDA_VISIBLE_DEVICES names them instead. Logs: ${OUT:-/tmp/gpu-tier}/gpu<i>.log, multi.log;
#   a summary line per log (pytest's last line). Exit 1 if a pytest failed (rc 5, nothing
#   collected, is ok), 2 on usage errors or no GPU. --dry-run prints the commands only.
# Env: PYTHON (default python), OUT, SNAPSHOT (default 1: the tests run from a copy of the tree
#   taken at the start, benchmarks/tree_snapshot.sh; 0: from the tree itself).
set -uo pipefail

# Relative cost of each file (forward and backward megakernel files dominate); others weigh 1.
declare -A WEIGHTS=(
  [test_mok_forward.py]=6
  [test_mok_backward.py]=4
  [test_baselines_gpu.py]=2
)
ALL_GPU_TESTS=(
  "tests/gpu/test_harness_gpu.py::test_default_sweep_nccl_torch_on_all_gpus"
)

die() { echo "gpu_tier.sh: error: $*" >&2; exit 2; }

workers=2 timeout_s="" dry=0 extra=()
while (($#)); do
  case $1 in
    --workers) [[ ${2:-} =~ ^[0-9]+$ ]] || die "--workers needs a number"; workers=$2; shift 2 ;;
    --workers=*) workers=${1#*=}; [[ $workers =~ ^[0-9]+$ ]] || die "--workers needs a number"; shift ;;
    --timeout) [[ ${2:-} =~ ^[0-9]+$ ]] || die "--timeout needs seconds"; timeout_s=$2; shift 2 ;;
    --timeout=*) timeout_s=${1#*=}; [[ $timeout_s =~ ^[0-9]+$ ]] || die "--timeout needs seconds"; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) extra+=("$1"); shift ;;
  esac
done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || die "cannot enter $REPO"
out=${OUT:-/tmp/gpu-tier}
[[ $out == /* ]] || out=$REPO/$out  # the logs stay where they were asked, not in the copy
if ((!dry)); then  # from a copy of the tree (SNAPSHOT=0: from the tree itself)
  # shellcheck source=benchmarks/tree_snapshot.sh
  . "$REPO/benchmarks/tree_snapshot.sh"
  snapshot_tree || die "cannot copy $REPO"
  REPO=$PWD
fi
PY=${PYTHON:-python}
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# The GPUs, as the ids to put in CUDA_VISIBLE_DEVICES.
gpus=()
if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
  IFS=, read -ra gpus <<<"$CUDA_VISIBLE_DEVICES"
elif command -v nvidia-smi >/dev/null 2>&1; then
  n=$(nvidia-smi -L 2>/dev/null | grep -cE '^GPU [0-9]+:')
  for ((i = 0; i < n; i++)); do gpus+=("$i"); done
else
  n=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  for ((i = 0; i < n; i++)); do gpus+=("$i"); done
fi
ngpu=${#gpus[@]}
((ngpu > 0)) || die "no GPU visible (nvidia-smi -L lists none); run the GPU tier on a GPU machine"

# Test files, and the multi-GPU tests found in them (lines "file PATH" / "multi NODEID").
listing=$("$PY" - <<'EOF'
import ast, re, sys
from pathlib import Path
two = re.compile(r"device_count\(\)\s*<\s*2")
def multi(decorators):
    return any("skipif" in (s := ast.unparse(d)) and two.search(s) for d in decorators)
for path in sorted(Path("tests/gpu").glob("test_*.py")):
    tree = ast.parse(path.read_text(), str(path))
    whole = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark"
                                                  for t in n.targets)
                and multi(n.value.elts if isinstance(n.value, ast.List | ast.Tuple)
                          else [n.value])
                for n in tree.body)
    if whole:
        print("multi", path)
        continue
    print("file", path)
    for n in tree.body:
        if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name.startswith(("test", "Test")) \
                and multi(n.decorator_list):
            print("multi", f"{path}::{n.name}")
EOF
) || die "cannot list tests/gpu with $PY"

files=() multi=()
while read -r kind item; do
  if [[ $kind == file ]]; then files+=("$item"); else multi+=("$item"); fi
done <<<"$listing"
for t in "${ALL_GPU_TESTS[@]}"; do
  [[ -f ${t%%::*} && " ${multi[*]} " != *" $t "* ]] && multi+=("$t")
done
((${#files[@]} + ${#multi[@]})) || die "no test files in $REPO/tests/gpu"

# Greedy: heaviest file first, to the least loaded GPU (lowest index on ties).
sorted=$(for f in "${files[@]}"; do b=$(basename "$f"); echo "${WEIGHTS[$b]:-1} $f"; done \
         | sort -k1,1nr -k2,2)
declare -a load assigned
for ((g = 0; g < ngpu; g++)); do load[g]=0 assigned[g]=""; done
while read -r w f; do
  [[ -n $f ]] || continue
  best=0
  for ((g = 1; g < ngpu; g++)); do ((load[g] < load[best])) && best=$g; done
  load[best]=$((load[best] + w)) assigned[best]+="$f "
done <<<"$sorted"

common=(-v -m gpu)  # -v: a line per test, so a tier stopped early still names its failures
[[ -n $timeout_s ]] && common+=(--timeout "$timeout_s")
xdist=()
if ((workers > 0)) && "$PY" -c 'import xdist' >/dev/null 2>&1; then xdist=(-n "$workers"); fi
show() { printf '%q ' "$@"; }
((dry)) || mkdir -p "$out" || die "cannot create $out"
names=() pids=() rcs=()
trap 'kill "${pids[@]}" 2>/dev/null; exit 130' INT TERM

echo "phase 1: ${#files[@]} test files over $ngpu GPU(s), ${xdist[*]:-serial}"
for ((g = 0; g < ngpu; g++)); do
  [[ -n ${assigned[g]} ]] || continue
  read -ra mine <<<"${assigned[g]}"
  deselect=()
  for t in "${multi[@]}"; do
    [[ $t == *::* && " ${assigned[g]}" == *" ${t%%::*} "* ]] && deselect+=(--deselect "$t")
  done
  cmd=("$PY" -m pytest "${common[@]}" "${xdist[@]}" "${mine[@]}" "${deselect[@]}" "${extra[@]}")
  log=$out/gpu$g.log
  echo "phase1 gpu$g (weight ${load[g]}): CUDA_VISIBLE_DEVICES=${gpus[g]} $(show "${cmd[@]}")> $log"
  ((dry)) && continue
  CUDA_VISIBLE_DEVICES=${gpus[g]} "${cmd[@]}" >"$log" 2>&1 &
  names+=("$log") pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; rcs+=($?); done

if ((${#multi[@]})); then
  cmd=("$PY" -m pytest "${common[@]}" "${multi[@]}" "${extra[@]}")
  log=$out/multi.log
  echo "phase 2: ${#multi[@]} multi-GPU test(s), all $ngpu GPU(s) visible, serial"
  echo "phase2 all: $(show "${cmd[@]}")> $log"
  if ((!dry)); then
    "${cmd[@]}" >"$log" 2>&1
    rcs+=($?) names+=("$log")
  fi
fi
((dry)) && exit 0

fail=0
for i in "${!names[@]}"; do
  rc=${rcs[i]}
  last=$(grep -v '^[[:space:]]*$' "${names[i]}" | tail -1 | sed 's/^[[:space:]]*//')
  echo "$(basename "${names[i]}" .log): rc $rc: $last"
  ((rc == 0 || rc == 5)) || fail=1
done
((fail)) && echo "gpu_tier.sh: some pytest failed; logs in $out" >&2
exit "$fail"
