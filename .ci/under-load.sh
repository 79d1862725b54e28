#!/usr/bin/env bash
# The whole test suite once, with two busy loops competing for the CPUs: no
# test may depend on how fast the machine is, and the crash tests' checks
# must hold on a loaded machine, where a kill lands inside a handler more
# often. The loops are killed however this ends (trap), by their own
# process ids.
# Usage: .ci/under-load.sh [cargo test args, e.g. --test crash -- random_sigkills]
set -euo pipefail
cd "$(dirname "$0")/.."

busy=()
stop_busy() {
  for pid in "${busy[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
}
trap stop_busy EXIT INT TERM

# Build first, so the loops load the tests and not the compiler.
cargo test --locked --all-features --no-run "$@"

for _ in 1 2; do
  (while :; do :; done) &
  busy+=("$!")
done
echo "busy loops: ${busy[*]}"

cargo test --locked --all-features "$@"
