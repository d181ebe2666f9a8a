#!/usr/bin/env bash
# verbs-test.sh: build the verbs test suites on this host, then run them on Soft-RoCE inside
# the throw-away qemu VM of scripts/rxe-vm/rxe-vm.
#
#   scripts/verbs-test.sh                 host checks, then single host (rxe0), then two hosts
#   scripts/verbs-test.sh --single        host checks + rxe0 <-> rxe0 only
#   scripts/verbs-test.sh --two-hosts     host checks + rxeA <-> rxeB (over a veth) only
#   scripts/verbs-test.sh --bench         verbs link vs perftest on rxe0 (ratios; see docs/verbs.md)
#   scripts/verbs-test.sh ... -- ARGS     extra arguments for the test binaries (e.g. a test name)
#
# Needs root (apt installs, the VM harness). Whole run: a few minutes on a 2-core host.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RXE_VM=$ROOT/scripts/rxe-vm/rxe-vm
MODE=both BENCH=0 EXTRA=()
while (( $# )); do
    case $1 in
        --single) MODE=single ;;
        --two-hosts) MODE=two ;;
        --bench) BENCH=1 ;;
        --) shift; EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "verbs-test.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
cd "$ROOT"
# Seconds since the script started: the CI log then shows where the stage's time goes.
say() { echo "== verbs-test: $* (${SECONDS}s)" >&2; }

