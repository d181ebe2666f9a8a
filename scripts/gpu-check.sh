#!/usr/bin/env bash
# The GPU checks in one command, for a machine with an NVIDIA GPU, its driver, and the
# CUDA 12.4+ NVRTC and cuBLAS libraries (building needs no CUDA: it is loaded at run time):
#   1. the GPU test suite (ibex-worker --features cuda); a skip counts as a failure here
#   2. the staging-path bandwidth: device -> PS -> device through Ibex shm against a plain
#      cudaMemcpy D2H + H2D in the same run (worker example gpu_staging_bw [MIB] [ITERS])
#   3. ibex demo --device cuda (reaches the accuracy bar or fails), then its final weights
#      against the CPU single-process reference from the same initial weights (printed:
#      cuBLAS sums in another order than the CPU, so a difference near the 1e-4 tolerance
#      is rounding, one near 1 a bug)
# Output also goes to target/gpu-check.log.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
need_cargo
log=target/gpu-check.log
mkdir -p target
exec > >(tee "$log") 2>&1
step() { echo; echo "== $*"; }

step "device"
nvidia-smi -L || echo "nvidia-smi not found (the checks below say whether the driver loads)"

step "GPU test suite"
out=$(cargo test --locked -p ibex-worker --features cuda --lib --test cuda -- --nocapture --test-threads=1 2>&1) \
    || { echo "$out"; die "GPU tests failed"; }
echo "$out" | grep -E "^test |skipped|pinning|test result" || true
if echo "$out" | grep -q "skipped: no CUDA device"; then
    die "the GPU tests skipped: this machine has no usable CUDA device (see the reason above)"
fi

step "staging-path bandwidth (device -> Ibex shm PS -> device vs plain cudaMemcpy D2H + H2D)"
cargo run --release --locked -q -p ibex-worker --features cuda --example gpu_staging_bw -- 64 20
cargo run --release --locked -q -p ibex-worker --features cuda --example gpu_staging_bw -- 4 50

step "ibex demo --device cuda"
cargo build --release -q --locked -p ibex-cluster --features cuda
report=target/gpu-demo.json
target/release/ibex demo --device cuda --report "$report"
target/release/ibex train --reference --init-from "$report" --compare "$report" \
    || echo "note: the GPU run differs from the CPU reference beyond the CPU runs' tolerance (see above)"

step "done (log: $log)"
