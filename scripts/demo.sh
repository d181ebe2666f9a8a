#!/usr/bin/env bash
# The main job on a fresh machine: builds Ibex and runs the local demo on the embedded
# default transport (shm; no RDMA needed).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
need_cargo
cargo run --release -q -p ibex-transport --example pingpong
