#!/usr/bin/env bash
# An emulated cluster on one machine: every PS and worker in a network namespace of its
# own ("host"), each joined to one bridge by a veth pair whose two ends are shaped with
# `tc tbf` to RATE, so every host has a link of RATE each way. Then, over Ibex tcp:
#   1. `connect_auto` from a worker host to a PS host picks tcp, although the PS's shm
#      socket is in plain sight on the shared filesystem;
#   2. the demo (`ibex launch`, 2 PS + 2 workers, each on its own host) trains to >= 90%
#      test accuracy, and every worker connection to a PS was tcp;
#   3. `ibex-bench ps-step` (1 worker, 2 PS hosts) over Ibex tcp reaches >= 80% of the
#      worker's link rate, with stock tonic printed beside it.
# The namespaces, the bridge and the processes go away on exit, however it ends.
#
#   scripts/cluster-netns.sh [--rate 10gbit] [--bin DIR] [--model resnet50] [--steps N]
#
# RATE is a tc rate (`10gbit`, `2500mbit`). DIR holds ibex, ibex-ps and ibex-bench
# (default target/release; build: cargo build --release -p ibex-cluster -p ibex-ps
# -p ibex-bench). Needs root, iproute2 (`ip`, `tc`) and python3; without them it says so
# and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."

RATE=10gbit
BIN=target/release
MODEL=resnet50
STEPS=6
DEMO_STEPS=300
while [ $# -gt 0 ]; do
    case "$1" in
        --rate) RATE=$2; shift 2 ;;
        --bin) BIN=$2; shift 2 ;;
        --model) MODEL=$2; shift 2 ;;
        --steps) STEPS=$2; shift 2 ;;
        --demo-steps) DEMO_STEPS=$2; shift 2 ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

skip() { echo "skipped: $*"; exit 0; }
fail() { echo "FAILED: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || skip "network namespaces need root"
command -v ip >/dev/null 2>&1 || skip "no 'ip' (iproute2)"
command -v tc >/dev/null 2>&1 || skip "no 'tc' (iproute2)"
command -v python3 >/dev/null 2>&1 || skip "no python3 (reads the JSON results)"
for b in ibex ibex-ps ibex-bench; do
    [ -x "$BIN/$b" ] || fail "$BIN/$b not found: cargo build --release -p ibex-cluster -p ibex-ps -p ibex-bench (or pass --bin DIR)"
done
BIN=$(cd "$BIN" && pwd)

# The link rate in bytes per second, from tc's notation.
rate_bytes=$(python3 - "$RATE" <<'EOF'
import re, sys
m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)(bit|bps)", sys.argv[1].lower())
if not m:
    sys.exit(f"--rate {sys.argv[1]!r}: write it as tc does, e.g. 10gbit or 2500mbit")
n = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
print(int(n / 8 if m.group(3) == "bit" else n))
EOF
) || exit 2
# tbf's bucket: a millisecond at the rate, and never less than two 64 KiB GSO packets.
burst=$(( rate_bytes / 1000 > 131072 ? rate_bytes / 1000 : 131072 ))

tag=$(printf '%04x' $(( (RANDOM << 1 ^ $$) & 0xffff )))
pre="ibx$tag"
br="$pre-br"
hosts=(ps0 ps1 w0 w1)
declare -A ipof=([ps0]=10.54.0.1 [ps1]=10.54.0.2 [w0]=10.54.0.11 [w1]=10.54.0.12)
dir=$(mktemp -d "${TMPDIR:-/tmp}/ibex-netns.XXXXXX")
pids=()

