#!/bin/bash
# TF-gRPC-Bench style runs inside the Soft-RoCE VM: stock tonic, Ibex tcp and Ibex verbs,
# one after the other on rxe0 (docs/benchmarks.md, "In the Soft-RoCE VM"). Run from the host:
#   cargo build --release -p ibex-bench --features verbs
#   scripts/rxe-vm/rxe-vm --timeout 600 -- "$PWD/scripts/rxe-vm/grpc-bench.sh"
set -u
# Probe off: under TCG its samples take seconds and would sit in the measured window.
export IBEX_FRAGMENT_SIZE=512K IBEX_EAGER_THRESHOLD=16K
B=${IBEX_BENCH:-$(cd "$(dirname "$0")/../.." && pwd)/target/release/ibex-bench}
for t in tonic ibex-tcp ibex-verbs; do
  $B latency --transport $t --size 64 --warmup 2 --duration 6 2>&1 | tail -1
  $B bw --transport $t --size 1M --warmup 2 --duration 6 2>&1 | tail -1
  $B tensor --transport $t --size 16M --warmup 2 --duration 8 2>&1 | tail -2
done
