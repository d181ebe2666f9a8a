#!/usr/bin/env bash
# The main job on a fresh machine: builds Ibex and runs `ibex demo`, parameter-server
# training with 2 PS and 2 worker processes on the embedded default transport (shm; no
# RDMA needed). Flags pass through: scripts/demo.sh --transport grpc --steps 500
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
need_cargo
cargo build --release -q --locked -p ibex-cluster
exec target/release/ibex demo "$@"