cleanup() {
    set +e
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
    for h in "${hosts[@]}"; do
        # Whatever still runs in the namespace (a worker's children) goes with it.
        for p in $(ip netns pids "$pre-$h" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
        ip netns del "$pre-$h" 2>/dev/null
        ip link del "$pre-$h" 2>/dev/null
    done
    ip link del "$br" 2>/dev/null
    rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ns() { local h=$1; shift; ip netns exec "$pre-$h" "$@"; }
# Starts a command in host H's namespace in the background, its output in $dir/NAME.log.
bg() {
    local h=$1 name=$2; shift 2
    ns "$h" "$@" >"$dir/$name.log" 2>&1 &
    pids+=($!)
}

ip netns add "$pre-probe" 2>/dev/null || skip "cannot create network namespaces here"
ip netns del "$pre-probe"
ip link add "$br" type bridge || skip "cannot create a bridge here"
ip link set "$br" up
for h in "${hosts[@]}"; do
    ip netns add "$pre-$h"
    ip link add "$pre-$h" type veth peer name "$pre-$h-n"
    ip link set "$pre-$h-n" netns "$pre-$h"
    ip link set "$pre-$h" master "$br" up
    ns "$h" ip link set "$pre-$h-n" name eth0
    ns "$h" ip addr add "${ipof[$h]}/24" dev eth0
    ns "$h" ip link set eth0 up
    ns "$h" ip link set lo up
    # Both directions of the host's link: into the namespace on the bridge side, out of it
    # inside.
    tc qdisc add dev "$pre-$h" root tbf rate "$RATE" burst "$burst" latency 50ms \
        || skip "tc cannot add a tbf qdisc here (sch_tbf missing?)"
    ns "$h" tc qdisc add dev eth0 root tbf rate "$RATE" burst "$burst" latency 50ms
done
echo "== hosts ${hosts[*]} on bridge $br, every link shaped to $RATE each way (tbf, burst $burst B)"

# Every process shares this directory, as tasks of a job on a shared filesystem would.
export IBEX_SHM_DIR="$dir"

# Stops what runs on the PS hosts (this script's own PS processes) and waits for it.
stop_ps() {
    local p
    for p in $(ip netns pids "$pre-ps0"; ip netns pids "$pre-ps1"); do
        kill "$p" 2>/dev/null || true
    done
    for _ in $(seq 100); do
        [ -z "$(ip netns pids "$pre-ps0"; ip netns pids "$pre-ps1")" ] && return 0
        sleep 0.1
    done
}

# Waits until host H listens on PORT (tcp), or fails after 30 s naming LOG.
wait_listen() {
    local h=$1 port=$2 log=$3
    for _ in $(seq 300); do
        ns "$h" ss -Hltn "sport = :$port" 2>/dev/null | grep -q . && return 0
        sleep 0.1
    done
    fail "nothing listens on ${ipof[$h]}:$port after 30 s; $log says: $(tail -5 "$dir/$log.log")"
}

echo
echo "== connect_auto from w0 to ps0 (the shm socket is on the shared filesystem)"
bg ps0 auto "$BIN/ibex-bench" auto --listen "0.0.0.0:7200"
wait_listen ps0 7200 auto
[ -S "$dir/ibex-7200.sock" ] || fail "listen_auto made no shm socket at $dir/ibex-7200.sock"
ns w0 "$BIN/ibex-bench" auto --connect "${ipof[ps0]}:7200" --expect tcp \
    || fail "connect_auto from another host did not use tcp"

echo
echo "== demo: 2 PS and 2 workers on four hosts over tcp, $DEMO_STEPS steps"
cat >"$dir/spec.toml" <<EOF
[cluster]
ps = ["${ipof[ps0]}:7000", "${ipof[ps1]}:7000"]
workers = ["${ipof[w0]}:7000", "${ipof[w1]}:7000"]
transport = "tcp"
EOF
for i in 0 1; do
    bg "ps$i" "demo-ps$i" "$BIN/ibex" launch --spec "$dir/spec.toml" --job ps --index "$i" \
        --checkpoint-every 0 --checkpoint-dir "$dir/ckpt-$i"
done
demo_workers=()
for i in 0 1; do
    ns "w$i" "$BIN/ibex" launch --spec "$dir/spec.toml" --job worker --index "$i" \
        --steps "$DEMO_STEPS" --log-every 100 --report "$dir/report-$i.json" \
        >"$dir/demo-w$i.log" 2>&1 &
    demo_workers+=($!)
    pids+=($!)
done
for i in 0 1; do
    wait "${demo_workers[$i]}" || fail "demo worker $i failed: $(tail -20 "$dir/demo-w$i.log")"
done
python3 - "$dir/report-0.json" "$dir/report-1.json" <<'EOF' || fail "the demo's results (above)"
import json, sys
for path in sys.argv[1:]:
    r = json.load(open(path))
    links = [l for l in r["comm_profile"].splitlines() if l.startswith("PS ")]
    print(f"  {path.rsplit('/', 1)[-1]}: {r['steps']} steps, test accuracy {r['test_accuracy']:.3f}")
    for l in links:
        print("   ", l)
    assert len(links) == 2, "a connection to each of the 2 PS"
    assert all(" transport tcp:" in l for l in links), "every PS connection over tcp"
    assert r["test_accuracy"] >= 0.9, f"test accuracy {r['test_accuracy']} is below 0.9"
EOF
stop_ps

echo
echo "== ps-step $MODEL, 1 worker (w0) x 2 PS (ps0, ps1), $STEPS steps, links at $RATE"
# One worker: its link carries every pull in and every push out, so the step cannot beat
# moving 2 x the model at the link's rate; that is the ceiling.
step() {
    local transport=$1 scheme=$2 port=$3
    local list=()
    for i in 0 1; do
        bg "ps$i" "step-$transport-ps$i" "$BIN/ibex-ps" --listen "$scheme://0.0.0.0:$port" \
            --shard "$i" --num-workers 1 --mode sync --sync-timeout-secs 120
        list+=("${ipof[ps$i]}:$port")
    done
    for i in 0 1; do wait_listen "ps$i" "$port" "step-$transport-ps$i"; done
    IBEX_PS="$BIN/ibex-ps" "$BIN/ibex-bench" ps-step --model "$MODEL" --transport "$transport" \
        --workers 1 --worker-netns "$pre-w0" --connect "$(IFS=,; echo "${list[*]}")" \
        --steps "$STEPS" --warmup-steps 1 --json >"$dir/step-$transport.json" \
        || fail "ps-step over $transport: $(tail -5 "$dir/step-$transport.json")"
    stop_ps
}
step ibex-tcp tcp 7100
step tonic http 7101
echo "  load average: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$dir/step-ibex-tcp.json" "$dir/step-tonic.json" "$rate_bytes" "$RATE" <<'EOF' || fail "ibex-tcp below 80% of the link rate"
import json, sys
rec = lambda p: next(json.loads(l) for l in open(p) if l.startswith("{"))
tcp, tonic = rec(sys.argv[1]), rec(sys.argv[2])
ceiling = int(sys.argv[3]) / 1e6
print(f"  {'transport':<10} {'steps/s':>8} {'MB/s':>8} {'of link':>8}")
for r in (tcp, tonic):
    print(f"  {r['transport']:<10} {r['rpc_s']:>8.2f} {r['mb_s']:>8.0f} {r['mb_s'] / ceiling:>8.0%}")
print(f"  {'link':<10} {'':>8} {ceiling:>8.0f} {'100%':>8}   ({sys.argv[4]} each way)")
assert tcp["mb_s"] >= 0.8 * ceiling, (
    f"ibex-tcp moved {tcp['mb_s']:.0f} MB/s, below 80% of {ceiling:.0f}. If this machine's "
    "CPUs cannot move that much at all (see what --rate 100gbit, in effect unshaped, gives), "
    "pass a lower --rate"
)
EOF
echo
echo "cluster-netns: ok"
