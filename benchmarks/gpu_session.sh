#!/usr/bin/env bash
# One time-limited GPU session, run in the background so that short calls can feed and watch it:
# install TransformerEngine and Megatron-Core from carried batches (beside the GPU tier), run
# the GPU tier, then timing commands, then a sweep that stops in time for its files to be packed.
#
# Usage (on the GPU machine, from the repo root):
#   benchmarks/gpu_session.sh start [--until S] [--te STORE] [--deepep TGZ] [--tier S]
#                                   [--commands FILE] [--sweep FILE]... [-- SWEEP_ARGS...]
#   benchmarks/gpu_session.sh report [--wait S] [--pack DIR]
#   benchmarks/gpu_session.sh cut
#
# start    begins the session in a new process session (it outlives the call) and returns; when
#          one was already begun in STATE it says so and returns 0, so every call of a lease can
#          begin with it and the first call that gets a machine starts the work. Steps, in order:
#   --te STORE      (beside the tier) offline_wheels.sh install --wait until the deadline, STORE
#                   being filled by `offline_wheels.sh gather batch-N STORE` calls meanwhile; the
#                   sweeps wait for it, since te / megatron rows need it (the tier and the
#                   commands run beside it: they time mok and torch only)
#   --deepep TGZ    (beside the tier) a DeepEP checkout packed as TGZ (one top folder, e.g.
#                   `git archive --prefix=DeepEP/ hybrid-ep | gzip`) unpacked and built with
#                   build_deepep.sh --check; the sweeps wait for it and run with the shared
#                   libstdc++ preloaded (README "Optional: DeepEP and HybridEP": a build that
#                   links it statically crashes in HybridEPBuffer otherwise)
#   --tier S        benchmarks/gpu_tier.sh --workers 4 $TIER_ARGS, stopped after S seconds; with
#                   --te, the tier's TE and Megatron-Core tests (which would import them while
#                   pip installs them) run instead once the install is done (te-check), or,
#                   with --sweep, are left to the sweeps' te and megatron rows, each checked
#                   against the reference before it is timed
#   --commands FILE each line (blank lines and # comments skipped) run by bash, at most
#                   COMMAND_S seconds (default 300),
#                   PYTHONPATH = the tree and benchmarks/, skipped once less than 60 s is left
#   --sweep FILE    benchmarks/device_sweep.sh FILE SWEEP_ARGS, its limit the time left less 45 s
#                   for packing (skipped under 120 s); repeated, the sweeps run one after the
#                   other, each with the time the ones before it left
#   --until S       every step ends S seconds after the start (default 1500)
# report   waits until the session is done or S seconds pass (default 0), prints each step's
#          line and the logs' ends; --pack DIR writes DIR/logs.tgz (every log) and, for each
#          sweep that has packed its run folder, DIR/run-N.tgz (N = its place on the line);
#          for a sweep still running, DIR/run-N.partial.tgz: its run folder as it stands (the
#          finished cells' rows and logs), so that a machine lost before the sweep's end loses
#          only the cells unfinished at the last report (`mokbench report` makes its tables,
#          `mokbench sweep --resume` runs the rest).
# cut      ends the session early to fit the device time left: the running sweep is
#          interrupted as its time limit would (finished cells kept, its run folder packed)
#          and no later command or sweep starts; then `report --wait 60 --pack DIR`. (Not
#          `pkill -f` from the call itself: its own command line matches the pattern.)
#
# Env: STATE (default /tmp/gpu-session: session.log, te.log, deepep.log, tier.log and tier/, commands.log,
# sweep-N/, done), TIER_ARGS (pytest arguments for the tier, split as a command line is, so
# quotes keep a word whole: -k "fp8 or split"), MOKBENCH_GIT_SHA (the commit the log names; a
# copy of the tree may carry an older .git),
# COMMAND_S (each command's limit, default 300 s; a command stopped by it logs rc=124).
# The session runs from a copy of the tree taken at the start (benchmarks/tree_snapshot.sh), so
# a later call that re-sends the tree cannot change what it runs.
set -uo pipefail

