#!/usr/bin/env bash
# Runs test suites over and over beside busy loops, to find what only a loaded machine
# shows: hangs, lost wake-ups and tests that lean on timing. A CI machine has 2 cores and
# runs tests two at a time; this makes it worse on purpose. Lost wake-ups that hang a
# message (docs/transport.md, "Progress") and tests that lean on timing show up this way
# where the plain suite passes.
#   scripts/stress.sh [SECONDS] [SUITE...]
#   SECONDS: how long to go on (default 1800). SUITE: PACKAGE:TEST, e.g.
#   ibex-transport:conn (default: every integration test of ibex-transport, ibex-ps and
#   ibex-worker that needs no RDMA device). IBEX_STRESS_LOOPS busy loops (default 2);
#   IBEX_STRESS_ENV, e.g. IBEX_BUSY_POLL=1, is set for every run.
# Each run has a 400 s limit (a hang is killed and reported). Prints one line per run and
# keeps the log of each failed one; ends with the failures, exit status 1 if any.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
need_cargo
secs=${1:-1800}
shift || true
case "$secs" in '' | *[!0-9]*) die "stress.sh: SECONDS is whole seconds, not '$secs'" ;; esac
loops=${IBEX_STRESS_LOOPS:-2}
case "$loops" in '' | *[!0-9]*) die "IBEX_STRESS_LOOPS=$loops: give a count, e.g. 2" ;; esac
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
export CARGO_PROFILE_DEV_DEBUG="${CARGO_PROFILE_DEV_DEBUG:-line-tables-only}"

suites=("$@")
if [ ${#suites[@]} -eq 0 ]; then
    for t in accept_hostile conn conn_close conn_kill grpc_conformance grpc_direct hostile_grpc \
        hostile_shm hostile_tcp keepalive shm_kill shm_link tcp_link; do
        suites+=("ibex-transport:$t")
    done
    for t in service hostile_ps kill_restore; do suites+=("ibex-ps:$t"); done
    for t in training overlap remote_pulls staging; do suites+=("ibex-worker:$t"); done
fi

# Build once, and take each test binary's path from cargo rather than guess it: the
# workspace build's, the binaries CI runs (scripts/common.sh).
declare -A bin dir
list=$(workspace_tests "${suites[@]}") || exit 1
i=0
while read -r exe d; do
    bin[${suites[$i]}]=$exe
    dir[${suites[$i]}]=$d
    i=$((i + 1))
done <<< "$list"

logs=$(mktemp -d /tmp/ibex-stress.XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2> /dev/null || true; done
}
trap cleanup EXIT
for _ in $(seq 1 "$loops"); do
    (while :; do :; done) &
    pids+=($!)
done

end=$(($(date +%s) + secs))
round=0
runs=0
failed=()
while [ "$(date +%s)" -lt "$end" ]; do
    round=$((round + 1))
    for s in "${suites[@]}"; do
        [ "$(date +%s)" -lt "$end" ] || break
        log="$logs/$round.${s/:/.}.log"
        t0=$(date +%s)
        rc=0
        # shellcheck disable=SC2086 # IBEX_STRESS_ENV is a list of NAME=VALUE words
        (cd "${dir[$s]}" && env ${IBEX_STRESS_ENV:-} timeout -s KILL 400 "${bin[$s]}") > "$log" 2>&1 || rc=$?
        runs=$((runs + 1))
        what=ok
        if [ "$rc" = 137 ]; then what="HUNG (killed after 400 s)"; elif [ "$rc" != 0 ]; then what="FAILED (rc=$rc)"; fi
        echo "round $round $s: $what, $(($(date +%s) - t0)) s"
        if [ "$what" = ok ]; then rm -f "$log"; else failed+=("$s: $log"); fi
    done
done
echo "stress: $runs runs in $round rounds beside $loops busy loops, ${#failed[@]} failed"
for f in "${failed[@]}"; do echo "  $f"; done
[ ${#failed[@]} -eq 0 ] || { echo "failed runs' logs are kept under $logs" >&2; exit 1; }
rm -rf "$logs"
