#!/usr/bin/env bash
# The ps-step table in one go: single-thread memcpy, then ResNet-50 2 workers x 2 PS
# for stock tonic, ibex-shm and ibex-tcp back to back (20 steps, then the short
# `compare --quick` shape of 1 warm-up + 3 steps), one JSON record per line on stdout.
#   scripts/ps-step-table.sh [DIR]   # DIR holds ibex-bench and ibex-ps (default target/release)
# Build first: cargo build --release -p ibex-bench -p ibex-ps
set -euo pipefail
B="${1:-target/release}/ibex-bench"
# Single-thread memcpy twice: 16 MiB (the tensor bench's default; in L3 on large-cache CPUs)
# and 64 MiB (out of cache, like the step's ~100 MB of variables).
for size in 16M 64M; do
  "$B" tensor --transport ibex-shm --size "$size" --json | grep '"memcpy"'
done
for steps in "20 3" "3 1"; do
  set -- $steps
  for t in tonic ibex-shm ibex-tcp; do
    "$B" ps-step --model resnet50 --transport "$t" --steps "$1" --warmup-steps "$2" --json
  done
done
