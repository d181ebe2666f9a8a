#!/bin/bash
# ps-step with 8 workers x 2 PS over verbs (rxe0) inside the Soft-RoCE VM, and the same over
# Ibex tcp for a ratio (docs/benchmarks.md, "ps-step in the VM"). The model is WRN-16-4 (2.7M
# parameters): ResNet-50's eight workers would not fit the 2 GiB guest. Run from the host:
#   cargo build --release -p ibex-bench -p ibex-ps --features ibex-bench/verbs,ibex-ps/verbs
#   scripts/rxe-vm/rxe-vm --timeout 900 -- "$PWD/scripts/rxe-vm/ps-step-vm.sh"
set -u
# Probe off: under TCG its samples take seconds and would sit in the measured window.
export IBEX_FRAGMENT_SIZE=512K IBEX_EAGER_THRESHOLD=16K
B=${IBEX_BENCH:-$(cd "$(dirname "$0")/../.." && pwd)/target/release/ibex-bench}
STEPS=${PS_STEP_VM_STEPS:-10}
for t in ibex-verbs ibex-tcp; do
  $B ps-step --model wrn16-4 --transport $t --workers 8 --ps 2 --steps "$STEPS" --warmup-steps 2 2>&1 | grep -E "^(ps-step|bench)"
done
