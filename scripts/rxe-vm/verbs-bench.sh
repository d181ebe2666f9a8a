#!/usr/bin/env bash
# verbs-bench.sh BENCH_BINARY: runs inside the rxe-vm guest (scripts/verbs-test.sh --bench).
# Compares the verbs link with perftest on the same rxe device and prints ratios: under TCG
# emulation only ratios mean anything.
set -euo pipefail
BIN=$1
DEV=${RXE_DEV:-rxe0}
OUT=$(mktemp -d)
export IBEX_TEST_SERVER_DEV=$DEV IBEX_TEST_CLIENT_DEV=$DEV

# perftest: server in the background, client against loopback (perftest's TCP exchange).
perf() { # NAME TOOL ARGS...
    local name=$1 tool=$2; shift 2
    "$tool" -d "$DEV" -x 0 "$@" >"$OUT/$name.srv" 2>&1 &
    local srv=$!
    sleep 2
    "$tool" -d "$DEV" -x 0 "$@" 127.0.0.1 >"$OUT/$name.cli" 2>&1 || { cat "$OUT/$name.cli" >&2; return 1; }
    wait "$srv" || true
}
perf send_lat ib_send_lat -s 64 -n 2000
perf read_bw ib_read_bw -s 1048576 -n 64

# ib_send_lat: "#bytes #iterations t_min t_max t_typical t_avg ..."; ib_read_bw: "#bytes
# #iterations BW_peak BW_average MsgRate" (MB/sec).
lat_typ=$(awk '$1 == 64 && NF >= 6 { print $5; exit }' "$OUT/send_lat.cli")
lat_avg=$(awk '$1 == 64 && NF >= 6 { print $6; exit }' "$OUT/send_lat.cli")
bw=$(awk '$1 == 1048576 && NF >= 4 { print $4; exit }' "$OUT/read_bw.cli")
echo "perftest ib_send_lat -s 64 -x 0: typical ${lat_typ} us, avg ${lat_avg} us"
echo "perftest ib_read_bw -s 1M -x 0: ${bw} MB/s"

"$BIN" --ignored --nocapture --test-threads=1 >"$OUT/ibex" 2>&1 || { cat "$OUT/ibex" >&2; exit 1; }
grep -oE 'BENCH [a-z_]+ [0-9.]+' "$OUT/ibex"
python3 - "$OUT/ibex" "$lat_typ" "$lat_avg" "$bw" <<'PY'
import re, sys
# --nocapture output may share a line with the test harness's own "test ... " prefix.
vals = {k: float(v) for k, v in re.findall(r"BENCH (\w+) ([0-9.]+)", open(sys.argv[1]).read())}
lat_typ, lat_avg, bw = map(float, sys.argv[2:5])
for mode in ("event", "spin2ms", "busy"):
    t, a = vals.get(f"lat_{mode}_typical_us"), vals.get(f"lat_{mode}_avg_us")
    if t is not None and a is not None:
        print(f"ibex verbs {mode:8} 64 B one-way latency: typical {t:.1f} us = {t / lat_typ:.2f}x ib_send_lat, "
              f"avg {a:.1f} us = {a / lat_avg:.2f}x")
    b = vals.get(f"read_bw_{mode}_MBps")
    if b is not None:
        print(f"ibex verbs {mode:8} RDMA READ bandwidth: {b:.1f} MB/s = {b / bw:.2f}x ib_read_bw")
PY
rm -rf "$OUT"
