# Sourced by the scripts that run on a lent GPU machine (device_sweep.sh, gpu_tier.sh):
# `snapshot_tree` moves the shell into a copy of the checkout (the current directory) taken
# now, removed when the script exits. Why: on a lent machine every later call re-sends the
# working tree, and a sweep worker or test that imports the package while its files are being
# rewritten fails (results/20261201-081217-h200-fp8-backward lost TE's Qwen3.5 cells to a
# polling call). Large ignored folders (carried wheels, environments) stay behind.
# SNAPSHOT=0 runs from the checkout itself.
snapshot_tree() {
  [[ ${SNAPSHOT:-1} == 1 ]] || return 0
  local snap
  snap=$(mktemp -d /tmp/mokbench-tree.XXXXXX) || return 1
  tar cf - --exclude=./offline-wheels --exclude=./.venv --exclude=./.gl . \
    | tar xf - -C "$snap" || { rm -rf "$snap"; return 1; }
  # shellcheck disable=SC2064  # the path is fixed now
  trap "rm -rf '$snap'" EXIT
  cd "$snap" || return 1
}