PROG=gpu_session.sh
die() { echo "$PROG: error: $*" >&2; exit 2; }
STATE=${STATE:-/tmp/gpu-session}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# TIER_ARGS as the words of a command line (quotes keep a word whole), one per line.
tier_words() {
  local words=()
  eval "words=(${TIER_ARGS:-})" 2>/dev/null || {
    echo "$PROG: error: TIER_ARGS: cannot split '${TIER_ARGS:-}'; allowed pytest arguments" \
      "as on a command line, e.g. -k \"fp8 or split\"" >&2
    return 2
  }
  ((${#words[@]} == 0)) || printf '%s\n' "${words[@]}"
}

number() { [[ $2 =~ ^[0-9]+$ ]] || die "$1: got '$2'; allowed a whole number of seconds"; }

cmd_start() {
  local until_s=1500 te="" deepep="" tier_s=0 commands="" sweeps=() sweep_args=()
  while (($#)); do
    case $1 in
      --until) number --until "${2:-}"; until_s=$2; shift 2 ;;
      --te) [[ -n ${2:-} ]] || die "--te needs a STORE folder"; te=$2; shift 2 ;;
      --deepep) [[ -f ${2:-} ]] || die "--deepep: no such file: '${2:-}'; allowed a .tgz of a DeepEP checkout"
        deepep=$(cd "$(dirname "$2")" && pwd)/$(basename "$2"); shift 2 ;;
      --tier) number --tier "${2:-}"; tier_s=$2; shift 2 ;;
      --commands) [[ -f ${2:-} ]] || die "--commands: no such file: '${2:-}'"
        commands=$(cd "$(dirname "$2")" && pwd)/$(basename "$2"); shift 2 ;;
      --sweep) [[ -f ${2:-} ]] || die "--sweep: no such file: '${2:-}'"; sweeps+=("$2"); shift 2 ;;
      --) shift; sweep_args=("$@"); break ;;
      *) die "start: unknown argument '$1'; allowed --until, --te, --deepep, --tier, --commands, --sweep, --" ;;
    esac
  done
  tier_words >/dev/null || exit 2
  mkdir -p "$STATE" || die "cannot make $STATE"
  if ! mkdir "$STATE/begun" 2>/dev/null; then  # atomic: one session per STATE
    echo "$PROG: a session was already begun in $STATE ($( [[ -e $STATE/done ]] && echo done || echo running))"
    return 0
  fi
  cd "$REPO" || die "cannot enter $REPO"
  local IFS=$'\n'  # the sweep files, one per line, in one argument
  setsid nohup bash "$REPO/benchmarks/gpu_session.sh" _run "$until_s" "$te" "$deepep" "$tier_s" \
    "$commands" "${sweeps[*]}" "${sweep_args[@]}" >"$STATE/session.out" 2>&1 </dev/null &
  echo "$PROG: session begun in $STATE (pid $!), every step over $until_s s after now"
}

# What the tier's pytest logs (-v: one line per test) say: pytest's summary lines, or, for a
# tier its time limit stopped before any summary, the outcomes counted so far and the tests
# that failed, so that a stopped tier still names its failures.
tier_outcome() {
  local summary
  summary=$(grep -h -E '^=+ .*[0-9]+ (passed|failed|errors?)' "$@" 2>/dev/null | tr -d '=' \
            | tr -s ' \n' ' ')
  if [[ -n $summary ]]; then echo "$summary"; return; fi
  echo "stopped early: $(grep -h -o -E ' (PASSED|FAILED|ERROR|SKIPPED) ' "$@" 2>/dev/null \
    | sort | uniq -c | tr -s ' \n' ' ')failures: $(grep -h -o -E '(FAILED|ERROR) tests/[^ ]+' \
    "$@" 2>/dev/null | cut -d' ' -f2 | tr '\n' ' ')"
}

