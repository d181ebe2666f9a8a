#!/usr/bin/env bash
# Fuzzes every decoder a peer can reach, each for a bounded time (IBEX_FUZZ_SECONDS, 60 by
# default), IBEX_FUZZ_JOBS at a time (default: one per core), with cargo-fuzz and
# libFuzzer on the stable toolchain (nightly flags through RUSTC_BOOTSTRAP=1). Installs
# cargo-fuzz on first use. A crash fails the run: libFuzzer
# leaves the input under <crate>/fuzz/artifacts/<target>/; fix the decoder, then add the
# input to that target's seeds. Targets and what they check: transport/fuzz/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
. scripts/common.sh
need_cargo
secs=${IBEX_FUZZ_SECONDS:-60}
case "$secs" in ''|*[!0-9]*) die "IBEX_FUZZ_SECONDS=$secs: give whole seconds, e.g. 60" ;; esac

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz (crates.io) ..."
    cargo install --locked cargo-fuzz >/dev/null 2>&1 \
        || die "cargo install cargo-fuzz failed: install it by hand (cargo install cargo-fuzz) and re-run."
fi

# crate dir : targets
plan=(
    "transport:frame_decode preface_decode verbs_bootstrap grpc_packet tcp_records"
    "ps-server:ps_request"
)
# libFuzzer runs one target on one core: on CI's 2 cores two at a time halve the stage.
jobs=${IBEX_FUZZ_JOBS:-$(nproc 2>/dev/null || echo 1)}
case "$jobs" in ''|*[!0-9]*|0) die "IBEX_FUZZ_JOBS=$jobs: give a whole number of targets to run at once, e.g. 2" ;; esac

# Every target is built before any runs: the runs then share the cores with no compiler
# beside them, and a target that does not build fails the stage at once. One target
# directory for both fuzz crates: their locks pin the workspace's versions, so the
# instrumented dependencies are built once.
for entry in "${plan[@]}"; do
    dir=${entry%%:*}
    echo "-- building $dir's fuzz targets"
    log="$ROOT/target/fuzz-build-${dir}.log"
    mkdir -p "$ROOT/target"
    if ! ( cd "$dir" && RUSTC_BOOTSTRAP=1 cargo fuzz build --target-dir "$ROOT/target/fuzz" ) >"$log" 2>&1; then
        tail -40 "$log" >&2
        die "$dir's fuzz targets did not build (above; whole log: $log)."
    fi
done

# fuzz_one DIR TARGET: runs one target for $secs; its log is DIR/fuzz/artifacts/TARGET.log.
fuzz_one() {
    local dir=$1 t=$2
    mkdir -p "$dir/fuzz/corpus/$t" "$dir/fuzz/artifacts"
    # -timeout: one input running past 10 s is a hang, reported like a crash.
    ( cd "$dir" && RUSTC_BOOTSTRAP=1 cargo fuzz run --target-dir "$ROOT/target/fuzz" "$t" "fuzz/corpus/$t" "fuzz/seeds/$t" \
        -- -max_total_time="$secs" -timeout=10 -print_final_stats=1 ) >"$dir/fuzz/artifacts/$t.log" 2>&1
}

# The runs, $jobs at a time. Each one's result is reported when it ends; the first
# failure is reported after the runs already going have ended (none is left running).
names=() pids=() failed=""
report() { # INDEX RC
    local dir=${names[$1]%%:*} t=${names[$1]#*:} log
    log="$dir/fuzz/artifacts/$t.log"
    if [ "$2" -ne 0 ]; then
        [ -n "$failed" ] || failed="$1"
        return
    fi
    echo "-- $dir: $t, ${secs}s"
    grep -E '^(Done [0-9]+ runs|stat::peak_rss_mb)' "$log" || true
}
wait_one() { # waits for the earliest-started run still going
    local i
    for i in "${!pids[@]}"; do
        [ -n "${pids[$i]}" ] || continue
        local rc=0
        wait "${pids[$i]}" || rc=$?
        pids[$i]=""
        report "$i" "$rc"
        return
    done
}
running() { local n=0 p; for p in "${pids[@]}"; do [ -n "$p" ] && n=$((n + 1)); done; echo "$n"; }
total=0
for entry in "${plan[@]}"; do
    dir=${entry%%:*}
    for t in ${entry#*:}; do
        [ -z "$failed" ] || break 2
        while [ "$(running)" -ge "$jobs" ]; do wait_one; done
        [ -z "$failed" ] || break 2
        names+=("$dir:$t")
        fuzz_one "$dir" "$t" &
        pids+=("$!")
        total=$((total + secs))
    done
done
while [ "$(running)" -gt 0 ]; do wait_one; done
if [ -n "$failed" ]; then
    dir=${names[$failed]%%:*} t=${names[$failed]#*:}
    tail -40 "$dir/fuzz/artifacts/$t.log" >&2
    die "fuzz target $t ($dir) found a crash (above; whole log: $dir/fuzz/artifacts/$t.log). The input is under $dir/fuzz/artifacts/$t/; reproduce with: cd $dir && RUSTC_BOOTSTRAP=1 cargo fuzz run $t fuzz/artifacts/$t/<file>"
fi
echo "fuzzed ${total}s in all, $jobs at a time, no crash"
