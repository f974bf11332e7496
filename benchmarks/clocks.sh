#!/usr/bin/env bash
# Run a command while sampling GPU 0's SM clock and power every 100 ms, then print the busy
# samples' clock and power: whether a timing ran at full clock or under the power limit.
# A kernel timed in short bursts on a rested GPU can run at a higher clock than the same loop
# inside a 40 ms megakernel, so rates compared across such timings need the clocks beside them.
#
# Usage: benchmarks/clocks.sh [--busy-w W] -- COMMAND [ARGS...]
#   --busy-w W  samples drawing at least W watts count as busy (default 300)
# Prints the command's output, then one line: busy samples, SM clock p10/p50/p90 (MHz), power
# p50/max (W). Exits with the command's status. Needs nvidia-smi.
set -uo pipefail

busy_w=300
while (($#)); do
  case $1 in
    --busy-w) [[ ${2:-} =~ ^[0-9]+$ ]] || { echo "clocks.sh: --busy-w: got '${2:-}'; allowed watts as an integer" >&2; exit 2; }
              busy_w=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "clocks.sh: unknown argument '$1'; allowed --busy-w, then -- COMMAND" >&2; exit 2 ;;
  esac
done
(($#)) || { echo "clocks.sh: no command; usage: clocks.sh [--busy-w W] -- COMMAND" >&2; exit 2; }
command -v nvidia-smi >/dev/null || { echo "clocks.sh: nvidia-smi not found" >&2; exit 2; }

samples=$(mktemp)
nvidia-smi -i 0 --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 100 \
  >"$samples" 2>/dev/null &
smi=$!
"$@"
rc=$?
kill "$smi" 2>/dev/null
wait "$smi" 2>/dev/null
busy=$(mktemp)
awk -F', *' -v w="$busy_w" '$2 + 0 >= w { print $1 + 0, $2 + 0 }' "$samples" >"$busy"
n=$(wc -l <"$busy")
# pct COLUMN Q: the Q-quantile (nearest rank) of the busy samples' column (1 clock, 2 power)
pct() { sort -n -k"$1","$1" "$busy" | awk -v c="$1" -v q="$2" -v n="$n" \
          'NR == int((n - 1) * q) + 1 { print $c }'; }
if ((n == 0)); then
  echo "clocks: no sample at or above $busy_w W"
else
  echo "clocks: $n busy samples (>= $busy_w W): SM clock p10 $(pct 1 0.1), p50 $(pct 1 0.5)," \
       "p90 $(pct 1 0.9) MHz; power p50 $(pct 2 0.5), max $(pct 2 1) W"
fi
rm -f "$busy"
rm -f "$samples"
exit "$rc"
