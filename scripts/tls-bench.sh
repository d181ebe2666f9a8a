#!/usr/bin/env bash
# What TLS costs: 64 B Echo latency and 16 MiB Sink throughput over stock tonic, stock
# tonic with TLS, Ibex tcp and Ibex tcp with TLS, side by side in alternating rounds (each
# round runs every transport once, in a rotating order, with fresh servers), and the median
# of each over the rounds.
#
#   scripts/tls-bench.sh [ROUNDS]          # default 5
#   BASE=path/to/other/ibex-bench scripts/tls-bench.sh
#
# BASE adds that build's ibex-tcp as `ibex-tcp@base` to the rounds: plain tcp before and
# after a change, measured in the same run. Build first: cargo build --release -p ibex-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
bin=${BIN:-target/release/ibex-bench}
out=${OUT:-target/tls-bench}
rm -rf "$out"
mkdir -p "$out"
runs=("$bin tonic" "$bin tonic-tls" "$bin ibex-tcp" "$bin ibex-tcp-tls")
if [[ -n "${BASE:-}" ]]; then
    runs+=("$BASE ibex-tcp@base")
fi
echo "load: $(uptime)"
for ((n = 1; n <= rounds; n++)); do
    k=${#runs[@]}
    for ((i = 0; i < k; i++)); do
        read -r b t <<<"${runs[$(((i + n) % k))]}"
        label=$t
        t=${t%@base}
        "$b" compare --quick --duration 1 --warmup 0.25 --rounds 0 \
            --transports "$t" --benches latency,bw --out "$out/$n-$label" >/dev/null
        sed "s/\"transport\":\"$t\"/\"transport\":\"$label\"/" "$out/$n-$label/results.jsonl" \
            >>"$out/all.jsonl"
    done
    echo "round $n done"
done
python3 - "$out/all.jsonl" <<'PY'
import json, statistics, sys
lat, bw = {}, {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["bench"] == "latency" and r["bytes"] == 64 and r["payload"] == "1 buffer":
        lat.setdefault(r["transport"], []).append(r["p50_us"])
    if r["bench"] == "bw" and r["bytes"] == 16 << 20 and r["window"] == 1:
        bw.setdefault(r["transport"], []).append(r["mb_s"])
print(f"{'transport':<16}{'64 B Echo p50 µs':>18}{'16 MiB Sink MB/s':>18}   (median of {len(next(iter(lat.values())))} rounds)")
for t in lat:
    print(f"{t:<16}{statistics.median(lat[t]):>18.1f}{statistics.median(bw.get(t, [0])):>18.0f}")
def ratio(a, b, d, f):
    if a in d and b in d:
        print(f"{a} / {b}: {f(statistics.median(d[a]) / statistics.median(d[b])):.2f}")
print()
ratio("ibex-tcp-tls", "ibex-tcp", lat, lambda x: x)
ratio("ibex-tcp-tls", "ibex-tcp", bw, lambda x: x)
ratio("tonic-tls", "ibex-tcp-tls", lat, lambda x: x)
ratio("ibex-tcp-tls", "tonic-tls", bw, lambda x: x)
ratio("ibex-tcp", "ibex-tcp@base", lat, lambda x: x)
ratio("ibex-tcp", "ibex-tcp@base", bw, lambda x: x)
PY
