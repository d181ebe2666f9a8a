#!/usr/bin/env bash
# Every test of the project, on a fresh machine: unit, integration, property and
# fuzz-corpus tests, the shm ring's loom model checks, a bounded cargo-fuzz run of every
# decoder a peer can reach, a build of the benchmarks, and the
# verbs suites on Soft-RoCE inside a qemu VM (installs qemu, rdma-core and a kernel via apt
# on first use; needs root).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
need_cargo
start=$(date +%s)
step() { echo; echo "== $* ($(( $(date +%s) - start ))s)"; }

step "formatting (rustfmt, default configuration)"
if cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt >/dev/null 2>&1; then
    cargo fmt --all --check || { echo "formatting differs: run cargo fmt --all" >&2; exit 1; }
else
    echo "skipped: rustfmt is not installed and rustup could not add it"
fi

step "workspace tests"
cargo test --workspace --locked

step "cuda feature: builds and CPU-side tests without a GPU (GPU tests print 'skipped: no CUDA device')"
cargo test --locked -p ibex-worker --features cuda --lib --test cuda -- --nocapture
cargo test --locked -p ibex-cluster --features cuda --bin ibex gpu

step "benchmarks and examples build"
cargo build --workspace --locked --benches --examples

step "ibex-bench smoke: every benchmark over every transport once, tiny sizes, no timing"
# The debug ibex-bench and ibex-ps binaries are the ones the workspace tests built.
"${CARGO_TARGET_DIR:-target}/debug/ibex-bench" compare --smoke --out "${CARGO_TARGET_DIR:-target}/ibex-bench-smoke"

step "shm ring: loom model checks"
RUSTFLAGS="--cfg ibex_loom" CARGO_TARGET_DIR=target/loom \
    cargo test --locked -p ibex-transport --release --lib shm::ring

step "fuzzing: every decoder a peer can reach, ${IBEX_FUZZ_SECONDS:-60}s per target (cargo-fuzz)"
scripts/fuzz.sh

step "verbs: Soft-RoCE in a qemu VM, one device and two devices across a veth"
scripts/verbs-test.sh

step "done"