# Build dependencies of sideway (rdma-mummy-sys runs cmake and bindgen).
need=()
for p in cmake libclang-dev; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
if (( ${#need[@]} )); then
    say "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq "${need[@]}" >&2 || { apt-get update -qq >&2 && apt-get install -y -qq "${need[@]}" >&2; }
fi

# One feature resolution for everything built here: both packages, each with verbs. A
# `cargo build -p ibex-transport`, a `cargo test -p ibex-transport` and a `cargo test -p
# ibex-ps` each resolved apart and compiled the transport and much of what it uses again.
VERBS=(--locked -p ibex-transport -p ibex-ps --features ibex-transport/verbs,ibex-ps/verbs)
TARGETS=(--lib --test 'verbs_*' --test conn --test grpc_conformance)
say "building on the host"
cargo test "${VERBS[@]}" "${TARGETS[@]}" --no-run --quiet   # a failed build says why here
# verbs_many_workers runs the real ibex-ps binary, which this build made with verbs.
mapfile -t BINS < <(cargo test "${VERBS[@]}" "${TARGETS[@]}" --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target", {})
    name = t.get("name", "")
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in t.get("kind", []) and (name.startswith("verbs_") or name in ("conn", "grpc_conformance")):
        print(m["executable"])')
(( ${#BINS[@]} )) || { echo "verbs-test.sh: no verbs_* test binaries were built" >&2; exit 1; }
[[ " ${BINS[*]} " == *"/verbs_many_workers-"* ]] || { echo "verbs-test.sh: ibex-ps's verbs_many_workers was not built" >&2; exit 1; }
# Connections in the many-connection tests (verbs_scale, verbs_many_workers): 64 by default.
CONNS=${IBEX_TEST_CONNS:-64}
WORKERS=${IBEX_TEST_WORKERS:-64}

# The VM shares this host's root, so the harness's apt packages land here too (first run
# only), and the host checks below load rdma-core's libraries from them. No boot: the
# installs happen before the VM's timeout starts anyway.
"$RXE_VM" --prepare

if (( BENCH )); then
    say "building the benchmark (release)"
    BENCH_BIN=$(cargo test --release -p ibex-transport --features verbs --test verbs_bench --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])' | tail -n1)
    [[ -n $BENCH_BIN ]] || { echo "verbs-test.sh: verbs_bench was not built" >&2; exit 1; }
    say "benchmark on rxe0 (do not compile or run other VMs meanwhile)"
    exec "$RXE_VM" --timeout 600 -- bash "$ROOT/scripts/rxe-vm/verbs-bench.sh" "$BENCH_BIN"
fi

say "host (no RDMA device): unit tests and the no-device error"
cargo test "${VERBS[@]}" --lib --quiet verbs:: >&2
for b in "${BINS[@]}"; do
    case $b in */conn-*|*/grpc_conformance-*) continue ;; esac   # run by scripts/test.sh on the host
    "$b" --quiet "${EXTRA[@]}" >&2
done

# One process opens both ends of every link. The tests run with default parallelism: they
# passed that way on rxe0 and across rxeA/rxeB (add `-- --test-threads=1` to serialise).
# topology NAME ENV...: the script lines that run every binary once with ENV exported.
topology() {
    local name=$1; shift
    local b q lines
    # Each topology starts from the same environment: what one exports, the next unsets.
    lines="unset IBEX_TEST_SERVER_DEV IBEX_TEST_CLIENT_DEV IBEX_TEST_LISTEN_ADDR"
    printf -v q '%q ' "$@"
    lines+=$'\n'"echo \"== verbs-test: VM: $name (\${SECONDS}s in the VM)\"; export $q"
    for b in "${BINS[@]}"; do
        [[ $b == */verbs_bench-* ]] && continue
        local filter="" pre=""
        [[ $b == */conn-* || $b == */grpc_conformance-* ]] && filter="verbs"
        # The PS test's workers take their device from the environment (as deployed
        # workers do), and skip the connect-time probe: it measures nothing there and costs
        # seconds per connection under emulation.
        [[ $b == */verbs_many_workers-* ]] && pre="env IBEX_RDMA_DEVICE=\$IBEX_TEST_CLIENT_DEV IBEX_EAGER_THRESHOLD=16384 IBEX_FRAGMENT_SIZE=524288 "
        # The footprint tests print their measurements (pinned memory, connect time).
        [[ $b == */verbs_many_workers-* || $b == */verbs_scale-* ]] && filter="--nocapture"
        printf -v q '%q ' "$b" $filter "${EXTRA[@]}"
        lines+=$'\n'"echo \"== \$(basename $b) (\${SECONDS}s in the VM)\"; $pre$q"
    done
    printf '%s\n' "$lines"
}

# One VM runs both topologies: a boot costs 30-60 s under TCG on a busy 2-core host, and
# --two-hosts brings up rxe0 beside rxeA/rxeB. The provider-parametrised connection tests
# and the gRPC conformance suite run their verbs cases only (the others ran on the host).
# Emulation is 10-100x slower than hardware, so the tests' hang guard, the set-up deadline
# (registering a pool takes seconds under TCG) and the threshold probe's time limit are
# raised; no assertion changes.
script="set -e"
vm_args=() timeout=1200
if [[ $MODE == both || $MODE == single ]]; then
    script+=$'\n'"$(topology "single host (rxe0 <-> rxe0)" IBEX_TEST_SERVER_DEV=rxe0 IBEX_TEST_CLIENT_DEV=rxe0)"
fi
if [[ $MODE == both || $MODE == two ]]; then
    vm_args=(--two-hosts)
    script+=$'\n'"$(topology "two hosts (rxeA <-> rxeB over vethA/vethB)" \
        IBEX_TEST_SERVER_DEV=rxeA IBEX_TEST_CLIENT_DEV=rxeB IBEX_TEST_LISTEN_ADDR=198.51.100.1:0)"
fi
[[ $MODE == both ]] && timeout=2400
say "VM: booting for the $MODE run"
"$RXE_VM" --timeout "$timeout" "${vm_args[@]}" -- env IBEX_TEST_CONNS="$CONNS" IBEX_TEST_WORKERS="$WORKERS" \
    IBEX_TEST_GUARD_SECS=300 IBEX_PROBE_TIMEOUT_MS=60000 IBEX_HANDSHAKE_TIMEOUT_MS=120000 bash -c "$script"
say "all verbs tests passed"
