#!/usr/bin/env bash
# Every test of the project, on a fresh machine: unit, integration, property and
# fuzz-corpus tests, the shm ring's loom model checks, a build of the benchmarks, the
# Python package's pytest suite (wheel built into a venv; maturin, numpy, pytest and mypy from
# PyPI), a bounded cargo-fuzz run of every decoder a peer can reach, and the verbs suites
# on Soft-RoCE inside a qemu VM (installs qemu, rdma-core and a kernel via apt on first
# use; needs root).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
need_cargo
# Disk. A clean run wrote 17 GiB of build output, 5.5 GiB of it incremental caches that a
# one-shot run never reads back and most of the rest debug info; a CI machine ran out of
# disk in the verbs stage (its log ends mid-word). Line tables keep file:line in panics
# and backtraces. Either setting can be overridden from the environment.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
export CARGO_PROFILE_DEV_DEBUG="${CARGO_PROFILE_DEV_DEBUG:-line-tables-only}"
start=$(date +%s)
free_gib() { df -Pk "${CARGO_TARGET_DIR:-.}" 2>/dev/null | awk 'NR == 2 { printf "%d", $4 / 1048576 }'; }
step() { echo; echo "== $* ($(( $(date +%s) - start ))s, $(free_gib) GiB free)"; }
# The whole run writes about 8 GiB here (build output, the VM's disk image).
if [ "$(free_gib)" -lt 10 ] 2>/dev/null; then
    echo "warning: $(free_gib) GiB free on the build disk; the full run needs about 10 GiB. Free some, or point CARGO_TARGET_DIR at a larger disk." >&2
fi

step "formatting (rustfmt, default configuration)"
if cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt >/dev/null 2>&1; then
    cargo fmt --all --check || { echo "formatting differs: run cargo fmt --all" >&2; exit 1; }
else
    echo "skipped: rustfmt is not installed and rustup could not add it"
fi

step "workspace tests"
cargo test --workspace --locked

step "busy-polling (IBEX_BUSY_POLL=1): the gRPC conformance suite, hostile peers and the PS service on serve threads"
# The suites read the IBEX_* environment: every shm server then serves on threads of its own.
# The binaries the workspace tests just ran: `cargo test -p` would first rebuild about 70
# crates (90 s of this stage on a fresh 2-core machine) for its own feature resolution.
busy=$(workspace_tests ibex-transport:grpc_conformance ibex-transport:accept_hostile \
    ibex-transport:hostile_grpc ibex-ps:service ibex-ps:hostile_ps) || exit 1
while read -r exe dir; do
    echo "-- IBEX_BUSY_POLL=1 ${exe#"$PWD"/}"
    (cd "$dir" && IBEX_BUSY_POLL=1 "$exe") || die "$(basename "$exe") failed with IBEX_BUSY_POLL=1 (above)"
done <<< "$busy"

step "cuda feature: builds and CPU-side tests without a GPU (GPU tests print 'skipped: no CUDA device')"
# One cargo run, one feature resolution, for both packages; the `ibex` binary's tests all
# run with the feature on (4 s).
cargo test --locked -p ibex-worker -p ibex-cluster --features ibex-worker/cuda,ibex-cluster/cuda \
    --lib --test cuda --bin ibex -- --nocapture

step "benchmarks and examples build"
cargo build --workspace --locked --benches --examples

step "ibex-bench smoke: every benchmark over every transport once, tiny sizes, no timing"
# The debug ibex-bench and ibex-ps binaries are the ones the workspace tests built.
"${CARGO_TARGET_DIR:-target}/debug/ibex-bench" compare --smoke --out "${CARGO_TARGET_DIR:-target}/ibex-bench-smoke"

step "emulated cluster: PS and workers in network namespaces over shaped veth links (root only)"
# The debug binaries the workspace tests built (about 20 s). They move about 0.5 GB/s of
# ResNet-50 steps on 2 cores, so the links are shaped well below that: the check is that
# Ibex tcp fills a link it is not CPU-bound on, that the demo trains across hosts over tcp,
# and that connect_auto does not take another host's shm socket.
scripts/cluster-netns.sh --bin "${CARGO_TARGET_DIR:-target}/debug" --rate "${IBEX_NETNS_RATE:-1gbit}" \
    --model resnet50 --steps 3 --demo-steps 150

step "python: the ibex wheel (maturin, dev profile) into a venv, then pytest python/tests"
# A debug build: on a fresh 2-core machine it compiles in about half the time of a release
# one, and the tests are bound by process start-up, not by the extension's speed.
target="${CARGO_TARGET_DIR:-target}"
command -v python3 >/dev/null 2>&1 || die "python3 not found: install CPython >= 3.9 (with its venv module) and re-run."
python3 -c 'import sys; sys.exit(sys.version_info < (3, 9))' \
    || die "python3 is $(python3 --version 2>&1 | awk '{print $2}'): the ibex package needs CPython >= 3.9."
if [ ! -x "$target/pyvenv/bin/python" ]; then
    python3 -m venv "$target/pyvenv" 2>/dev/null || { apt_need python3-venv && python3 -m venv "$target/pyvenv"; } \
        || die "python3 -m venv failed: install the venv module (Debian: apt-get install python3-venv) and re-run."
fi
"$target/pyvenv/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.5,<2" "numpy>=1.22" "pytest>=7" "mypy>=1.5" \
    || die "pip could not install maturin, numpy, pytest and mypy from PyPI into $target/pyvenv."
rm -rf "$target/wheels-test"
"$target/pyvenv/bin/maturin" build --locked -m python/Cargo.toml -o "$target/wheels-test"
"$target/pyvenv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$target"/wheels-test/ibex-*.whl
# From the repository root, so that python/ibex (sources without the built module) does
# not shadow the installed package.
"$target/pyvenv/bin/python" -m pytest -q python/tests

step "shm ring: loom model checks"
# A debug build (overflow checks and debug assertions on) with loom itself optimised: on a
# fresh 2-core machine 91 s, against 152 s for a release build, which spent 147 of them
# compiling. Its own target directory: the cfg changes every crate's build.
RUSTFLAGS="--cfg ibex_loom" CARGO_TARGET_DIR=target/loom \
    cargo test --locked -p ibex-transport --config 'profile.dev.package.loom.opt-level=3' --lib shm::ring

step "fuzzing: every decoder a peer can reach, ${IBEX_FUZZ_SECONDS:-60}s per target (cargo-fuzz)"
scripts/fuzz.sh

step "verbs: Soft-RoCE in a qemu VM, one device and two devices across a veth"
scripts/verbs-test.sh

step "done"
