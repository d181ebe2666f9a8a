#!/usr/bin/env bash
# Fuzzes every decoder a peer can reach, each for a bounded time (IBEX_FUZZ_SECONDS, 60 by
# default), with cargo-fuzz and libFuzzer on the stable toolchain (nightly flags through
# RUSTC_BOOTSTRAP=1). Installs cargo-fuzz on first use. A crash fails the run: libFuzzer
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
total=0
for entry in "${plan[@]}"; do
    dir=${entry%%:*}
    for t in ${entry#*:}; do
        mkdir -p "$dir/fuzz/corpus/$t"
        echo "-- $dir: $t, ${secs}s"
        log="$dir/fuzz/artifacts/$t.log"
        mkdir -p "$dir/fuzz/artifacts"
        # -timeout: one input running past 10 s is a hang, reported like a crash.
        # One target directory for both fuzz crates: their locks pin the workspace's
        # versions, so the instrumented dependencies are built once.
        if ! ( cd "$dir" && RUSTC_BOOTSTRAP=1 cargo fuzz run --target-dir "$ROOT/target/fuzz" "$t" "fuzz/corpus/$t" "fuzz/seeds/$t" \
                -- -max_total_time="$secs" -timeout=10 -print_final_stats=1 ) >"$log" 2>&1; then
            tail -40 "$log" >&2
            die "fuzz target $t ($dir) found a crash or did not build (above; whole log: $log). The input is under $dir/fuzz/artifacts/$t/; reproduce with: cd $dir && RUSTC_BOOTSTRAP=1 cargo fuzz run $t fuzz/artifacts/$t/<file>"
        fi
        grep -E '^(Done [0-9]+ runs|stat::peak_rss_mb)' "$log" || true
        total=$((total + secs))
    done
done
echo "fuzzed ${total}s in all, no crash"
