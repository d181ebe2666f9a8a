#!/usr/bin/env bash
# What one 64 B Echo call costs one side of it: instructions, modelled instruction-cache
# misses and heap allocations (calls to malloc and calloc) per call, with that side under
# callgrind and the other side native.
#   scripts/percall.sh [server|client] [TRANSPORT] [BIN]
#   defaults: server, ibex-shm, target/release/ibex-bench (build it first:
#   cargo build --release -p ibex-bench)
# The spin is off (IBEX_SPIN_US=0), so the counts are the call's work and not a spin
# loop's; the process's start-up is spread over the calls (a few hundred instructions a
# call at the usual 8-10 k calls). The cache model is a 32 KiB 8-way L1 with 64 B lines,
# as this project's 2-core machines report; it is LRU with no prefetch, so compare its
# misses between builds, not with time. Needs valgrind (apt install valgrind).
set -euo pipefail
side="${1:-server}"
transport="${2:-ibex-shm}"
bin="${3:-target/release/ibex-bench}"
case "$side" in
  server | client) ;;
  *) echo "percall.sh: the side is 'server' or 'client', not '$side'" >&2; exit 2 ;;
esac
command -v valgrind > /dev/null || { echo "percall.sh: needs valgrind (apt install valgrind)" >&2; exit 2; }
[ -x "$bin" ] || { echo "percall.sh: no $bin; build it first: cargo build --release -p ibex-bench" >&2; exit 2; }

dir=$(mktemp -d)
server_pid=
cleanup() {
  local rc=$?
  if [ -n "$server_pid" ]; then
    kill -TERM "$server_pid" 2> /dev/null || true
    wait "$server_pid" 2> /dev/null || true
  fi
  rm -rf "$dir"
  exit "$rc"
}
trap cleanup EXIT
export IBEX_SPIN_US=0
grind=(valgrind --tool=callgrind --cache-sim=yes --I1=32768,8,64 --D1=32768,8,64
  --LL=1048576,16,64 --callgrind-out-file="$dir/out")

if [ "$side" = server ]; then
  "${grind[@]}" "$bin" server --transport "$transport" --threads 0 > "$dir/server.log" 2>&1 &
else
  "$bin" server --transport "$transport" --threads 1 > "$dir/server.log" 2>&1 &
fi
server_pid=$!
addr=
for _ in $(seq 1 200); do
  addr=$(grep -oE '(shm|tcp|http)://[^ ]+' "$dir/server.log" | head -1 || true)
  [ -n "$addr" ] && break
  kill -0 "$server_pid" 2> /dev/null || break
  sleep 0.2
done
[ -n "$addr" ] || { echo "percall.sh: the server printed no address:" >&2; cat "$dir/server.log" >&2; exit 1; }

client=("$bin" latency --transport "$transport" --connect "$addr" --scheme uniform
  --category small --size 64 --warmup 0 --duration 5 --runs 1)
[ "$side" = client ] && client=("${grind[@]}" "${client[@]}")
# A failed client says why, rather than ending the script with its log deleted.
"${client[@]}" > "$dir/client.log" 2>&1 || true
calls=$(awk '$1 == "latency" { print $8 }' "$dir/client.log")
[ -n "$calls" ] || { echo "percall.sh: the client reported no calls:" >&2; cat "$dir/client.log" >&2; exit 1; }
kill -TERM "$server_pid" 2> /dev/null || true
wait "$server_pid" 2> /dev/null || true
server_pid=

python3 - "$dir/out" "$calls" "$side" "$transport" << 'EOF'
import re, sys
path, calls, side, transport = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
events, totals, allocs, names, pending = None, None, 0, {}, None
for line in open(path, errors="replace"):
    if line.startswith("events:"):
        events = line.split()[1:]
    elif line.startswith("totals:") or line.startswith("summary:"):
        totals = [int(x) for x in line.split()[1:]]
    elif line.startswith("cfn="):
        m = re.match(r"cfn=\((\d+)\)(?: (.*))?", line.strip())
        if m.group(2):
            names[m.group(1)] = m.group(2)
        pending = names.get(m.group(1), "")
    elif line.startswith("fn="):
        m = re.match(r"fn=\((\d+)\)(?: (.*))?", line.strip())
        if m and m.group(2):
            names[m.group(1)] = m.group(2)
    elif line.startswith("calls=") and pending is not None:
        if pending in ("malloc", "calloc"):
            allocs += int(line[6:].split()[0])
        pending = None
t = dict(zip(events, totals))
print(f"{transport} {side}: {calls} calls; per call: {t['Ir'] / calls:.0f} instructions, "
      f"{t['I1mr'] / calls:.0f} I1 misses, {(t['D1mr'] + t['D1mw']) / calls:.0f} D1 misses, "
      f"{allocs / calls:.1f} allocations")
EOF