# The session itself (start runs it in the background).
cmd_run() {
  local until_s=$1 te=$2 deepep=$3 tier_s=$4 commands=$5 sweeps=(); shift 5
  [[ -z $1 ]] || mapfile -t sweeps <<<"$1"
  shift
  local t0=$SECONDS deadline=$((SECONDS + until_s)) te_pid="" deepep_pid=""
  log() { echo "$(date +%T) +$((SECONDS - t0))s $*" >>"$STATE/session.log"; }
  left() { echo $((deadline - SECONDS)); }
  # shellcheck source=benchmarks/tree_snapshot.sh
  . "$REPO/benchmarks/tree_snapshot.sh"
  snapshot_tree || { log "cannot copy the tree"; touch "$STATE/done"; exit 1; }
  export PYTHONUNBUFFERED=1 SNAPSHOT=0  # the steps run from this copy as it is
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  local sha=${MOKBENCH_GIT_SHA:-$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')}
  log "begun at $sha, until +${until_s}s"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,clocks.max.sm,power.limit \
    --format=csv,noheader >>"$STATE/session.log" 2>&1
  if [[ -n $te ]]; then
    (log "te: waiting for the batches in $te"
     bash benchmarks/offline_wheels.sh install --wait "$(left)" "$te" >"$STATE/te.log" 2>&1
     rc=$?; echo "$rc" >"$STATE/te.rc"
     log "te: rc=$rc ($(tail -1 "$STATE/te.log"))") &
    te_pid=$!
  fi
  if [[ -n $deepep ]]; then
    (log "deepep: building $(basename "$deepep")"
     src=$STATE/deepep-src
     rm -rf "$src" && mkdir -p "$src" && tar xzf "$deepep" -C "$src" \
       && bash benchmarks/build_deepep.sh --check "$(ls -d "$src"/*/ | head -1)" \
            >"$STATE/deepep.log" 2>&1
     rc=$?; echo "$rc" >"$STATE/deepep.rc"
     log "deepep: rc=$rc ($(grep -E 'built|error' "$STATE/deepep.log" 2>/dev/null | tail -1))") &
    deepep_pid=$!
  fi
  # The tier's tests of TE and Megatron-Core would import them while pip installs them: with
  # --te they leave the tier and run once the install is done (te-check, below).
  local te_tests=tests/gpu/test_baselines_gpu.py::test_library_baseline_passes_check
  local tier_te=(); [[ -z $te ]] || tier_te=(--deselect "$te_tests")
  if ((tier_s > 0)); then
    log "tier: begun (at most ${tier_s}s${te:+; TE's and Megatron's tests after their install})"
    local tier_args=()
    mapfile -t tier_args < <(tier_words)
    OUT=$STATE/tier timeout "$tier_s" bash benchmarks/gpu_tier.sh --workers 4 "${tier_args[@]}" \
      "${tier_te[@]}" >"$STATE/tier.log" 2>&1
    log "tier: rc=$? ($(tier_outcome "$STATE"/tier/*.log))"
  fi
  if [[ -n $commands ]]; then
    export PYTHONPATH=$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}
    local line
    while IFS= read -r line || [[ -n $line ]]; do
      [[ -z ${line// /} || $line == \#* ]] && continue
      if [[ -e $STATE/cut ]]; then log "command skipped (cut): $line"; continue; fi
      if (($(left) < 60)); then log "command skipped (time): $line"; continue; fi
      echo "== $line" >>"$STATE/commands.log"
      local cap=${COMMAND_S:-300}
      timeout "$(($(left) < cap ? $(left) : cap))" bash -c "$line" >>"$STATE/commands.log" 2>&1
      log "command rc=$?: $line"
    done <"$commands"
  fi
  [[ -z $te_pid ]] || wait "$te_pid"
  [[ -z $deepep_pid ]] || wait "$deepep_pid"
  if [[ -n $deepep ]]; then  # HybridEP built against a static libstdc++ needs the shared one
    local libstdcxx
    libstdcxx=$(g++ -print-file-name=libstdc++.so.6 2>/dev/null)
    if [[ $libstdcxx == /* && -e $libstdcxx ]]; then
      export LD_PRELOAD=$libstdcxx
      log "sweeps: LD_PRELOAD=$libstdcxx"
    fi
  fi
  if ((tier_s > 0)) && [[ -n $te && $(cat "$STATE/te.rc" 2>/dev/null) == 0 ]]; then
    if ((${#sweeps[@]})); then  # every te / megatron row of a sweep passes the same check
      log "te-check: left to the sweeps (their te and megatron rows are checked first)"
    elif (($(left) < 360)); then
      log "te-check skipped (time)"
    else
      timeout 300 python -m pytest -v -m gpu "$te_tests" >"$STATE/te-check.log" 2>&1
      log "te-check: rc=$? ($(tier_outcome "$STATE/te-check.log"))"
    fi
  fi
  local n=0 sweep limit
  for sweep in "${sweeps[@]}"; do
    n=$((n + 1)) limit=$(($(left) - 45))
    if [[ -e $STATE/cut ]]; then log "sweep-$n skipped (cut): $sweep"; continue; fi
    if ((limit < 120)); then
      log "sweep-$n skipped: ${limit}s left for $sweep"
      continue
    fi
    log "sweep-$n: $sweep (limit ${limit}s)"
    OUT=$STATE/sweep-$n MB_ROOT=$STATE/mb-$n SWEEP_LIMIT_S=$limit \
      bash benchmarks/device_sweep.sh "$sweep" "$@" >"$STATE/sweep-$n.out" 2>&1
    log "sweep-$n: rc=$? ($(grep -c -E '^ +(ok|fail)' "$STATE/sweep-$n/sweep.log" 2>/dev/null) rows)"
  done
  log "done"
  touch "$STATE/done"
}

cmd_report() {
  local wait_s=0 pack=""
  while (($#)); do
    case $1 in
      --wait) number --wait "${2:-}"; wait_s=$2; shift 2 ;;
      --pack) [[ -n ${2:-} ]] || die "--pack needs a folder"; pack=$2; shift 2 ;;
      *) die "report: unknown argument '$1'; allowed --wait, --pack" ;;
    esac
  done
  [[ -d $STATE/begun ]] || die "no session was begun in $STATE"
  local until_s=$((SECONDS + wait_s))
  while [[ ! -e $STATE/done ]] && ((SECONDS < until_s)); do sleep 2; done
  echo "--- session ($([[ -e $STATE/done ]] && echo done || echo running))"
  cat "$STATE/session.log" 2>/dev/null
  local f
  for f in "$STATE"/commands.log "$STATE"/sweep-*/sweep.log; do
    [[ -f $f ]] || continue
    f=${f#"$STATE"/}
    echo "--- $f"
    grep -v "━" "$STATE/$f" | grep -E "^==|median|ms|rror" | tail -40
  done
  if [[ -n $pack ]]; then
    mkdir -p "$pack" || die "cannot make $pack"
    tar czf "$pack/logs.tgz" -C "$STATE" --exclude='./sweep-*/run.tgz' --exclude='./mb-*' . \
      2>/dev/null
    local run n folder
    for run in "$STATE"/sweep-*/run.tgz; do
      [[ ! -f $run ]] || cp "$run" "$pack/run-$(basename "$(dirname "$run")" | cut -d- -f2).tgz"
    done
    for run in "$STATE"/mb-*; do  # a sweep still running: its run folder as it stands
      n=${run##*/mb-}
      [[ -d $run && ! -f $STATE/sweep-$n/run.tgz ]] || continue
      folder=$(ls -d "$run"/*/ 2>/dev/null | tail -1)
      [[ -n $folder && -f $folder/rows.jsonl ]] || continue
      # rows.jsonl gets a whole line per finished cell; its readers skip a line cut mid-write
      tar czf "$pack/run-$n.partial.tgz" -C "$(dirname "$folder")" "$(basename "$folder")" \
        2>/dev/null
      echo "--- packed run-$n.partial.tgz ($(grep -c . "$folder/rows.jsonl") rows so far)"
    done
  fi
  return 0
}

cmd_cut() {
  [[ $# -eq 0 ]] || die "cut takes no arguments; got '$*'"
  [[ -d $STATE/begun ]] || die "no session was begun in $STATE"
  touch "$STATE/cut"
  if pkill -INT -f "python -m mokbench.cli sweep"; then
    echo "$PROG: interrupted the running sweep; nothing after it will start"
  else
    echo "$PROG: no sweep was running; nothing more will start"
  fi
}

case ${1:-} in
  start) shift; cmd_start "$@" ;;
  cut) shift; cmd_cut "$@" ;;
  report) shift; cmd_report "$@" ;;
  _run) shift; cmd_run "$@" ;;
  -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' ;;
  *) die "usage: $PROG start [options] | report [--wait S] [--pack DIR] | cut (--help for more)" ;;
esac
