#!/usr/bin/env bash
# The GPU checks in one command, for a machine with an NVIDIA GPU, its driver, and the
# CUDA 12.4+ NVRTC and cuBLAS libraries (building needs no CUDA: it is loaded at run time):
#   1. the GPU test suite (ibex-worker --features cuda); a skip counts as a failure here
#   2. the staging-path bandwidth: device -> PS -> device through Ibex shm against a plain
#      cudaMemcpy D2H + H2D in the same run (worker example gpu_staging_bw [MIB] [ITERS])
#   3. ibex demo --device cuda (reaches the accuracy bar or fails)
# Output also goes to target/gpu-check.log. Extra arguments go to the demo.
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
target/release/ibex demo --device cuda "$@"

step "done (log: $log)"
